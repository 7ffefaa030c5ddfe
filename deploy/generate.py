"""Generate sluice's Grafana dashboard and Prometheus rules from Python.

    python deploy/generate.py            # write deploy/grafana/sluice.json, deploy/prometheus/rules.yml
    python deploy/generate.py --check    # exit 1 if the committed files differ from what this makes

The dashboard is built with grafana-foundation-sdk (``pip install -e '.[dev]'``);
the rules are plain data.  Never edit the outputs by hand: change this file and
regenerate.  ``tests/deploy/test_generated.py`` regenerates and compares, and
``tests/deploy/test_metric_names.py`` checks every metric name the dashboard
and the rules use against the ``/metrics`` of a real server and gateway.

SLOs (``OBJECTIVES`` below): per priority class, the share of requests served
within the class's TTFT target (the server's own judgement, ``--slo``:
``sluice_slo_attained_total / sluice_slo_requests_total``, where shed and failed
requests count as missed), and the share answered without a 5xx.  The
burn-rate alerts follow the multi-window, multi-burn-rate recipe of the Google
SRE workbook: page when the last hour and the last 5 minutes both burn the
30-day budget 14.4x faster than even (2% of it gone in an hour), ticket when the
last 6 hours and the last 30 minutes both burn it 6x faster.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "sluice.json"
RULES = HERE / "prometheus" / "rules.yml"

RATE = "$__rate_interval"
INST = 'instance=~"$instance"'


# share of each class's requests that must meet its TTFT target (and be answered without a 5xx)
OBJECTIVES = {"p0": 0.99, "p1": 0.99, "p2": 0.95}
# (long window, short window, burn rate, severity, for)
BURN_WINDOWS = (("1h", "5m", 14.4, "page", "2m"), ("6h", "30m", 6.0, "ticket", "15m"))


# -- dashboard ------------------------------------------------------------------------


def build_dashboard() -> dict[str, Any]:
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm

    ds = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
    ids = iter(range(1, 1000))

    def q(expr: str, legend: str = "", ref: str = "A") -> Any:
        return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(ds)

    def targets(panel: Any, queries: list[tuple[str, str]]) -> Any:
        for i, (expr, legend) in enumerate(queries):
            panel = panel.with_target(q(expr, legend, chr(ord("A") + i)))
        return panel

    def legend() -> Any:
        return cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM).show_legend(True)

    def tooltip() -> Any:
        return cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)

    def ts(title: str, unit: str, queries: list[tuple[str, str]], *, desc: str = "", span: int = 12,
           stack: bool = False, bars: bool = False) -> Any:  # fmt: skip
        p = (timeseries.Panel().id(next(ids)).title(title).description(desc).unit(unit).datasource(ds)
             .span(span).height(8).legend(legend()).tooltip(tooltip()).line_width(1).fill_opacity(10))  # fmt: skip
        if stack:
            p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        if bars:
            p = p.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
        return targets(p, queries)

    def big(title: str, unit: str, expr: str, *, desc: str = "", thresholds: list[tuple[float | None, str]] = ()) -> Any:
        steps = [dm.Threshold(value=v, color=c) for v, c in (thresholds or [(None, "green")])]
        p = (stat.Panel().id(next(ids)).title(title).description(desc).unit(unit).datasource(ds).span(4).height(4)
             .graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
             .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
             .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)))  # fmt: skip
        return p.with_target(q(expr))

    def timeline(title: str, expr: str, legend_: str, states: dict[str, tuple[str, str]], desc: str = "") -> Any:
        mapping = dm.ValueMap(options={k: dm.ValueMappingResult(text=t, color=c) for k, (t, c) in states.items()})
        p = (statetimeline.Panel().id(next(ids)).title(title).description(desc).datasource(ds).span(12).height(8)
             .mappings([mapping]).show_value(cm.VisibilityMode.NEVER).legend(legend()))  # fmt: skip
        return p.with_target(q(expr, legend_))

    def row(title: str) -> Any:
        return db.Row(title).id(next(ids))

    def quantiles(metric: str, by: str = "priority", sel: str = INST, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
        selector = f"{metric}_bucket{{{sel}}}" if sel else f"{metric}_bucket"
        return [(f"histogram_quantile({x}, sum by (le, {by}) (rate({selector}[{RATE}])))",
                 f"p{round(x * 100)} {{{{{by}}}}}") for x in qs]  # fmt: skip

    d = (
        db.Dashboard("sluice: serving and gateway")
        .uid("sluice")
        .description("Generated by deploy/generate.py from sluice's own metric names; do not edit by hand.")
        .tags(["sluice", "llm-serving", "generated"])
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            db.QueryVariable("instance").label("Replica").datasource(ds)
            .query("label_values(sluice_model_info, instance)").refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True).include_all(True).all_value(".*").sort(dm.VariableSort.ALPHABETICAL_ASC)
        )  # fmt: skip
        # ---- overview
        .with_row(row("Overview"))
        .with_panel(big("Requests / s", "reqps", f"sum(rate(sluice_requests_total{{{INST}}}[{RATE}]))"))
        .with_panel(big("5xx share", "percentunit",
                        f'sum(rate(sluice_requests_total{{status=~"5..",{INST}}}[{RATE}])) '
                        f"/ sum(rate(sluice_requests_total{{{INST}}}[{RATE}]))",
                        thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]))  # fmt: skip
        .with_panel(big("p95 time to first token", "s",
                        f"histogram_quantile(0.95, sum by (le) (rate(sluice_time_to_first_token_seconds_bucket{{{INST}}}[{RATE}])))",
                        thresholds=[(None, "green"), (1.0, "orange"), (2.5, "red")]))  # fmt: skip
        .with_panel(big("Running requests", "short", f"sum(sluice_num_requests_running{{{INST}}})"))
        .with_panel(big("Degradation level (max)", "short", "max(sluice_gateway_degradation_level)",
                        desc="0 normal, 1 max_tokens cap, 2 fallback version, 3 shedding",
                        thresholds=[(None, "green"), (1, "yellow"), (2, "orange"), (3, "red")]))  # fmt: skip
        .with_panel(big("Routable replicas", "short", "sum(sluice_gateway_model_routable_replicas)",
                        thresholds=[(None, "red"), (1, "orange"), (2, "green")]))  # fmt: skip
        # ---- SLO per class
        .with_row(row("SLO per priority class"))
        .with_panel(ts("SLO attainment", "percentunit", [
            (f"sum by (priority) (rate(sluice_slo_attained_total{{{INST}}}[{RATE}])) "
             f"/ sum by (priority) (rate(sluice_slo_requests_total{{{INST}}}[{RATE}]))", "{{priority}}"),
        ], span=8, desc="Share of finished requests served within their class's TTFT target (--slo); "
                        "shed and failed requests count as missed."))  # fmt: skip
        .with_panel(ts("Predicted TTFT and target", "s", [
            (f"max by (priority) (sluice_predicted_ttft_seconds{{{INST}}})", "predicted {{priority}}"),
            (f"max by (priority) (sluice_slo_ttft_target_seconds{{{INST}}})", "target {{priority}}"),
        ], span=8, desc="What a new request of each class would wait now; admission answers 429 above the target."))  # fmt: skip
        .with_panel(ts("Admission rejections", "reqps", [
            (f"sum by (priority, reason) (rate(sluice_admission_rejected_total{{{INST}}}[{RATE}]))",
             "{{reason}} {{priority}}"),
        ], span=8, desc="slo_unattainable: predicted TTFT over target; queue_full; shed: queued lower class "
                        "dropped for a higher one."))  # fmt: skip
        # ---- latency per class
        .with_row(row("Latency per priority class"))
        .with_panel(ts("Time to first token", "s", quantiles("sluice_time_to_first_token_seconds"),
                       desc="Arrival at the API process to the first token, by class (x-priority)."))
        .with_panel(ts("Time per output token", "s", quantiles("sluice_time_per_output_token_seconds"),
                       desc="Mean gap between output tokens after the first, per request."))
        .with_panel(ts("End-to-end latency", "s", quantiles("sluice_e2e_request_latency_seconds")))
        .with_panel(ts("Queue time", "s", quantiles("sluice_queue_time_seconds"),
                       desc="Arrival to first scheduling in the engine."))
        # ---- load
        .with_row(row("Load"))
        .with_panel(ts("Running and waiting requests by class", "short", [
            (f"sum by (priority) (sluice_num_requests_running_by_priority{{{INST}}})", "running {{priority}}"),
            (f"sum by (priority) (sluice_num_requests_waiting_by_priority{{{INST}}})", "waiting {{priority}}"),
            (f"sum(sluice_num_requests_queued{{{INST}}})", "admitted, not started (API)"),
        ], stack=False))  # fmt: skip
        .with_panel(ts("Tokens / s", "short", [
            (f"sum(rate(sluice_prompt_tokens_total{{{INST}}}[{RATE}]))", "prompt"),
            (f"sum(rate(sluice_generation_tokens_total{{{INST}}}[{RATE}]))", "generated"),
        ]))  # fmt: skip
        .with_panel(ts("Engine step", "s", [
            (f"sluice_engine_step_seconds{{{INST}}}", "step {{instance}}"),
            (f"rate(sluice_engine_steps_total{{{INST}}}[{RATE}])", "steps/s {{instance}}"),
        ], desc="Duration of the last step and steps per second, per replica."))  # fmt: skip
        .with_panel(ts("Host CPU and memory", "percentunit", [
            (f"sluice_host_cpu_utilization_ratio{{{INST}}}", "cpu {{instance}}"),
            (f"sluice_host_memory_used_ratio{{{INST}}}", "memory {{instance}}"),
        ]))  # fmt: skip
        # ---- KV cache
        .with_row(row("KV cache"))
        .with_panel(ts("KV cache usage", "percentunit", [
            (f"sluice_kv_cache_usage_ratio{{{INST}}}", "{{instance}}"),
        ], span=8))  # fmt: skip
        .with_panel(ts("Prefix cache hit rate", "percentunit", [
            (f"sum by (instance) (rate(sluice_prefix_cache_hits_total{{{INST}}}[{RATE}])) "
             f"/ sum by (instance) (rate(sluice_prefix_cache_queries_total{{{INST}}}[{RATE}]))", "{{instance}}"),
        ], span=8, desc="Prompt tokens served from cached KV blocks / prompt tokens looked up."))  # fmt: skip
        .with_panel(ts("Preemptions / s", "short", [
            (f"sum by (instance) (rate(sluice_preemptions_total{{{INST}}}[{RATE}]))", "{{instance}}"),
        ], span=8, desc="Requests freed to make room for a higher class, recomputed later."))  # fmt: skip
        # ---- LoRA adapters
        .with_row(row("LoRA adapters"))
        .with_panel(ts("Adapters in memory and in use", "short", [
            (f"sum by (instance) (sluice_lora_loaded_adapters{{{INST}}})", "loaded {{instance}}"),
            (f"sum by (instance) (sluice_lora_active_adapters{{{INST}}})", "active {{instance}}"),
            (f"max by (instance) (sluice_lora_max_active_adapters{{{INST}}})", "max per step {{instance}}"),
            (f"sum by (instance) (sluice_lora_requests_waiting_for_load{{{INST}}})", "waiting for a load {{instance}}"),
        ], span=8))  # fmt: skip
        .with_panel(ts("Adapter loads, failures, evictions", "ops", [
            (f"sum(rate(sluice_lora_loads_total{{{INST}}}[{RATE}]))", "loads"),
            (f"sum(rate(sluice_lora_load_failures_total{{{INST}}}[{RATE}]))", "failures"),
            (f"sum(rate(sluice_lora_evictions_total{{{INST}}}[{RATE}]))", "evictions (LRU)"),
        ], span=8))  # fmt: skip
        .with_panel(ts("Adapter load time", "s", [
            (f"histogram_quantile(0.95, sum by (le) (rate(sluice_lora_load_seconds_bucket{{{INST}}}[{RATE}])))", "p95"),
        ], span=8, desc="Read, check and pack one adapter (off the engine step)."))  # fmt: skip
        # ---- shed and rate limited
        .with_row(row("Shed and rate-limited requests"))
        .with_panel(ts("Server: refused by class", "reqps", [
            (f'sum by (priority, status) (rate(sluice_requests_total{{status=~"429|503",{INST}}}[{RATE}]))',
             "{{status}} {{priority}}"),
        ], span=8, desc="429: admission control or the key's rate limit; 503: draining or engine down."))  # fmt: skip
        .with_panel(ts("Gateway: degraded requests", "reqps", [
            (f"sum by (action, priority) (rate(sluice_gateway_degraded_requests_total[{RATE}]))",
             "{{action}} {{priority}}"),
        ], span=8, desc="cap: max_tokens lowered; fallback: sent to the fallback version; shed: 429."))  # fmt: skip
        .with_panel(ts("Gateway: answers by status", "reqps", [
            (f"sum by (status) (rate(sluice_gateway_requests_total[{RATE}]))", "{{status}}"),
        ], span=8, stack=True))  # fmt: skip
        # ---- gateway
        .with_row(row("Gateway"))
        .with_panel(ts("Degradation level and load score", "short", [
            ("max by (model) (sluice_gateway_degradation_level)", "level {{model}}"),
            ("max by (model) (sluice_gateway_degradation_score)", "score {{model}}"),
        ], desc="Score 1.0 = at capacity; levels rise at 0.8 / 1.0 / 1.2 (docs/operations.md)."))  # fmt: skip
        .with_panel(timeline("Circuit breakers", "max by (replica) (sluice_gateway_breaker_state)", "{{replica}}",
                             {"0": ("closed", "green"), "1": ("half-open", "yellow"), "2": ("open", "red")}))
        .with_panel(timeline("Replica health (gateway checks)", "max by (replica) (sluice_gateway_replica_healthy)",
                             "{{replica}}", {"0": ("down", "red"), "1": ("up", "green")}))
        .with_panel(ts("Errors and retries", "reqps", [
            (f"sum by (kind) (rate(sluice_gateway_errors_total[{RATE}]))", "error {{kind}}"),
            (f"sum(rate(sluice_gateway_retries_total[{RATE}]))", "retried on another replica"),
        ]))  # fmt: skip
        .with_panel(ts("Gateway added latency", "s",
                       quantiles("sluice_gateway_added_latency_seconds", by="model", sel="", qs=(0.5, 0.99)),
                       desc="Arrival to the upstream request sent: auth, parsing, routing."))  # fmt: skip
        .with_panel(ts("Time to first byte p95 (gateway view)", "s", [
            ("sluice_gateway_model_ttft_p95_seconds", "{{model}}"),
        ]))  # fmt: skip
        # ---- rollout and autoscaling
        .with_row(row("Canary rollout and autoscaling"))
        .with_panel(ts("Version shares", "percent", [
            ("sluice_gateway_version_share", "{{model}} {{version}}"),
        ], span=8))  # fmt: skip
        .with_panel(ts("Rollbacks", "short", [
            (f"sum by (model, version) (increase(sluice_gateway_rollbacks_total[{RATE}]))", "{{model}} {{version}}"),
        ], span=8, bars=True, desc="A canary set to share 0 by its error rate, p99 or success drop."))  # fmt: skip
        .with_panel(ts("Autoscaler replicas", "short", [
            ("sluice_gateway_autoscale_replicas", "{{model}}"),
            (f"sum by (model, direction) (increase(sluice_gateway_autoscale_decisions_total[{RATE}]))",
             "decision {{direction}} {{model}}"),
        ], span=8))  # fmt: skip
    )
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


# -- rules ----------------------------------------------------------------------------


def build_rules() -> dict[str, Any]:
    windows = sorted({w for long, short, *_ in BURN_WINDOWS for w in (long, short)}, key=_seconds)
    recording = []
    for cls in OBJECTIVES:
        for w in windows:
            recording.append({
                "record": f"sluice:slo_miss_ratio:rate{w}",
                "expr": f'1 - sum(rate(sluice_slo_attained_total{{priority="{cls}"}}[{w}]))'
                        f' / sum(rate(sluice_slo_requests_total{{priority="{cls}"}}[{w}]))',
                "labels": {"priority": cls},
            })  # fmt: skip
            recording.append({
                "record": f"sluice:error_ratio:rate{w}",
                "expr": f'sum(rate(sluice_requests_total{{priority="{cls}",status=~"5.."}}[{w}]))'
                        f' / sum(rate(sluice_requests_total{{priority="{cls}"}}[{w}]))',
                "labels": {"priority": cls},
            })  # fmt: skip
    alerts = []
    for cls, objective in OBJECTIVES.items():
        budget = round(1 - objective, 6)
        for long, short, burn, severity, hold in BURN_WINDOWS:
            for sli, what, record in (("SLO", "requests missing their TTFT target (or shed)", "slo_miss_ratio"),
                                      ("Error", "5xx answers", "error_ratio")):  # fmt: skip
                alerts.append({
                    "alert": f"Sluice{sli}BudgetBurn",
                    "expr": f'sluice:{record}:rate{long}{{priority="{cls}"}} > {burn * budget:g}'
                            f' and sluice:{record}:rate{short}{{priority="{cls}"}} > {burn * budget:g}',
                    "for": hold,
                    "labels": {"severity": severity, "priority": cls, "slo": sli.lower()},
                    "annotations": {
                        "summary": f"{cls}: {what} burn the {objective:.1%} objective's budget {burn:g}x too fast",
                        "description": f"Share of {cls} requests: {{{{ $value | humanizePercentage }}}} over {short} "
                                       f"(and over {long}); the budget is {budget:.2%}. See the 'Latency per "
                                       "priority class' and 'Shed' rows of the sluice dashboard.",
                    },
                })  # fmt: skip
    operations = [
        {"alert": "SluiceBreakerOpen", "expr": "max by (model, replica) (sluice_gateway_breaker_state) == 2",
         "for": "1m", "labels": {"severity": "ticket"},
         "annotations": {"summary": "gateway breaker open for {{ $labels.replica }} ({{ $labels.model }})",
                         "description": "The gateway stopped routing to this replica after consecutive failures."}},
        {"alert": "SluiceDegraded", "expr": "max by (model) (sluice_gateway_degradation_level) >= 2",
         "for": "2m", "labels": {"severity": "page"},
         "annotations": {"summary": "{{ $labels.model }} degraded to level {{ $value }} (fallback or shedding)",
                         "description": "Load is above capacity: add replicas or check the autoscaler "
                                        "(GET /admin/degradation, /admin/autoscale)."}},
        {"alert": "SluiceCanaryRolledBack", "expr": "increase(sluice_gateway_rollbacks_total[10m]) > 0",
         "labels": {"severity": "ticket"},
         "annotations": {"summary": "canary {{ $labels.version }} of {{ $labels.model }} was rolled back",
                         "description": "GET /admin/rollout shows the reasons and both windows' figures."}},
        {"alert": "SluiceReplicaDown", "expr": 'up{job="sluice-serve"} == 0', "for": "1m",
         "labels": {"severity": "page"},
         "annotations": {"summary": "sluice serve {{ $labels.instance }} is not answering /metrics",
                         "description": "The process is gone or hung; its supervisor should restart it."}},
        {"alert": "SluiceReplicaUnhealthy", "expr": "max by (model, replica) (sluice_gateway_replica_healthy) == 0",
         "for": "1m", "labels": {"severity": "ticket"},
         "annotations": {"summary": "the gateway sees {{ $labels.replica }} ({{ $labels.model }}) as down",
                         "description": "Its /health check fails: draining, engine core dead, or unreachable."}},
        {"alert": "SluiceGatewayDown", "expr": 'up{job="sluice-gateway"} == 0', "for": "1m",
         "labels": {"severity": "page"},
         "annotations": {"summary": "sluice gateway {{ $labels.instance }} is not answering /metrics",
                         "description": "Clients cannot reach any replica through it."}},
    ]  # fmt: skip
    return {"groups": [
        {"name": "sluice-slo-recording", "interval": "30s", "rules": recording},
        {"name": "sluice-slo-burn", "rules": alerts},
        {"name": "sluice-operations", "rules": operations},
    ]}  # fmt: skip


def _seconds(w: str) -> int:
    return int(w[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[w[-1]]


# -- files ----------------------------------------------------------------------------

HEADER = "# Generated by deploy/generate.py; do not edit by hand (python deploy/generate.py).\n"


def render() -> dict[Path, str]:
    return {
        DASHBOARD: json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n",
        RULES: HEADER + yaml.safe_dump(build_rules(), sort_keys=False, width=120),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = p.parse_args(argv)
    stale = []
    for path, text in render().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    for path in stale:
        print(f"{path.relative_to(HERE.parent)} is stale: run python deploy/generate.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
