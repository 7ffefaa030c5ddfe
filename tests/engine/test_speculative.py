"""Speculative decoding in the engine: output bit-identical to decoding without it, no block leaks.

A tiny random Llama (float32 on the CPU) is the target; prompts repeat a
pattern so that n-gram drafts are proposed, and some kept, some rejected.  The
draft model is the target's own int4 copy (``self:q4``).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams, StructuredOutputs
from sluice.engine.spec.proposer import Proposer
from sluice.engine.spec_config import SpecMethod
from sluice.errors import ConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "k_policy": "fixed"}
SELF_Q4 = {"model": "self:q4", "num_speculative_tokens": 3, "k_policy": "fixed"}


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    """Prompts that repeat a short pattern (something for prompt lookup to find), each its own."""
    out = []
    for i in range(n):
        pattern = [100 + 7 * i + j for j in range(3 + i % 3)]
        out.append((pattern * (length // len(pattern) + 1))[:length] + [50 + i])
    return out


def _engine(model: Path, spec: dict[str, Any] | None, **kw: Any) -> EngineCore:
    args: dict[str, Any] = dict(model=str(model), dtype="float32", attention_backend="cpu_paged", quantization="int8",
                                max_num_batched_tokens=128, max_num_seqs=16, kv_cache_memory=4 << 20)  # fmt: skip
    args.update(kw)
    # int8 weights: batch-invariant kernels (NOTE(spec-invariance) in engine.spec.verify)
    return EngineCore(**args, speculative_config=spec)


class ScriptedProposer(Proposer):
    """Drafts a known continuation with every third token wrong: kept runs, partial runs and rejections
    on a random model, whose output n-gram lookup cannot predict."""

    method = SpecMethod.NGRAM

    def __init__(self, reference: dict[str, list[int]]):
        self.reference = reference

    def propose(self, batch: Any, generators: Any) -> dict[str, list[int]]:
        out = {}
        for req, k in batch:
            at = req.num_output_tokens
            ref = self.reference[req.request_id][at : at + k]
            out[req.request_id] = [t if (at + j) % 3 != 2 else (t + 1) % 1000 for j, t in enumerate(ref)]
        return out


def _scripted(model: Path, reference: dict[str, Any], **kw: Any) -> EngineCore:
    engine = _engine(model, NGRAM, **kw)
    assert engine.speculator is not None
    engine.speculator.proposer = ScriptedProposer({rid: toks for rid, (toks, _, _) in reference.items()})
    return engine


def _run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
         abort_after: dict[str, int] | None = None, wait: bool = False) -> dict[str, tuple[list[int], str | None, list[Any]]]:  # fmt: skip
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=sp))
    got: dict[str, list[int]] = collections.defaultdict(list)
    lps: dict[str, list[Any]] = collections.defaultdict(list)
    reasons: dict[str, str | None] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            lps[out.request_id].extend(out.logprobs or [])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort([rid])
        engine.block_manager.check_invariants()
        assert steps < 2000 or wait and steps < 200000, "the engine does not finish"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"blocks leaked: {bm.num_blocks - bm.num_free_blocks} held after the end"
    return {rid: (got[rid], reasons.get(rid), lps[rid]) for rid in reasons}


def _greedy(n: int, max_tokens: int = 24, **kw: Any) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw) for _ in range(n)]


def _spec_stats(engine: EngineCore) -> tuple[int, int]:
    s = engine.make_stats()
    return s.spec_drafted_tokens, s.spec_accepted_tokens


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_output_is_bit_identical(tiny_llama: Path, batch: int) -> None:
    prompts = _prompts(batch)
    base = _run(_engine(tiny_llama, None), prompts, _greedy(batch))
    engine = _scripted(tiny_llama, base)
    spec = _run(engine, prompts, _greedy(batch))
    assert spec == base, "greedy speculative output must equal the output without speculation, token for token"
    drafted, accepted = _spec_stats(engine)
    assert 0 < accepted < drafted, f"the test should keep some drafts and reject others ({accepted}/{drafted} kept)"
    engine = _engine(tiny_llama, NGRAM)
    assert _run(engine, prompts, _greedy(batch)) == base, "n-gram drafts must not change greedy output"
    assert _spec_stats(engine)[0] > 0, "prompt lookup should find something to draft in these prompts"


@pytest.mark.parametrize("batch", [1, 3])
def test_a_float32_target_speculates_on_the_invariant_float_kernel(
    tiny_llama: Path, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE(spec-invariance), NOTE(float-kernel): a float32 target's linears run the fixed-order float
    kernel, not BLAS (whose rounding depends on the rows of the step): every verification row has the bits
    it has decoded alone, so greedy output is that of the same engine without drafts, with scripted
    rejections."""
    prompts = _prompts(batch)
    plain = _engine(tiny_llama, None, quantization="none")
    assert plain.runner.invariant_floats
    base = _run(plain, prompts, _greedy(batch, max_tokens=40))
    engine = _scripted(tiny_llama, base, quantization="none")
    kinds = {kind for lin in engine.runner.model.linears().values() for kind, _, _ in lin.parts}
    assert kinds == {"fp32"}, kinds
    assert _run(engine, prompts, _greedy(batch, max_tokens=40)) == base
    drafted, accepted = _spec_stats(engine)
    assert 0 < accepted < drafted, f"kept and rejected drafts ({accepted}/{drafted})"
    x = torch.randn(5, engine.runner.model_config.hidden_size)
    with torch.inference_mode():
        for lin in (engine.runner.model.layers[0].qkv, engine.runner.model.embed):
            assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(5)]), lin(x)), "a row's bits as alone"
    monkeypatch.setenv("SLUICE_FLOAT_KERNEL", "blas")
    blas = _engine(tiny_llama, NGRAM, quantization="none")
    assert not blas.runner.invariant_floats
    assert {kind for lin in blas.runner.model.linears().values() for kind, _, _ in lin.parts} == {"dense"}


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_self_q4_output_is_bit_identical(tiny_llama: Path, batch: int) -> None:
    prompts = _prompts(batch)
    base = _run(_engine(tiny_llama, None), prompts, _greedy(batch))
    engine = _engine(tiny_llama, SELF_Q4)
    spec = _run(engine, prompts, _greedy(batch))
    assert spec == base, "self:q4 drafts must not change greedy output"
    drafted, accepted = _spec_stats(engine)
    assert drafted > 0 and accepted > 0, f"the int4 copy of the target should agree with it often ({accepted}/{drafted})"


