"""Speculative decoding's pure parts: the config parser, n-gram drafts, the adaptive-k policy, verification."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sluice.engine.spec.ngram import NgramIndex, propose_ngram
from sluice.engine.spec.policy import Acceptance, SpecCandidate, choose_k
from sluice.engine.spec.verify import accepted_run
from sluice.engine.spec_config import AUTO, SpeculativeConfig, parse_speculative_config
from sluice.errors import ConfigError

# ------------------------------------------------------------ config


def test_config_takes_vllm_field_names_as_json_or_dict() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}'
    d = parse_speculative_config(text)
    assert d == parse_speculative_config(json.loads(text))
    spec = SpeculativeConfig.from_dict(d)  # type: ignore[arg-type]
    assert (spec.method.value, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 1, 5)


def test_config_model_alone_means_a_draft_model() -> None:
    d = parse_speculative_config({"model": "self:q4", "num_speculative_tokens": 4})
    assert d is not None and d["method"] == "draft_model" and d["model"] == "self:q4"


@pytest.mark.parametrize("value", ["auto", '"auto"', {"method": "auto"}])
def test_config_auto_lets_sluice_choose(value: object) -> None:
    assert parse_speculative_config(value) == parse_speculative_config(AUTO)


@pytest.mark.parametrize("value", [None, "", "none", "off"])
def test_config_none_is_off(value: object) -> None:
    assert parse_speculative_config(value) is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "not valid JSON"),
        ({"method": "medusa"}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "needs a draft 'model'"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "draft_tensor_parallel_size": 1}, "unknown field"),
        ({}, "give 'method'"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_config_errors_are_one_line_naming_the_setting(value: object, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_speculative_config(value)
    msg = str(e.value.message)
    assert says in msg and "\n" not in msg, msg
    assert e.value.setting == "speculative_config"


# ------------------------------------------------------------ n-gram


def test_ngram_drafts_what_followed_the_latest_earlier_occurrence() -> None:
    toks = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3], dtype=np.int32)
    assert propose_ngram(toks, 2, 2, 3) == [7, 8], "the latest match of the tail (1 2 3) wins"
    assert propose_ngram(toks, 10, 2, 3) == [7, 8, 0, 1, 2, 3], "a draft stops at the end of the sequence"


def test_ngram_prefers_the_longest_tail() -> None:
    toks = np.array([4, 2, 3, 6, 1, 2, 3, 8, 1, 2, 3], dtype=np.int32)
    # (2 3) last occurs before 8; (1 2 3) too; (4 2 3)-style shorter tails would pick 8 as well
    assert propose_ngram(toks, 1, 1, 3) == [8]
    toks = np.array([9, 2, 3, 6, 7, 9, 2, 3], dtype=np.int32)
    assert propose_ngram(toks, 1, 1, 3) == [6], "the 3-token tail (9 2 3) matches at the start"


def test_ngram_no_match_or_too_short_drafts_nothing() -> None:
    assert propose_ngram(np.array([1, 2, 3, 4], dtype=np.int32), 4, 2, 4) == []
    assert propose_ngram(np.array([1, 1], dtype=np.int32), 4, 2, 4) == []
    assert propose_ngram(np.array([1, 2, 1, 2], dtype=np.int32), 0, 1, 4) == []


def test_ngram_index_grows_with_the_tokens() -> None:
    idx = NgramIndex()
    toks = list(range(10))
    assert idx.tokens("a", toks).tolist() == toks
    toks += list(range(100))
    assert idx.tokens("a", toks).tolist() == toks
    idx.forget("a")
    assert len(idx) == 0


# ------------------------------------------------------------ adaptive k

MODEL = dict(base=4e-3, per_token=0.75e-3, per_seq=0.0)


def test_one_decode_with_good_acceptance_drafts_up_to_its_cap() -> None:
    k = choose_k([SpecCandidate("a", 1, 0.8, 4)], num_tokens=1, num_seqs=1, num_emitted=1, **MODEL)
    assert k == {"a": 4}


def test_poor_acceptance_drafts_fewer() -> None:
    k = choose_k([SpecCandidate("a", 1, 0.2, 4)], num_tokens=1, num_seqs=1, num_emitted=1, **MODEL)
    assert k.get("a", 0) <= 1


def test_a_compute_bound_batch_drafts_nothing() -> None:
    cands = [SpecCandidate(str(i), 1, 0.7, 4) for i in range(64)]
    k = choose_k(cands, num_tokens=64, num_seqs=64, num_emitted=64, base=4e-3, per_token=0.75e-3, per_seq=0.1e-3)
    assert sum(k.values()) == 0, f"64 decodes on a compute-bound step should not speculate, got {k}"


def test_p0_drafts_first() -> None:
    cands = [SpecCandidate("p2", 2, 0.7, 4), SpecCandidate("p0", 0, 0.7, 4)]
    k = choose_k(cands, num_tokens=8, num_seqs=8, num_emitted=8, **MODEL)
    assert k.get("p0", 0) >= 1 and k.get("p0", 0) >= k.get("p2", 0), k
    # the same acceptance at a load past which the first draft no longer pays: neither drafts
    assert choose_k(cands, num_tokens=13, num_seqs=13, num_emitted=13, **MODEL) == {}


def test_a_costly_draft_model_drafts_less() -> None:
    cands = [SpecCandidate("a", 1, 0.7, 4)]
    free = choose_k(cands, num_tokens=1, num_seqs=1, num_emitted=1, **MODEL)
    costly = choose_k(cands, num_tokens=1, num_seqs=1, num_emitted=1, draft_cost=lambda j, m: 3e-3 if m else 0.0, **MODEL)
    assert sum(costly.values()) < sum(free.values())


def test_a_flat_step_model_explores_with_one_draft() -> None:
    cands = [SpecCandidate("a", 1, 0.9, 4), SpecCandidate("b", 0, 0.5, 4)]
    k = choose_k(cands, base=0.0, per_token=1e-3, per_seq=0.0, num_tokens=2, num_seqs=2, num_emitted=2)
    assert k == {"b": 1}, "one request (P0 first) drafts one token, so the fit sees steps of two sizes"


def test_no_step_model_yet_drafts_nothing() -> None:
    assert choose_k([SpecCandidate("a", 1, 0.9, 4)], base=0.0, per_token=0.0, per_seq=0.0,
                    num_tokens=1, num_seqs=1, num_emitted=1) == {}  # fmt: skip


def test_acceptance_follows_the_request_and_drifts_back_to_the_prior() -> None:
    a = Acceptance()
    prior = a.alpha
    for _ in range(20):
        a.observe(4, 0)
    low = a.alpha
    assert low < 0.1
    for _ in range(200):
        a.observe(0, 0)
    assert low < a.alpha <= prior
    b = Acceptance()
    for _ in range(20):
        b.observe(4, 4)
    assert b.alpha > 0.9


# ------------------------------------------------------------ verification


@pytest.mark.parametrize(
    ("drafts", "sampled", "emitted"),
    [
        ([], [7], [7]),
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all kept, plus the bonus
        ([1, 2, 3], [1, 5, 3, 4], [1, 5]),  # the first mismatch is the target's token and ends the run
        ([1, 2, 3], [9, 2, 3, 4], [9]),
    ],
)
def test_accepted_run(drafts: list[int], sampled: list[int], emitted: list[int]) -> None:
    assert accepted_run(drafts, sampled) == emitted
