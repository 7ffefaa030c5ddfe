"""The committed dashboard and rules are exactly what ``deploy/generate.py`` makes."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_dashboard_and_rules_match_the_generator() -> None:
    gen = runpy.run_path(str(ROOT / "deploy/generate.py"), run_name="deploy_generate")
    for path, text in gen["render"]().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs from what deploy/generate.py makes: edit the generator, "
            "then run python deploy/generate.py (never edit the output by hand)"
        )


def test_dashboard_covers_server_and_gateway_sections() -> None:
    import json

    doc = json.loads((ROOT / "deploy/grafana/sluice.json").read_text())
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    for needed in ("SLO per priority class", "Latency per priority class", "KV cache", "LoRA adapters",
                   "Shed and rate-limited requests", "Gateway",
                   "Canary rollout and autoscaling"):  # fmt: skip
        assert needed in rows, f"the dashboard lost its {needed!r} row"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique for Grafana links to work"
