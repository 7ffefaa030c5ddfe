"""Where one decode step's milliseconds go, for any weight path (native quantized or float).

    from benchmarks._step_profile import step_profile
    prof = step_profile("smollm2", batch=32)             # the default (native) path
    prof = step_profile("smollm2", batch=1, quantization="none")

The quantized kernels are C++ functions called through pybind, which torch's
profiler does not see, so the step is timed at the model's own seams instead:
each decoder layer (GEMMs with their fused norms / rope / SiLU / residuals,
plus attention), the attention backend inside it, the LM head, the embedding;
what is left of the step is sampling, scheduling and Python.  Against that:
the weight bytes one step reads (at batch 1 a step should be bound by reading
them once) and GEMM GOP/s, with two ceilings measured on the same cores: the
same model's GEMMs at 512 rows (what the kernels reach when compute-bound)
and a plain read of 1 GiB (memory bandwidth).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from sluice.kernels.autotune import kernel_threads

PROMPT_TOKENS = 128


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 30000, (length,), generator=g).tolist() for _ in range(n)]


class _Timer:
    """Wraps a bound method on one object and sums the seconds spent in it."""

    def __init__(self, obj: Any, name: str):
        self.obj, self.name, self.seconds = obj, name, 0.0
        self.inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self.inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)

    def restore(self) -> None:
        try:
            delattr(self.obj, self.name)  # the instance attribute shadowed the class's method
        except AttributeError:
            setattr(self.obj, self.name, self.inner)


def gemm_shapes(cfg: Any) -> list[tuple[int, int]]:
    """(K, N) of every GEMM of one forward, LM head included."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)] * cfg.num_layers + [(h, cfg.vocab_size)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer except the rope tables (what a forward reads)."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "rope_" in name or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def read_bandwidth_gb_s(num_bytes: int = 1 << 30) -> float:
    """GB/s of one pass over a buffer larger than any cache (sum of float32), best of 3, on as many
    threads as the kernels use (an engine built before it leaves torch one thread)."""
    x = torch.ones(num_bytes // 4)
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, kernel_threads()))
    try:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return num_bytes / best / 1e9


def gemm_peak_gop_s(model: Any, rows: int = 512) -> float:
    """GOP/s (2 x MACs) of the model's first layer's four GEMMs at ``rows`` rows: the kernels' compute-bound rate."""
    layer = model.layers[0]
    cfg = model.cfg
    lins = [(layer.qkv, cfg.hidden_size), (layer.o_proj, cfg.num_heads * cfg.head_dim),
            (layer.gate_up, cfg.hidden_size), (layer.down, cfg.intermediate_size)]
    xs = [torch.randn(rows, k) * 0.1 for _, k in lins]
    macs = sum(rows * k * lin.out_features for (lin, k) in lins)
    with torch.inference_mode():
        for (lin, _), x in zip(lins, xs):
            lin(x)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for (lin, _), x in zip(lins, xs):
                lin(x)
            best = min(best, time.perf_counter() - t)
    return 2 * macs / best / 1e9


