"""LoRA adapters in the engine: merged-reference correctness, batch invariance with mixed adapters,
the LRU, max_loras, per-adapter prefix caching, refused adapters, loads off the step loop."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_factory import (  # noqa: E402
    ALL_TARGETS,
    dequantize_model,
    make_lora_dir,
    merge_into_hf_dir,
    merge_into_model,
)

from sluice.engine.config import EngineConfig  # noqa: E402
from sluice.engine.core import EngineCore  # noqa: E402
from sluice.engine.protocol import EngineRequest, SamplingParams  # noqa: E402
from sluice.errors import InvalidRequestError, ModelNotFoundError  # noqa: E402
from sluice.models.config import ModelConfig  # noqa: E402

KV = 8 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def model_cfg(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


Spec = tuple[str, list[int], "str | None", int]  # request id, prompt, adapter, step it arrives at


def run(engine: EngineCore, specs: list[Spec], sp: SamplingParams = GREEDY) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """Feed requests (arriving at their step); each request's sampled tokens and logits rows."""
    runner = engine.runner
    runner.capture_logits = True
    original = runner.execute
    logits: dict[str, list[torch.Tensor]] = {s[0]: [] for s in specs}
    tokens: dict[str, list[int]] = {s[0]: [] for s in specs}

    def execute(sched: Any, rows: Any, *hooks: Any) -> Any:
        out = original(sched, rows, *hooks)
        sampled = [s.request.request_id for s in sched.scheduled if s.samples]
        for i, rid in enumerate(sampled):
            if rid in logits:
                logits[rid].append(runner.last_logits[i].clone())
        return out

    runner.execute = execute  # type: ignore[method-assign]
    try:
        pending = sorted(specs, key=lambda s: s[3])
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][3] <= step:
                rid, p, lora, _ = pending.pop(0)
                engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p, sampling=sp, lora_name=lora))
            for out in engine.step():
                assert out.error is None, f"{out.request_id} failed: {out.error}"
                if out.request_id in tokens:
                    tokens[out.request_id].extend(out.new_token_ids)
            step += 1
            assert step < 10_000, "the engine never finished"
    finally:
        runner.execute = original  # type: ignore[method-assign]
    return {rid: (tokens[rid], logits[rid]) for rid in tokens}