@pytest.mark.parametrize("proposer", ["scripted", "self_q4"])
def test_preemption_mid_run_keeps_output_and_blocks(tiny_llama: Path, proposer: str) -> None:
    prompts = _prompts(6, length=40)
    params = _greedy(6, max_tokens=40)
    small = dict(kv_cache_memory=20 * 8192)  # 20 blocks (K+V, 2 layers, 16 tokens, 2 KV heads of 16 dims, fp32)
    base = _run(_engine(tiny_llama, None, **small), prompts, params)
    engine = _scripted(tiny_llama, base, **small) if proposer == "scripted" else _engine(tiny_llama, SELF_Q4, **small)
    out = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the KV cache should be too small to hold every request"
    assert out == base
    assert _spec_stats(engine)[1] > 0


def test_seeded_sampling_is_bit_identical(tiny_llama: Path) -> None:
    prompts = _prompts(4)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=24, ignore_eos=True, logprobs=2) for i in range(4)]
    base = _run(_engine(tiny_llama, None), prompts, params)
    for engine in (_scripted(tiny_llama, base), _engine(tiny_llama, SELF_Q4)):
        assert _run(engine, prompts, params) == base, "a seeded request's tokens and logprobs must not change"
        drafted, accepted = _spec_stats(engine)
        assert 0 < accepted < drafted


