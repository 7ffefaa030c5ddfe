"""Speculative decoding's counters on /metrics (the bridge of ``EngineStats.spec_*``)."""

from __future__ import annotations

from sluice.engine.protocol import EngineStats
from tests.server.conftest import render_engine_stats as _scrape


def test_spec_counters_by_method_and_k() -> None:
    text = _scrape(EngineStats(spec_method="ngram", spec_drafted_tokens=40, spec_accepted_tokens=25,
                               spec_emitted_tokens=37, spec_verify_runs=12, spec_k_counts=[3, 0, 5]))  # fmt: skip
    assert 'sluice_spec_drafted_tokens_total{method="ngram"} 40.0' in text
    assert 'sluice_spec_accepted_tokens_total{method="ngram"} 25.0' in text
    assert 'sluice_spec_emitted_tokens_total{method="ngram"} 37.0' in text
    assert 'sluice_spec_verify_runs_total{method="ngram"} 12.0' in text
    assert 'sluice_spec_k_chosen_total{k="2"} 5.0' in text


def test_no_spec_metrics_while_speculation_is_off() -> None:
    assert "sluice_spec_" not in _scrape(EngineStats())