def engine(model: Path, **kw: Any) -> EngineCore:
    kw.setdefault("kv_cache_memory", KV)
    return EngineCore(EngineConfig(model=str(model), **kw))


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per tiny model: adapters with different targets, ranks and scalings."""
    out: dict[str, dict[str, Path]] = {}
    for arch, model in tiny_models.items():
        cfg = model_cfg(model)
        root = tmp_path_factory.mktemp(f"lora-{arch}")
        out[arch] = {
            "qv": make_lora_dir(root / "qv", cfg, targets=("q_proj", "v_proj"), rank=8, seed=1),
            "all": make_lora_dir(root / "all", cfg, targets=ALL_TARGETS, rank=4, seed=2),
            "mlp_rslora": make_lora_dir(root / "mlp", cfg, targets=("gate_proj", "down_proj"), rank=16, seed=3,
                                        alpha=8, use_rslora=True),  # fmt: skip
            "attn": make_lora_dir(root / "attn", cfg, targets=("k_proj", "o_proj"), rank=2, seed=4),
        }
    return out


# ---------------------------------------------------------------- merged reference (float)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("which", ["qv", "all", "mlp_rslora", "attn"])
def test_adapter_matches_its_merged_reference(
    tiny_models: dict[str, Path], adapters: dict[str, dict[str, Path]], tmp_path: Path, arch: str, which: str
) -> None:
    model, adapter = tiny_models[arch], adapters[arch][which]
    merged = merge_into_hf_dir(model, [adapter], tmp_path / "merged")
    p = prompt(7, 37)
    served = run(engine(model, quantization="none", lora_modules=[f"a={adapter}"]), [("r", p, "a", 0)])["r"]
    ref = run(engine(merged, quantization="none"), [("r", p, None, 0)])["r"]
    base = run(engine(model, quantization="none"), [("r", p, None, 0)])["r"]
    assert served[0] == ref[0], "greedy tokens of the adapter differ from the merged model's"
    assert max_diff(served[1], ref[1]) < 1e-3, "adapter logits are not those of the merged weights"
    assert max_diff(served[1], base[1]) > 1e-2, "the test adapter must change the model (else it proves nothing)"


# ---------------------------------------------------------------- quantized base


def test_quantized_base_adapter_against_merged_dequantized_reference(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]]
) -> None:
    """NOTE(q4-reference): for a quantized base the merged reference is the dequantized base
    weights plus s*B@A, in fp32 (re-quantizing merged weights would be another model).  The
    served path differs from it by the int8 activations of the base GEMMs only, which the base
    model alone shows as well: the adapter's gap stays within (2x) the base model's own gap,
    and on the same float base the adapter path matches the merge to 1e-3."""
    adapter = adapters["llama"]["all"]
    q = {"quantization": "int4", "quant_fallback": "none", "enable_prefix_caching": False}
    p = prompt(11, 29)
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    served = engine(tiny_llama, lora_modules=[f"a={adapter}"], **q)
    served_base = run(served, [("b", p, None, 0)], sp)["b"][1]
    served_lora = run(served, [("a", p, "a", 0)], sp)["a"][1]

    ref = engine(tiny_llama, **q)
    dequantize_model(ref.runner.model)
    ref_base = run(ref, [("b", p, None, 0)], sp)["b"][1]
    # the adapter path on the float twin of the quantized base: exact
    ref.lora.register_now("a", str(adapter))
    twin_lora = run(ref, [("a", p, "a", 0)], sp)["a"][1]
    merge_into_model(ref.runner.model, adapter)
    ref_lora = run(ref, [("m", p, None, 0)], sp)["m"][1]

    assert max_diff(twin_lora, ref_lora) < 1e-3, "adapter on the dequantized base differs from the merge"
    base_gap = max_diff(served_base, ref_base)
    lora_gap = max_diff(served_lora, ref_lora)
    assert lora_gap <= 2 * base_gap + 1e-3, f"int4 + adapter is {lora_gap:.3g} from the merged reference, base alone {base_gap:.3g}"
    assert max_diff(served_lora, served_base) > 10 * base_gap, "the adapter must move the logits well beyond the noise"


# ---------------------------------------------------------------- batch invariance


def test_mixed_batch_gives_each_request_what_it_gets_alone(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]]
) -> None:
    """Base + three adapters in one batch (chunked differently, arriving at different steps):
    each request's logits are the same bits as when it runs alone (int4 base: batch invariant)."""
    ads = adapters["llama"]
    mods = [f"qv={ads['qv']}", f"all={ads['all']}", f"mlp={ads['mlp_rslora']}"]
    q = {"quantization": "int4", "quant_fallback": "none", "lora_modules": mods}
    specs: list[Spec] = [("base", prompt(1, 45), None, 0), ("qv", prompt(2, 21), "qv", 0),
                         ("all", prompt(3, 33), "all", 1), ("mlp", prompt(4, 18), "mlp", 2),
                         ("qv2", prompt(5, 40), "qv", 1)]  # fmt: skip
    alone = {}
    solo = engine(tiny_llama, max_num_batched_tokens=64, **q)
    for s in specs:
        alone.update(run(solo, [(s[0], s[1], s[2], 0)]))
    together = run(engine(tiny_llama, max_num_batched_tokens=23, **q), specs)
    for rid, (toks, rows) in alone.items():
        assert together[rid][0] == toks, f"{rid}: tokens differ between alone and mixed batch"
        for i, (a, b) in enumerate(zip(rows, together[rid][1], strict=True)):
            assert torch.equal(a, b), f"{rid} token {i}: logits differ by {(a - b).abs().max():.3g} alone vs batched"


# ---------------------------------------------------------------- scheduling and memory


def test_lru_with_two_slots_serves_three_adapters_in_turn(tiny_llama: Path, adapters: dict[str, dict[str, Path]]) -> None:
    ads = adapters["llama"]
    names = ["qv", "all", "attn"]
    mods = [f"{n}={ads[n]}" for n in names]
    p = prompt(9, 20)
    reference = {n: run(engine(tiny_llama, quantization="none", lora_modules=[f"{n}={ads[n]}"]), [(n, p, n, 0)])[n][0]
                 for n in names}  # fmt: skip
    eng = engine(tiny_llama, quantization="none", lora_modules=mods, max_loras=1, max_cpu_loras=2)
    assert len(eng.lora.resident) == 2, "start-up keeps at most --max-cpu-loras adapters in memory"
    for turn in range(2):
        for n in names:
            got = run(eng, [(f"{n}{turn}", p, n, 0)])[f"{n}{turn}"][0]
            assert got == reference[n], f"adapter {n} (turn {turn}) answers differently after evictions"
            stats = eng.make_stats().lora
            assert stats is not None and len(stats.loaded) <= 2 and n in stats.loaded
    stats = eng.make_stats().lora
    assert stats is not None and stats.num_evictions >= 4 and stats.num_loads >= 3 + 4, stats


