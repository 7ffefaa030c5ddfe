"""sluice.obs: metrics (Prometheus bridge), tracing (OpenTelemetry), JSON logs,
host/hardware readers, and ``sluice doctor``."""
