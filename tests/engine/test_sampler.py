"""Sampler: each knob changes the distribution the way it should; seeds are batch-independent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.sampler import Sampler, SamplingRow


def _row(**kw: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [0, 1], 2, None, [])  # type: ignore[arg-type]


def _draws(logits: torch.Tensor, n: int = 400, **kw: object) -> list[int]:
    s = Sampler(seed=3)
    return [s(logits.clone().unsqueeze(0), [_row(**kw)])[0][0] for _ in range(n)]


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def test_greedy_takes_argmax() -> None:
    assert set(_draws(LOGITS, 20, temperature=0.0)) == {0}


def test_greedy_rows_take_the_first_maximal_index_alone_or_among_sampled_rows() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 4, (6, 50), generator=g).float()  # many ties per row
    first_max = [int(torch.nonzero(r == r.max())[0]) for r in logits]
    all_greedy, _ = Sampler(seed=1)(logits.clone(), [_row(temperature=0.0) for _ in range(6)])
    assert all_greedy == first_max
    mixed_rows = [_row(temperature=0.0) if i % 2 == 0 else _row(temperature=1.0) for i in range(6)]
    mixed, _ = Sampler(seed=1)(logits.clone(), mixed_rows)
    assert [mixed[i] for i in (0, 2, 4)] == [first_max[i] for i in (0, 2, 4)]


def test_top_k_limits_support() -> None:
    assert set(_draws(LOGITS, top_k=2)) == {0, 1}, "top_k=2 must only ever draw the two best tokens"


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    p = torch.softmax(LOGITS, 0)
    assert p[0] < 0.5 < p[0] + p[1]  # so top_p=0.5 keeps exactly tokens 0 and 1
    assert set(_draws(LOGITS, top_p=0.5)) == {0, 1}


def test_min_p_drops_unlikely_tokens() -> None:
    # min_p=0.5 keeps tokens with p >= 0.5 * p_max: exp(-0.5)=0.61 and exp(-1.0)=0.37 -> tokens 0, 1
    assert set(_draws(LOGITS, min_p=0.5)) == {0, 1}


def test_temperature_sharpens_and_flattens() -> None:
    cold = _draws(LOGITS, temperature=0.2).count(0)
    hot = _draws(LOGITS, temperature=5.0).count(0)
    assert cold > 300 > hot, f"token 0 drawn {cold} times at T=0.2 and {hot} at T=5"


def test_sampling_follows_the_distribution() -> None:
    draws = _draws(LOGITS, n=3000)
    p = torch.softmax(LOGITS, 0)
    for t in range(3):
        freq = draws.count(t) / len(draws)
        assert abs(freq - float(p[t])) < 0.04, f"token {t}: frequency {freq:.3f} vs probability {float(p[t]):.3f}"


def test_penalties_push_down_seen_tokens() -> None:
    logits = torch.zeros(1, 6)
    row = SamplingRow(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, temperature=0.0), [9, 3, 3], 1, None, [])
    out = Sampler._penalties(logits.clone(), [row])
    assert out[0, 3] == -(2 * 1.0 + 0.5), "token 3 seen twice in the output: 2*freq + presence"
    rep = SamplingRow(SamplingParams(repetition_penalty=2.0), [1, 2], 2, None, [])
    lg = torch.tensor([[1.0, 4.0, -4.0, 1.0]])
    out = Sampler._penalties(lg, [rep])
    assert out[0].tolist() == [1.0, 2.0, -8.0, 1.0], "positive logits divided, negative multiplied"


def test_banned_tokens_are_never_chosen_and_carry_no_logprob_mass() -> None:
    s = Sampler()
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [0], 1, None, [0])
    toks, lps = s(LOGITS.clone().unsqueeze(0), [row])
    assert toks == [1], "a banned token (min_tokens not reached) is never chosen"
    lp = lps[0]
    assert lp is not None and lp.token_id == 1 and len(lp.top) == 2
    ref = torch.log_softmax(LOGITS[1:], 0)  # the banned token carries no mass
    assert [t for t, _ in lp.top] == [1, 2]
    assert abs(lp.top[0][1] - float(ref[0])) < 1e-5 and abs(lp.logprob - float(ref[0])) < 1e-5


def _run(engine: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (p, sp) in reqs.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p, sampling=sp))
    out: dict[str, list[int]] = {r: [] for r in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def test_same_seed_same_output_whatever_the_batch(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=4 << 20)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=20, ignore_eos=True)
    prompt = list(range(500, 530))
    alone = _run(engine, {"a": (prompt, sp)})["a"]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = _run(engine, {"x": (list(range(700, 760)), noise), "a": (prompt, sp), "y": (list(range(40, 45)), noise)})
    assert batched["a"] == alone, "a seeded request must not depend on its batch neighbours"
    other = _run(engine, {"b": (prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=43, max_tokens=20, ignore_eos=True))})
    assert other["b"] != alone, "a different seed should give a different sample"


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=4 << 20)
    prompt = list(range(900, 920))
    free = _run(engine, {"f": (prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))})["f"]
    assert len(free) == 12, "max_tokens bounds the output"
    stop_at = free[5]
    first = free.index(stop_at)
    engine.add_request(EngineRequest(request_id="s", prompt_token_ids=prompt,
                                     sampling=SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)))
    toks, reason = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.new_token_ids
            reason = o.finish_reason or reason
    assert toks == free[: first + 1] and reason == "stop", "generation stops at (and includes) the stop token id"
    mt = _run(engine, {"m": (prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first + 3,
                                                    stop_token_ids=[stop_at], ignore_eos=True))})["m"]
    assert len(mt) >= first + 3 and stop_at not in mt[: first + 2], "stop ids are masked until min_tokens"


def test_the_argmax_kernel_gives_torchs_argmax_on_ties_nans_and_infinities() -> None:
    """NOTE(argmax-rows): the C++ greedy argmax is torch's argmax, tails, ties and NaN rows included."""
    s = Sampler()
    if s._argmax is None:
        pytest.skip("no C++ toolchain: the sampler uses torch's max(dim)")
    g = torch.Generator().manual_seed(1)
    for vocab in (1, 7, 16, 17, 40, 49157):
        x = torch.randn(6, vocab, generator=g)
        if vocab > 20:
            x[0, [3, vocab - 1]] = 9.0  # a tie across the vector body and the tail
            x[1, [vocab - 7, vocab - 2]] = 9.0  # a tie inside the tail
            x[2, [5, 21]] = 9.0  # a tie in two lanes of the vector body
            x[3, [vocab // 2, vocab - 1]] = float("nan")  # NaN counts as the maximum: its first index
        x[4] = float("-inf")
        x[5, 0] = float("inf")
        want = x.argmax(dim=-1).tolist()
        assert s.argmax(x) == want, vocab
        assert s.argmax(x[1:4]) == want[1:4], vocab  # a row slice (the sampler's gathered greedy rows)