def test_unseeded_sampling_keeps_the_target_distribution(tiny_llama: Path) -> None:
    """Chi-square: the tokens at output positions 2-4 of many unseeded requests, with and without speculation."""
    n = 240
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    params = SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True)
    counts = []
    for spec in (None, NGRAM):
        engine = _engine(tiny_llama, spec, max_num_seqs=64)
        out = _run(engine, prompt * n, [params] * n)
        counts.append(collections.Counter(tuple(toks[1:]) for toks, _, _ in out.values()))
        if spec is not None:
            assert _spec_stats(engine)[0] > 0
    # bucket by the first of the later tokens: rare values pooled
    a = collections.Counter(k[0] for k in counts[0].elements())
    b = collections.Counter(k[0] for k in counts[1].elements())
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rest = (n - sum(a[t] for t in common), n - sum(b[t] for t in common))
    chi2 = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in common)
    chi2 += (rest[0] - rest[1]) ** 2 / max(1, sum(rest))
    dof = len(common)
    assert chi2 < dof + 4 * (2 * dof) ** 0.5 + 10, f"chi2 {chi2:.1f} with {dof} dof: the distributions differ"


def test_stops_inside_an_accepted_run_end_at_the_right_token(tiny_llama: Path) -> None:
    prompts = _prompts(3)
    ref = _run(_engine(tiny_llama, None), prompts, _greedy(3, max_tokens=30))
    cases = []
    for i in range(3):
        toks = ref[str(i)][0]
        cases.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[toks[9]]))
    cases.append(SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    eos_at = ref["0"][0][5]
    prompts4 = [*prompts, prompts[0]]
    base = _run(_engine(tiny_llama, None), prompts4, cases)
    engine = _scripted(tiny_llama, {str(i): ref[str(i % 3)] for i in range(4)})
    out = _run(engine, prompts4, cases)
    assert out == base
    assert out["3"][0] == ref["0"][0][:7] and out["3"][1] == "length", "max_tokens: never more tokens than asked"
    for i in range(3):
        toks = ref[str(i)][0]
        assert out[str(i)][0] == toks[: toks.index(toks[9]) + 1] and out[str(i)][1] == "stop"
    # EOS: the model's own end token, at a position inside a drafted run
    eng_base = _engine(tiny_llama, None)
    eng_base.eos_token_ids = (eos_at,)
    eng_base.scheduler.eos_token_ids = (eos_at,)
    eos_params = [SamplingParams(temperature=0.0, max_tokens=30)]
    base_eos = _run(eng_base, prompts[:1], eos_params)
    engine = _scripted(tiny_llama, ref)
    engine.eos_token_ids = (eos_at,)
    engine.scheduler.eos_token_ids = (eos_at,)
    got = _run(engine, prompts[:1], eos_params)
    assert got == base_eos and got["0"][1] == "stop" and got["0"][0][-1] == eos_at


def test_constrained_requests_draft_within_their_grammar(tiny_llama: Path) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "tags": {"type": "array", "items": {"enum": ["aa", "bb", "cc"]}, "maxItems": 4}},
              "required": ["name", "tags"]}  # fmt: skip
    so = [StructuredOutputs(json=json.dumps(schema)), StructuredOutputs(regex=r"([a-c]{2}-[0-9]{2} ){2,6}"),
          StructuredOutputs(choice=["alpha beta gamma", "delta"])]  # fmt: skip
    prompts = _prompts(3)
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured=s) for s in so]
    base = _run(_engine(tiny_llama, None), prompts, params, wait=True)
    engine = _scripted(tiny_llama, base)
    assert _run(engine, prompts, params, wait=True) == base, "drafts must not change a constrained answer"
    drafted, accepted = _spec_stats(engine)
    assert 0 < accepted < drafted


