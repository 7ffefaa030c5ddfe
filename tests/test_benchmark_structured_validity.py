"""benchmarks/structured_validity.py: its schemas, how it judges an answer, and one short run on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import structured_validity as sv  # noqa: E402
from benchmarks.structured_validity_schemas import SCHEMAS, TOOLS, cold_schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_schemas_are_at_least_20_and_all_accepted_by_the_engine_and_jsonschema() -> None:
    from sluice.engine.protocol import StructuredOutputs
    from sluice.engine.structured import validate_constraint

    assert len(SCHEMAS) >= 20, "issue 54 asks for at least 20 schemas"
    parameters = [t["function"]["parameters"] for t in TOOLS]
    for schema in [s["schema"] for s in SCHEMAS.values()] + parameters + [cold_schema("x")]:
        sv.validator(schema)  # a valid Draft 2020-12 schema
        validate_constraint(StructuredOutputs(json=json.dumps(schema)))  # one the engine holds answers to


def test_the_schemas_cover_the_shapes_the_issue_names() -> None:
    text = json.dumps([s["schema"] for s in SCHEMAS.values()])
    for keyword in ("minItems", "maxItems", "enum", "anyOf", "pattern", "minimum", "maximum", "format", '"null"',
                    '"boolean"', "$ref"):  # fmt: skip
        assert keyword in text, f"no schema uses {keyword}"


def test_an_answer_is_valid_only_when_it_parses_and_matches_with_formats_asserted() -> None:
    v = sv.validator(SCHEMAS["flight"]["schema"])
    good = {"from": "CDG", "to": "JFK", "date": "2025-06-02", "cabin": "economy", "passengers": 2}
    assert sv.check(v, json.dumps(good)) is None
    assert sv.check(v, json.dumps(good)[:-1]).startswith("not JSON")
    assert "passengers" in sv.check(v, json.dumps({**good, "passengers": 10}))
    assert sv.check(v, json.dumps({**good, "date": "2025-02-30"})) is not None, "formats are asserted (FormatChecker)"


def test_each_cold_schema_is_new_text() -> None:
    texts = {json.dumps(cold_schema(f"r0_f{j}")) for j in range(100)}
    assert len(texts) == 100, "each compiles cold only if its text differs"


def test_compile_metrics_are_read_from_prometheus_text() -> None:
    text = ("# HELP sluice_structured_compile_seconds Grammar compile time.\n"
            'sluice_structured_compile_seconds_bucket{le="0.001"} 1.0\n'
            "sluice_structured_compile_seconds_sum 0.25\nsluice_structured_compile_seconds_count 5.0\n"
            "sluice_structured_compiles_total 5.0\nsluice_structured_cache_hits_total 7.0\n")  # fmt: skip
    assert sv.compile_metrics(text) == {"sum": 0.25, "count": 5.0, "compiles": 5.0, "hits": 7.0}


@pytest.mark.slow
def test_a_short_run_on_a_tiny_model_has_no_invalid_answer(tmp_path: Path) -> None:
    from tests.model_factory import make_tiny_model_dir

    model = str(make_tiny_model_dir(tmp_path / "tiny-llama"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "structured_validity.py"), "--model", model, "--per-schema", "1",
         "--tool-answers", "2", "--max-tokens", "48", "--rounds", "1", "--new-schemas", "4", "--base-s", "4",
         "--solo", "1", "--no-write"], capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    n = r["validity_valid"] + r["validity_invalid"] + r["validity_cut"] + r["validity_errors"]
    assert n == len(SCHEMAS), "every request is counted once"
    assert r["validity_invalid"] == 0 == r["tools_invalid"], f"a constrained answer did not match its schema: {r['failures']}"
    assert r["validity_errors"] == 0 == r["tools_errors"]
    assert r["ttft_none_p50_ms"] > 0, "the unconstrained streams ran"
    assert r["engine_compile_mean_ms"] > 0, "the new schemas compiled in the engine (its /metrics histogram moved)"
    assert r["solo_cold_ttft_p50_ms"] > 0 and r["solo_cached_ttft_p50_ms"] > 0
