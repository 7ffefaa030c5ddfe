"""The grammar's token mask in the sampler: every sampling mode draws only allowed tokens, and a
constrained row's logprobs are those of the masked distribution (NOTE(grammar-mask) in sampler)."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.protocol import SamplingParams
from sluice.engine.sampler import Sampler, SamplingRow

VOCAB = 40
ALLOWED = torch.zeros(VOCAB, dtype=torch.bool)
ALLOWED[[3, 7, 8, 20, 33]] = True


def _logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(VOCAB, generator=g) * 2
    x[0] = 10.0  # the favourite, forbidden by the mask
    return x


def _row(banned: list[int] | None = None, allowed: torch.Tensor | None = ALLOWED, gen: torch.Generator | None = None,
         **kw: object) -> SamplingRow:  # fmt: skip
    mask = None if allowed is None else (lambda: torch.where(allowed, 0.0, float("-inf")))
    return SamplingRow(SamplingParams(**kw), [0, 1, 5, 5], 2, gen, banned or [], mask)  # type: ignore[arg-type]


MODES = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 2.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 1.0, "seed": 7},
    {"temperature": 1.0, "repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"temperature": 0.0, "repetition_penalty": 2.0},
]


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_every_sampling_mode_draws_only_allowed_tokens(kw: dict) -> None:
    sampler = Sampler(seed=1)
    seen = set()
    for i in range(60):
        gen = torch.Generator().manual_seed(kw["seed"] + i) if "seed" in kw else None
        (tok,), _ = sampler(_logits(i).unsqueeze(0), [_row(gen=gen, **kw)])
        seen.add(tok)
    assert seen <= set(ALLOWED.nonzero().flatten().tolist()), f"a masked token was drawn: {seen}"
    if kw["temperature"] > 0 and "top_k" not in kw and "min_p" not in kw and "top_p" not in kw:
        assert len(seen) > 1, "sampling under a mask must still draw from the allowed tokens' distribution"


def test_greedy_takes_the_best_allowed_token_not_the_best_token() -> None:
    x = _logits()
    (tok,), _ = Sampler()(x.clone().unsqueeze(0), [_row(temperature=0.0)])
    assert tok == int(torch.where(ALLOWED, x, float("-inf")).argmax()) and tok != 0


def test_logprobs_are_those_of_the_masked_penalised_distribution() -> None:
    x = _logits(3)
    kw = {"temperature": 0.7, "logprobs": 4, "repetition_penalty": 1.3}
    (tok,), (lp,) = Sampler(seed=2)(x.clone().unsqueeze(0), [_row(**kw)])
    penalised, _ = x.clone().unsqueeze(0), None
    Sampler._penalties(penalised, [_row(**kw)])
    want = torch.log_softmax(torch.where(ALLOWED, penalised[0], float("-inf")), dim=-1)
    assert lp is not None and lp.token_id == tok
    assert lp.logprob == pytest.approx(float(want[tok]), abs=1e-5)
    top = dict(lp.top)
    assert set(top) <= set(ALLOWED.nonzero().flatten().tolist()), "a forbidden alternative was listed"
    assert len(top) == 4 and all(v == pytest.approx(float(want[t]), abs=1e-5) for t, v in top.items())
    assert torch.logsumexp(want, 0) == pytest.approx(0.0, abs=1e-5)


def test_top_logprobs_list_only_allowed_tokens_when_fewer_than_asked() -> None:
    (tok,), (lp,) = Sampler()(_logits().unsqueeze(0), [_row(temperature=0.0, logprobs=10)])
    assert lp is not None and len(lp.top) == int(ALLOWED.sum()) and lp.top[0][0] == tok


def test_seeded_constrained_row_draws_the_same_alone_and_in_a_batch() -> None:
    x = torch.stack([_logits(i) for i in range(4)])
    alone, _ = Sampler(seed=5)(x[1:2].clone(), [_row(gen=torch.Generator().manual_seed(9), temperature=1.0)])
    rows = [_row(allowed=None, temperature=1.0), _row(gen=torch.Generator().manual_seed(9), temperature=1.0),
            _row(temperature=0.0), _row(allowed=None, temperature=0.0)]  # fmt: skip
    batch, _ = Sampler(seed=6)(x.clone(), rows)
    assert batch[1] == alone[0], "a seeded constrained row must not depend on its batch"


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos() -> None:
    eos_only = torch.zeros(VOCAB, dtype=torch.bool)
    eos_only[2] = True
    (tok,), _ = Sampler()(_logits().unsqueeze(0), [_row(banned=[2], allowed=eos_only, temperature=0.0)])
    assert tok == 2, "with nothing else allowed, the grammar's end wins over min_tokens"
    (tok,), _ = Sampler()(_logits().unsqueeze(0), [_row(banned=[3], temperature=0.0)])
    assert tok != 3 and bool(ALLOWED[tok]), "min_tokens still bans EOS where the grammar allows more"