def step_profile(model: str, batch: int, ctx: int = PROMPT_TOKENS, steps: int = 6, **engine_args: Any) -> dict[str, Any]:
    """One decode step at ``batch`` sequences of ``ctx`` tokens, split at the model's seams (ms)."""
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    engine_args.setdefault("kv_cache_memory", 1 << 30)
    core = EngineCore(EngineConfig(model=model, max_num_seqs=max(batch, 1), max_num_batched_tokens=4096, **engine_args))
    sp = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, ctx, seed=5)):
        core.add_request(EngineRequest(request_id=f"p{i}", prompt_token_ids=p, sampling=sp, arrival_time=time.monotonic()))
    while core.make_stats().num_decoding < batch:
        core.step()
    for _ in range(2):
        core.step()  # decode-only steps outside the measurement
    runner = core.runner
    net = runner.model
    t_plain = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        t_plain.append(time.perf_counter() - t)

    timers = {"layers": [_Timer(layer, "forward") for layer in net.layers],
              "head": [_Timer(net, "compute_logits")], "embed": [_Timer(net, "embed_tokens")]}
    # the backend is called as an object (__call__, looked up on its type) or, by the fused layers, through
    # attend_qkv (which may call __call__ itself: only the outermost call is timed)
    backend_cls = type(runner.attention)
    originals = {name: backend_cls.__dict__[name] for name in ("__call__", "attend_qkv") if name in backend_cls.__dict__}
    attn_s = [0.0]
    depth = [0]

    def timed(inner: Any) -> Any:
        def call(self: Any, *a: Any) -> Any:
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return inner(self, *a)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    attn_s[0] += time.perf_counter() - t0

        return call

    for name in ("__call__", "attend_qkv"):
        setattr(backend_cls, name, timed(getattr(backend_cls, name)))
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            core.step()
    finally:
        for name in ("__call__", "attend_qkv"):
            if name in originals:
                setattr(backend_cls, name, originals[name])
            else:
                delattr(backend_cls, name)  # it was inherited: the base class's shows through again
        for ts in timers.values():
            for tm in ts:
                tm.restore()
    timed_step = (time.perf_counter() - t0) / steps
    sec = {k: sum(tm.seconds for tm in ts) / steps for k, ts in timers.items()}
    sec["attention"] = attn_s[0] / steps
    ms = {
        "decoder layers excl. attention (GEMMs, norms, rope, SiLU, residuals)": 1e3 * (sec["layers"] - sec["attention"]),
        "attention": 1e3 * sec["attention"],
        "LM head": 1e3 * sec["head"],
        "embedding": 1e3 * sec["embed"],
    }
    ms["rest (sampling, scheduling, Python)"] = max(0.0, 1e3 * timed_step - sum(ms.values()))
    step_ms = 1e3 * statistics.median(t_plain)
    cfg = runner.model_config
    gemm_s = sec["layers"] - sec["attention"] + sec["head"]
    wbytes = weight_bytes(net)
    result = {
        "batch": batch, "context": ctx, "threads": kernel_threads(),
        "quantization": getattr(runner, "quantization", "none"), "kernel_path": getattr(runner, "kernel_path", ""),
        "step_ms": step_ms, "breakdown_ms": ms,
        "weight_mb": wbytes / 1e6,
        "weight_gb_s": wbytes / gemm_s / 1e9 if gemm_s else float("nan"),
        "gemm_gop_s": 2 * batch * sum(k * n for k, n in gemm_shapes(cfg)) / gemm_s / 1e9 if gemm_s else float("nan"),
        "gemm_peak_gop_s": gemm_peak_gop_s(net),
        "read_bandwidth_gb_s": read_bandwidth_gb_s(),
    }
    del core, runner, net
    return result


def profile_rows(profiles: list[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    """A markdown table (headers, rows) with one column per profiled batch size."""
    headers = ["decode step (ms unless noted)"] + [f"batch {p['batch']}" for p in profiles]
    keys = list(profiles[0]["breakdown_ms"])
    rows: list[list[object]] = [[k, *[p["breakdown_ms"][k] for p in profiles]] for k in keys]
    rows += [
        ["step (unwrapped)", *[p["step_ms"] for p in profiles]],
        ["weights read per step, MB", *[p["weight_mb"] for p in profiles]],
        ["weight read rate in the GEMMs, GB/s", *[p["weight_gb_s"] for p in profiles]],
        ["memory read bandwidth (1 GiB sum), GB/s", *[p["read_bandwidth_gb_s"] for p in profiles]],
        ["GEMM GOP/s in the step", *[p["gemm_gop_s"] for p in profiles]],
        ["GEMM GOP/s at 512 rows (compute-bound ceiling)", *[p["gemm_peak_gop_s"] for p in profiles]],
    ]
    return headers, rows
