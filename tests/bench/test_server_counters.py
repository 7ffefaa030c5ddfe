"""``sluice bench`` reports the server's speculation counters over each phase (``server_metrics``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from sluice.bench.server_metrics import parse_metrics, speculation_report
from sluice.engine.protocol import EngineStats
from tests.server.conftest import render_engine_stats as _render


def _spec(drafted: int, accepted: int, runs: int, k_counts: list[int], method: str = "ngram") -> EngineStats:
    return EngineStats(spec_method=method, spec_drafted_tokens=drafted, spec_accepted_tokens=accepted,
                       spec_emitted_tokens=accepted + runs, spec_verify_runs=runs, spec_k_counts=k_counts)  # fmt: skip


def test_a_phase_gets_the_difference_of_the_exporters_counters() -> None:
    before = parse_metrics(_render(_spec(100, 60, 30, [5, 10, 20, 0, 10])))
    after = parse_metrics(_render(_spec(180, 120, 50, [9, 10, 30, 0, 25])))
    r = speculation_report(before, after)
    assert r is not None
    assert (r["drafted"], r["accepted"], r["emitted"], r["verify_runs"]) == (80, 60, 80, 20)
    assert r["acceptance_rate"] == pytest.approx(0.75) and r["mean_accepted_len"] == pytest.approx(3.0)
    assert r["by_method"]["ngram"]["acceptance_rate"] == pytest.approx(0.75)
    assert r["k_chosen"] == {"0": 4, "2": 10, "4": 15}, "k that was never chosen in the phase is left out"
    assert r["mean_k"] == pytest.approx((2 * 10 + 4 * 15) / 29)


def test_no_report_without_counters_or_after_a_restart() -> None:
    off = parse_metrics(_render(EngineStats()))
    assert off == {}, "a server without speculation exports no sluice_spec_ family"
    assert speculation_report(off, off) is None
    assert speculation_report(None, parse_metrics(_render(_spec(5, 1, 1, [0, 5])))) is None, "unreadable before"
    hi, lo = parse_metrics(_render(_spec(100, 60, 30, [0, 50]))), parse_metrics(_render(_spec(10, 6, 3, [0, 5])))
    assert speculation_report(hi, lo) is None, "counters that went down are another server life's"
    assert speculation_report({}, parse_metrics("# TYPE other_total counter\nother_total 3\n")) is None


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from sluice.server.app import build_app
    from sluice.server.config import load_settings
    from tests.model_factory import make_tiny_model_dir
    from tests.server.conftest import ServerThread

    model = str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama"))
    spec = {"model": "self:q4", "num_speculative_tokens": 3, "k_policy": "fixed"}  # its own int4 copy drafts
    s = load_settings(model=model, kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=8,
                      speculative_config=json.dumps(spec))  # fmt: skip
    srv = ServerThread(build_app(s)).start(timeout=120)
    yield srv.url
    srv.stop()


def test_bench_run_against_a_speculating_server_reports_its_drafts(spec_server: str, bench) -> None:  # type: ignore[no-untyped-def]
    r = bench("run", "--url", spec_server, "-n", "12", "--concurrency", "4", "--input-len", "24",
              "--output-len", "24", "--ignore-eos", "--no-progress", "--model", "tiny-llama")  # fmt: skip
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.doc
    assert doc["summary"]["num_ok"] == 12
    spec = doc["speculation"]
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["emitted"] == spec["accepted"] + spec["verify_runs"], "a verifying step emits its kept run + 1"
    assert set(spec["by_method"]) == {"draft_model"} and spec["accepted"] > 0, "an int4 copy agrees often"
    assert spec["emitted"] <= doc["summary"]["mean_output_tokens"] * 12, "no more than the phase's own tokens"
    assert "speculation (the server's counters)" in r.stdout and f"{spec['drafted']:,} drafted" in r.stdout
    # a second phase counts only its own drafts
    r2 = bench("run", "--url", spec_server, "-n", "4", "--concurrency", "2", "--input-len", "24",
               "--output-len", "8", "--ignore-eos", "--no-progress", "--model", "tiny-llama")  # fmt: skip
    assert r2.exit_code == 0 and r2.doc["speculation"]["emitted"] <= 4 * 8


def test_bench_run_against_a_server_without_counters_has_no_speculation_block(fake_server, bench) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server(ttft_ms=1)
    r = bench("run", "--url", srv.url, "-n", "4", "--concurrency", "2", "--input-len", "8", "--output-len", "2",
              "--no-progress", "--model", "m")  # fmt: skip
    assert r.exit_code == 0 and "speculation" not in r.doc and "speculation" not in r.stdout


def test_unreadable_metrics_give_no_report(fake_server) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    import aiohttp

    from sluice.bench.server_metrics import scrape

    async def read(url: str) -> object:
        async with aiohttp.ClientSession() as s:
            return await scrape(s, url, timeout_s=2.0)

    srv = fake_server(metrics={'sluice_spec_drafted_tokens_total{method="ngram"': 1.0})  # a broken label set
    assert asyncio.run(read(srv.url)) is None
    assert asyncio.run(read("http://127.0.0.1:9")) is None, "nothing listening"
    ok = fake_server(metrics={'sluice_spec_drafted_tokens_total{method="ngram"}': 7.0})
    assert asyncio.run(read(ok.url)) == {("sluice_spec_drafted_tokens_total", (("method", "ngram"),)): 7.0}
