"""sluice.obs: tracing (OpenTelemetry), JSON logs, host/hardware readers and gauges,
and ``sluice doctor``.  Imports no layer above it (the server's metrics bridge
is ``sluice.server.telemetry``; the engine's part of ``doctor`` is
``sluice.engine.doctor``, wired in by ``sluice.cli``)."""
