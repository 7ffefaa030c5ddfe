"""Summaries of known records, and contracts that pass and fail as they should."""

from __future__ import annotations

import pytest

from sluice.bench.contract import contract_from_dict, evaluate, list_presets, load_contract
from sluice.bench.record import RequestRecord
from sluice.bench.summary import RequestSLO, summarize


def rec(i: int, ttft: float, e2e: float, prio: str = "p1", out: int = 11, error: str = "") -> RequestRecord:  # fmt: skip
    return RequestRecord(index=i, priority=prio, start_s=float(i), end_s=float(i) + e2e, ttft_s=None if error else ttft,
                         num_input_tokens=100, num_output_tokens=0 if error else out, status=500 if error else 200, error=error)  # fmt: skip


RECORDS = [rec(i, ttft=0.01 * (i + 1), e2e=1.0, prio="p0" if i < 20 else "p1") for i in range(100)]
RECORDS += [rec(100 + i, 0, 0.1, error="HTTP 500: boom") for i in range(5)]


def test_summary_percentiles_rates_and_classes():
    s = summarize(RECORDS, duration_s=10.0)
    assert s["num_requests"] == 105 and s["num_errors"] == 5
    assert s["error_rate"] == pytest.approx(5 / 105)
    assert s["rps"] == pytest.approx(10.0), "100 successful requests in 10 s"
    assert s["output_tok_s"] == pytest.approx(110.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(505.0), "median of 10..1000 ms"
    assert s["ttft_ms"]["max"] == pytest.approx(1000.0)
    assert s["tpot_ms"]["p50"] == pytest.approx((1000 - 505) / 10, rel=0.02)
    assert s["errors"] == {"HTTP 500: boom": 5}
    assert s["by_priority"]["p0"]["num_requests"] == 20
    assert s["by_priority"]["p0"]["ttft_ms"]["max"] == pytest.approx(200.0)


def test_goodput_counts_requests_meeting_every_limit():
    s = summarize(RECORDS, duration_s=10.0, slo=RequestSLO(ttft_ms=300))
    assert s["goodput_ratio"] == pytest.approx(30 / 105), "30 requests have TTFT <= 300 ms"
    assert s["goodput_rps"] == pytest.approx(3.0)


def test_contract_pass_and_fail_per_target_and_per_class():
    c = contract_from_dict({
        "targets": {"ttft_p95_ms": 960, "min_rps": 9.5, "max_error_rate": 0.01},
        "per_priority": {"p0": {"ttft_max_ms": 200}, "p2": {"e2e_p95_ms": 1}},
    })  # fmt: skip
    res = {r.target.label: r for r in evaluate(c, summarize(RECORDS, duration_s=10.0))}
    assert res["ttft_p95_ms"].passed and res["min_rps"].passed and res["p0.ttft_max_ms"].passed
    assert not res["max_error_rate"].passed, "5/105 errors break a 1% limit"
    assert not res["p2.e2e_p95_ms"].passed and res["p2.e2e_p95_ms"].measured is None, (
        "a class that sent nothing cannot prove its target"
    )


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"targets": {"ttft_p97_ms": 1}}, "unknown target"),
        ({"targets": {"min_rps": "fast"}}, "must be a number"),
        ({"targets": {}}, "no targets"),
        ({"targets": {"min_rps": 1}, "per_priority": {"p9": {"min_rps": 1}}}, "invalid priority"),
        ({"targets": {"min_rps": 1}, "slo": 3}, "unknown key"),
    ],
)
def test_bad_contracts_are_rejected_readably(bad, msg):
    with pytest.raises(ValueError, match=msg):
        contract_from_dict(bad)


def test_the_three_presets_exist_and_say_what_the_issue_asks():
    assert list_presets() == ["cost", "latency", "throughput"]
    lat = load_contract("latency")
    assert {t.key: t.threshold for t in lat.targets}["ttft_p95_ms"] == 350
    assert lat.load["concurrency"] >= 200
    assert {t.key: t.threshold for t in load_contract("throughput").targets}["min_rps"] >= 150
    cost = load_contract("cost")
    assert cost.memory["kv_bytes_per_token"] > 0 and "weights" in cost.settings
    assert lat.request_slo() == RequestSLO(ttft_ms=350, e2e_ms=800)
    with pytest.raises(ValueError, match="neither a file nor a preset"):
        load_contract("latncy")


def test_memory_report_counts_blocks_of_16_tokens_per_request():
    from sluice.bench.report import memory_report

    recs = [rec(0, 0.1, 1.0, out=12), rec(1, 0.1, 1.0, out=28)]  # 112 and 128 tokens
    m = memory_report(recs + [rec(2, 0, 0.1, error="x")], {"kv_bytes_per_token": 1024, "block_size": 16})  # fmt: skip
    assert m is not None and m["blocks_per_request"]["mean"] == 7.5, "ceil(112/16)=7, 128/16=8"
    assert m["kv_mib_per_request"]["max"] == pytest.approx(8 * 16 * 1024 / 2**20)
    assert memory_report([rec(0, 0, 0.1, error="x")], {"kv_bytes_per_token": 1}) is None