def test_lora_n_and_streaming_through_llm(tiny_llama: Path, tmp_path: Path) -> None:
    """The offline API: an adapter's requests, n > 1 seeded samples, and streaming, each as without drafts."""
    import sys

    from sluice import LLM
    from sluice.models.config import ModelConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lora_factory import make_lora_dir

    cfg = ModelConfig.from_hf(json.loads((tiny_llama / "config.json").read_text()))
    lora = make_lora_dir(tmp_path / "qv", cfg, targets=("q_proj", "v_proj"), rank=4, seed=1)
    args = dict(quantization="int8", kv_cache_memory=4 << 20, lora_modules=[f"qv={lora}"])
    prompts = [_prompts(2)[0], _prompts(2)[1]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=16, ignore_eos=True)
    results = []
    for spec in (None, SELF_Q4):
        llm = LLM(str(tiny_llama), speculative_config=spec, **args)
        a = [o.token_ids for o in llm.generate(prompts, greedy, lora=["qv", None])]
        b = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:1], seeded)]
        c = "".join(llm.stream("a b c a b c a b", greedy))
        results.append((a, b, c))
        if spec is not None:
            assert llm.engine.make_stats().spec_drafted_tokens > 0
    assert results[0] == results[1]


def test_kv_disk_tier_prefix_hits_keep_the_output(tiny_llama: Path, tmp_path: Path) -> None:
    """A prefix loaded from the disk tier (target K/V only: the draft model catches up) gives the same
    tokens; only blocks of accepted tokens were written."""
    prompts = [p + [60 + i] for i, p in enumerate([_prompts(1, length=40)[0]] * 3)]
    params = _greedy(3, max_tokens=30)
    base = _run(_engine(tiny_llama, None), prompts, params)
    first = _engine(tiny_llama, SELF_Q4, kv_disk_dir=str(tmp_path))
    assert _run(first, prompts[:1], params[:1]) == {"0": base["0"]}
    first.close()
    again = _engine(tiny_llama, SELF_Q4, kv_disk_dir=str(tmp_path))
    out = _run(again, prompts, params)
    (tier,) = again.make_stats().kv_tiers
    again.close()
    assert out == base and tier.hit_blocks > 0, "the second engine should load the shared prefix from disk"


def test_aborts_free_every_block(tiny_llama: Path) -> None:
    prompts = _prompts(5)
    engine = _engine(tiny_llama, SELF_Q4)
    out = _run(engine, prompts, _greedy(5, max_tokens=40), abort_after={"1": 3, "3": 6})
    assert out["1"][1] == "abort" and out["3"][1] == "abort"
    assert engine.speculator is not None and not engine.speculator.has_state(), "state kept for finished requests"


def test_adaptive_k_drafts_at_one_decode_and_stops_under_load(tiny_llama: Path) -> None:
    """With a memory-bound step (a CPU's SmolLM2: ~4 ms + 0.75 ms a row, frozen here) one decode drafts and
    48 running decodes draft nothing but the one exploring row."""
    adaptive = {**NGRAM, "k_policy": "adaptive"}
    counts = []
    for n in (1, 48):
        engine = _engine(tiny_llama, adaptive, max_num_seqs=64)
        m = engine.step_model
        m.base, m.per_token, m.per_seq = 4e-3, 0.5e-3, 0.25e-3
        m.observe = lambda *a, **k: None  # type: ignore[method-assign]
        prompt = [5, 6, 7, 8] * 6
        _run(engine, [prompt] * n, _greedy(n, max_tokens=12))
        counts.append(engine.make_stats().spec_k_counts)
    one, many = counts
    assert sum(k * c for k, c in enumerate(one)) >= sum(one), f"one decode should draft (k counts {one})"
    assert sum(k * c for k, c in enumerate(many)) < 0.05 * sum(many), f"48 decodes should not draft (k counts {many})"


def test_bad_config_is_one_clear_error(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="speculative_config: unknown method"):
        EngineCore(model=str(tiny_llama), kv_cache_memory=1 << 20, speculative_config={"method": "eagle"})


def test_speculation_is_off_by_default(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=1 << 20)
    assert engine.speculator is None and engine.make_stats().spec_method == ""