def test_max_loras_bounds_the_adapters_of_each_step(tiny_llama: Path, adapters: dict[str, dict[str, Path]]) -> None:
    ads = adapters["llama"]
    names = ["qv", "all", "mlp_rslora", "attn"]
    eng = engine(tiny_llama, quantization="none", lora_modules=[f"{n}={ads[n]}" for n in names], max_loras=2)
    seen: list[set[int]] = []
    original = eng.runner.execute

    def execute(sched: Any, rows: Any, *hooks: Any) -> Any:
        seen.append({s.request.lora_id for s in sched.scheduled if s.request.lora_id})
        ids = [s.request.lora_id for s in sched.scheduled]
        assert ids == sorted(ids), "a step's requests are grouped by adapter (NOTE(lora-rows))"
        return original(sched, rows, *hooks)

    eng.runner.execute = execute  # type: ignore[method-assign]
    specs: list[Spec] = [(f"{n}-{i}", prompt(20 + 4 * i + j, 12), n, 0) for j, n in enumerate(names) for i in range(2)]
    specs.append(("base", prompt(99, 12), None, 0))
    out = run(eng, specs)
    assert all(len(t) == GREEDY.max_tokens for t, _ in out.values()), "every request finishes"
    assert max(len(s) for s in seen) == 2, f"steps held {max(len(s) for s in seen)} adapters, --max-loras is 2"


def test_prefix_cache_never_serves_one_adapters_blocks_to_another(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]]
) -> None:
    ads = adapters["llama"]
    p = prompt(13, 50)
    eng = engine(tiny_llama, quantization="none", lora_modules=[f"qv={ads['qv']}", f"all={ads['all']}"])
    fresh = {n: run(engine(tiny_llama, quantization="none", lora_modules=[f"{n}={ads[n]}"]), [("x", p, n, 0)])["x"][0]
             for n in ("qv", "all")}  # fmt: skip
    cached: dict[str, int] = {}
    original = eng.scheduler.update_from_output

    def update(sched: Any, *a: Any) -> Any:
        for s in sched.scheduled:
            cached.setdefault(s.request.request_id, s.request.num_cached_tokens)
        return original(sched, *a)

    eng.scheduler.update_from_output = update  # type: ignore[method-assign]
    run(eng, [("base", p, None, 0)])
    got = run(eng, [("qv1", p, "qv", 0)])
    assert cached["qv1"] == 0, "the base model's prefix blocks were offered to an adapter request"
    assert got["qv1"][0] == fresh["qv"]
    got = run(eng, [("all1", p, "all", 0)])
    assert cached["all1"] == 0 and got["all1"][0] == fresh["all"], "one adapter's blocks served another"
    run(eng, [("qv2", p, "qv", 0)])
    assert cached["qv2"] >= 48, "the same adapter reuses its own prefix blocks"


def test_cache_salt_is_stable_and_content_addressed(tiny_llama: Path, adapters: dict[str, dict[str, Path]]) -> None:
    """The salt (kept in the KV blocks' keys, also on disk) is the same in every process for the
    same adapter, and changes with its name or its weights."""
    from sluice.engine.lora_manager import cache_salt

    ads = adapters["llama"]
    a = engine(tiny_llama, quantization="none", lora_modules=[f"qv={ads['qv']}"]).lora.by_name["qv"]
    b = engine(tiny_llama, quantization="none", lora_modules=[f"qv={ads['qv']}", f"x={ads['all']}"]).lora
    assert a.salt == b.by_name["qv"].salt == cache_salt("qv", a.digest)
    assert b.by_name["x"].salt != a.salt


# ---------------------------------------------------------------- refusals


