"""Every metric the dashboard and the alert rules use exists on a real server and gateway.

A renamed or removed metric, a label matcher on a label the metric lacks, or an
``le`` bound that is no longer a histogram bucket fails here instead of leaving an empty panel or an
alert that can never fire.  The set of names checked is computed from the
dashboard and the rules, so a new panel is checked as soon as it is generated.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from tests.deploy.promql_names import (
    Use,
    dashboard_uses,
    exposed_from_text,
    problems,
    rules_uses,
    selectors,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _dashboard() -> dict:
    return json.loads((ROOT / "deploy/grafana/sluice.json").read_text())


def _rules() -> dict:
    return yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())


def test_dashboard_metrics_exist_on_the_live_server_and_gateway(live_stack) -> None:
    exposed = exposed_from_text(live_stack.serve_metrics, live_stack.gateway_metrics)
    uses = dashboard_uses(_dashboard())
    assert len(uses) > 30, "the dashboard's queries were not found"
    bad = problems(uses, exposed)
    assert not bad, "the dashboard uses metrics sluice does not expose:\n" + "\n".join(bad)


def test_alert_and_recording_rules_use_existing_metrics_and_buckets(live_stack) -> None:
    exposed = exposed_from_text(live_stack.serve_metrics, live_stack.gateway_metrics)
    uses, recorded = rules_uses(_rules())
    assert recorded and any(u.where.startswith("rule Sluice") for u in uses)
    bad = problems(uses, exposed, recorded)
    assert not bad, "the Prometheus rules use metrics sluice does not expose:\n" + "\n".join(bad)


def test_a_renamed_metric_a_moved_label_or_a_missing_bucket_is_caught(live_stack) -> None:
    exposed = exposed_from_text(live_stack.serve_metrics, live_stack.gateway_metrics)
    doc = copy.deepcopy(_dashboard())
    text = json.dumps(doc).replace("sluice_kv_cache_usage_ratio", "sluice_kv_cache_usage")
    bad = problems(dashboard_uses(json.loads(text)), exposed)
    assert bad and all("sluice_kv_cache_usage'" in b for b in bad), bad
    rules = json.loads(json.dumps(_rules()).replace("sluice_slo_attained_total", "sluice_slo_met_total"))
    uses, recorded = rules_uses(rules)
    assert any("'sluice_slo_met_total' is not exposed" in b for b in problems(uses, exposed, recorded))
    relabelled = json.dumps(_dashboard()).replace('status=~\\"5..\\"', 'code=~\\"5..\\"')
    assert any("has no label 'code'" in b for b in problems(dashboard_uses(json.loads(relabelled)), exposed))
    bucket = 'sum(rate(sluice_time_to_first_token_seconds_bucket{le="0.4"}[5m]))'
    assert any("no bucket le='0.4'" in b for b in problems([Use("t", bucket)], exposed)), (
        "an le bound the histogram does not have must be caught")


def test_selectors_see_through_grafana_variables() -> None:
    (sel,) = selectors('rate(sluice_x_total{status=~"5..",instance=~"$instance"}[$__rate_interval])')
    assert sel[0] == "sluice_x_total" and ("status", "MatchOp.Re", "5..") in sel[1]