def _bad_adapters(root: Path, cfg: ModelConfig) -> dict[str, tuple[Path, str]]:
    other = ModelConfig(**{**cfg.__dict__, "hidden_size": cfg.hidden_size * 2, "head_dim": cfg.head_dim * 2})
    cases = {
        "missing": (root / "nope", "not a directory"),
        "other_base": (make_lora_dir(root / "other", other, rank=4), "does not fit this base model"),
        "rank": (make_lora_dir(root / "rank", cfg, rank=32), "above --max-lora-rank 16"),
        "dora": (make_lora_dir(root / "dora", cfg, config_overrides={"use_dora": True}), "DoRA"),
        "target": (make_lora_dir(root / "tgt", cfg, config_overrides={"target_modules": ["lm_head"]}), "lm_head"),
    }
    empty = root / "empty"
    empty.mkdir()
    cases["no_config"] = (empty, "adapter_config.json")
    torn = make_lora_dir(root / "torn", cfg)
    (torn / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    cases["torn"] = (torn, "not a valid safetensors file")
    return cases


def test_bad_adapters_are_refused_naming_the_problem_and_leave_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    eng = engine(tiny_llama, quantization="none", max_lora_rank=16)
    for case, (path, words) in _bad_adapters(tmp_path, model_cfg(tiny_llama)).items():
        ticket = eng.load_lora_adapter(case, str(path)) if path.is_dir() else None
        if ticket is None:
            with pytest.raises(InvalidRequestError, match=words):
                eng.load_lora_adapter(case, str(path))
            continue
        while eng.has_pending_lora_loads():
            eng.step()
        (rec,) = eng.take_lora_loads()
        assert rec.ticket == ticket and rec.error is not None and words in rec.error, f"{case}: {rec.error}"
    assert eng.lora.by_name == {} and not eng.lora.resident, "a refused adapter left something behind"
    with pytest.raises(ModelNotFoundError):
        eng.add_request(EngineRequest(request_id="x", prompt_token_ids=[1, 2, 3], sampling=GREEDY, lora_name="rank"))
    assert not eng.has_unfinished_requests()


def test_bad_startup_adapter_is_a_config_error_naming_the_flag(tiny_llama: Path, tmp_path: Path) -> None:
    from sluice.errors import ConfigError

    with pytest.raises(ConfigError, match="lora_modules: x=") as e:
        engine(tiny_llama, quantization="none", lora_modules=[f"x={tmp_path / 'missing'}"])
    assert e.value.setting == "lora_modules"


# ---------------------------------------------------------------- loads off the step loop, unload


def test_a_slow_load_does_not_stop_other_requests(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sluice.engine.lora_manager as lm

    release = threading.Event()
    real = lm.load_lora

    def slow(*a: Any, **kw: Any) -> Any:
        release.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(lm, "load_lora", slow)
    eng = engine(tiny_llama, quantization="none")
    eng.load_lora_adapter("qv", str(adapters["llama"]["qv"]))
    steps_during_load = 0
    base_tokens = 0
    eng.add_request(EngineRequest(request_id="b", prompt_token_ids=prompt(1, 10), sampling=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    while eng.has_unfinished_requests():
        base_tokens += sum(len(o.new_token_ids) for o in eng.step())
        steps_during_load += 1
    assert base_tokens == 5 and eng.has_pending_lora_loads(), "the base request ran to the end while the adapter loads"
    release.set()
    deadline = time.monotonic() + 10
    while eng.has_pending_lora_loads() and time.monotonic() < deadline:
        eng.step()
    assert "qv" in eng.lora.by_name and eng.take_lora_loads()[0].error is None


def test_request_for_an_evicted_adapter_waits_for_its_reload_while_others_run(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sluice.engine.lora_manager as lm

    ads = adapters["llama"]
    eng = engine(tiny_llama, quantization="none", lora_modules=[f"qv={ads['qv']}", f"all={ads['all']}"],
                 max_loras=1, max_cpu_loras=1)  # fmt: skip
    assert list(eng.lora.resident) == [eng.lora.by_name["all"].lora_id], "qv was evicted at start-up"
    release = threading.Event()
    real = lm.load_lora
    monkeypatch.setattr(lm, "load_lora", lambda *a, **kw: (release.wait(10), real(*a, **kw))[1])
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request(EngineRequest(request_id="q", prompt_token_ids=prompt(1, 10), sampling=sp, lora_name="qv", traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"))
    eng.add_request(EngineRequest(request_id="b", prompt_token_ids=prompt(2, 10), sampling=sp))
    done: dict[str, int] = {}
    for _ in range(20):
        for o in eng.step():
            done[o.request_id] = done.get(o.request_id, 0) + len(o.new_token_ids)
    assert done.get("b") == 4 and "q" not in done, "the base request finished while the adapter request waits"
    stats = eng.make_stats().lora
    assert stats is not None and stats.num_waiting_for_load == 1
    release.set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = done.get(o.request_id, 0) + len(o.new_token_ids)
    assert done["q"] == 4
    (rec,) = [r for r in eng.take_lora_loads() if r.adapter == "qv" and r.cause != "startup"]
    assert rec.cause == "request" and rec.request_id == "q" and rec.traceparent and rec.traceparent.startswith("00-111")
    assert rec.num_bytes > 0 and rec.end > rec.start


def test_unload_refuses_new_requests_and_lets_running_ones_finish(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]]
) -> None:
    eng = engine(tiny_llama, quantization="none", lora_modules=[f"qv={adapters['llama']['qv']}"])
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(1, 10), sampling=sp, lora_name="qv"))
    eng.step()
    eng.unload_lora_adapter("qv")
    with pytest.raises(ModelNotFoundError):
        eng.add_request(EngineRequest(request_id="n", prompt_token_ids=prompt(2, 10), sampling=sp, lora_name="qv"))
    with pytest.raises(ModelNotFoundError):
        eng.unload_lora_adapter("qv")
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in eng.step())
    assert n == 5, "the request already running finished normally"
    assert not eng.lora.resident and not eng.lora.by_id, "the unloaded adapter left memory with its last request"


# ---------------------------------------------------------------- configuration


def test_lora_modules_flag_forms() -> None:
    from sluice.engine.config import parse_lora_modules
    from sluice.server.config import load_settings, serve_options
    from sluice.settings import expand_multi_value_flags

    args = ["--lora-modules", "a=/x", "b=/y", "--port", "1", "--lora-modules=c=/z", "d=/w"]
    assert expand_multi_value_flags(args, serve_options()) == [
        "--lora-modules", "a=/x", "--lora-modules", "b=/y", "--port", "1", "--lora-modules=c=/z", "--lora-modules", "d=/w"]  # fmt: skip
    assert parse_lora_modules(['{"name": "a", "path": "/x", "base_model_name": "m"}', "b=/y"]) == ["a=/x", "b=/y"]
    assert parse_lora_modules({"a": "/x"}) == ["a=/x"]
    s = load_settings(environ={"SLUICE_LORA_MODULES": "a=/x,b=/y", "SLUICE_MAX_LORAS": "2"})
    assert s.engine.lora_module_paths == {"a": "/x", "b": "/y"} and s.engine.max_loras == 2
    from sluice.errors import ConfigError

    with pytest.raises(ConfigError, match="--lora-modules"):
        load_settings(lora_modules=["a=/x", "a=/y"])
    with pytest.raises(ConfigError, match="--max-cpu-loras"):
        load_settings(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="name=path"):
        load_settings(lora_modules=["nopath"])


# ---------------------------------------------------------------- the other paths


def test_without_the_cpp_seams_the_linear_path_gives_the_same_bits(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No compiler (or the kernel missing): each group runs A and B as Linears, with the same results."""
    import sluice.models.lora as lora_mod

    ads = adapters["llama"]
    mods = [f"all={ads['all']}", f"qv={ads['qv']}"]
    q = {"quantization": "int4", "quant_fallback": "none", "lora_modules": mods}
    specs: list[Spec] = [("a", prompt(1, 30), "all", 0), ("b", prompt(2, 20), None, 0), ("c", prompt(3, 25), "qv", 1)]
    fast = run(engine(tiny_llama, **q), specs)
    monkeypatch.setattr(lora_mod, "_lora_ext", lambda: None)
    slow_engine = engine(tiny_llama, **q)
    assert all(a.isa == -1 for a in slow_engine.lora.resident.values()), "the Linear seams are in use"
    slow = run(slow_engine, specs)
    for rid in fast:
        assert fast[rid][0] == slow[rid][0]
        assert all(torch.equal(x, y) for x, y in zip(fast[rid][1], slow[rid][1], strict=True)), rid


def test_bfloat16_model_runs_adapters_through_torch(
    tiny_llama: Path, adapters: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    """The path of other dtypes and of CUDA (no C++ ops): dense bf16 deltas, close to the merge."""
    adapter = adapters["llama"]["all"]
    merged = merge_into_hf_dir(tiny_llama, [adapter], tmp_path / "merged")
    p = prompt(5, 24)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    served = run(engine(tiny_llama, dtype="bfloat16", quantization="none", lora_modules=[f"a={adapter}"]),
                 [("r", p, "a", 0)], one)["r"]  # fmt: skip
    ref = run(engine(merged, dtype="bfloat16", quantization="none"), [("r", p, None, 0)], one)["r"]
    base = run(engine(tiny_llama, dtype="bfloat16", quantization="none"), [("r", p, None, 0)], one)["r"]
    gap = max_diff(served[1], ref[1])
    assert gap < 0.25 * max_diff(base[1], ref[1]), f"bf16 adapter {gap:.3g} from the merge"


def test_sluice_serve_takes_several_lora_modules_after_one_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer
    from typer.testing import CliRunner

    import sluice.server.cli as serve_cli

    given: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "serve", lambda g: given.update(g))
    app = typer.Typer()
    app.callback()(lambda: None)
    serve_cli.register(app)
    r = CliRunner().invoke(app, ["serve", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--lora-modules", "c=/z"])
    assert r.exit_code == 0, r.output
    assert given["lora_modules"] == ["a=/x", "b=/y", "c=/z"] and given["max_loras"] == 2
