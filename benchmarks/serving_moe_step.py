"""Where a MoE decode step's time goes: the expert GEMMs' weight-read rate against memory bandwidth.

    python benchmarks/serving_moe_step.py .peers/llama1b/qwen3moe-q4_0.gguf --batches 1 8

For each batch size: decode steps of the in-process engine (128-token contexts), in two arms on one
engine: ``op``, each MoE layer one C++ call (NOTE(grouped-op) in sluice/kernels/csrc/moe_op.cpp), and
``loop``, the Python grouped loop it replaced (one gate_up and one down call per routed expert; the
arm patches ``MoEBlock.grouped_op`` to None).  Each arm: the untimed step (median), then the step
timed at the MoE layer's seams (router, the experts' gate_up/down GEMMs, the rest of the MoE layer,
the rest of the layers: attention, q/k norms, its linears), the bytes of the experts a step actually
reads (each layer's distinct routed experts x one expert's packed bytes), their read rate during
the expert GEMMs, and two memory ceilings on the same cores (one pass over 1 GiB: ``x.sum()``, and
a 1 GiB copy counting read + write).  The op times its own router and GEMMs (``MoEOp.stats``); the
loop's are timed from Python.  Then one decode step of the first arm under ``torch.profiler``: its
top operators by self CPU time (the C++ ops are invisible to it).  Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import machine_line, markdown_table, print_json_last  # noqa: E402
from benchmarks._step_profile import _prompts, read_bandwidth_gb_s  # noqa: E402
from sluice.kernels.autotune import kernel_threads  # noqa: E402


def copy_bandwidth_gb_s(num_bytes: int = 1 << 30) -> float:
    """GB/s of a 1 GiB copy (bytes read + bytes written), best of 3."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / 1e9


class Seams:
    """Seconds in each MoE seam and the distinct experts each layer ran, over the patched steps."""

    def __init__(self, net: Any, grouped: bool):
        from sluice.models.moe import MoEBlock

        self.blocks = [m for m in net.modules() if isinstance(m, MoEBlock)]
        self.layers = list(net.layers)
        self.grouped = grouped
        self.sec = {"moe": 0.0, "router": 0.0, "experts": 0.0, "layers": 0.0}
        self.experts_read = 0  # (layer, expert) pairs run, summed over steps
        self.bytes_read = 0
        self.undo: list[Any] = []
        self.ops = [b.grouped_op() for b in self.blocks] if grouped else []
        if any(op is None for op in self.ops):
            raise SystemExit("the op arm needs quantized experts in float32 on the CPU (MoEBlock.grouped_op is None)")
        for op in self.ops:
            op.reset_stats()
        for b in self.blocks:
            self._wrap(b, "forward", "moe")
            if not grouped:
                self._wrap(b, "route", "router", count=b)
                for ex in b.experts:
                    self._wrap(ex.gate_up, "forward", "experts")
                    self._wrap(ex.down, "forward", "experts")
        for layer in self.layers:
            self._wrap(layer, "forward", "layers")

    def _wrap(self, obj: Any, name: str, key: str, count: Any = None) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            self.sec[key] += time.perf_counter() - t0
            if count is not None:
                self.experts_read += int(torch.unique(out[1]).numel())
            return out

        setattr(obj, name, timed)
        self.undo.append((obj, name))

    def restore(self, expert_bytes: int) -> None:
        """Undo the patches; the op arm's seams come from the ops' own clocks (MoEOp.stats)."""
        for obj, name in self.undo:
            delattr(obj, name)
        if self.grouped:
            stats = [op.stats() for op in self.ops]  # (calls, route ns, GEMM ns, total ns, experts, bytes)
            self.sec["router"] = sum(s[1] for s in stats) / 1e9
            self.sec["experts"] = sum(s[2] for s in stats) / 1e9
            self.experts_read = sum(s[4] for s in stats)
            self.bytes_read = sum(s[5] for s in stats)
        else:
            self.bytes_read = self.experts_read * expert_bytes


def expert_bytes(net: Any) -> int:
    """Packed bytes of one expert (gate_up + down) of the first MoE layer."""
    from sluice.models.moe import MoEBlock

    block = next(m for m in net.modules() if isinstance(m, MoEBlock))
    ex: Any = block.experts[0]
    return int(ex.gate_up.nbytes + ex.down.nbytes)


ARMS = ("op", "loop")
REST_OF_MOE = ("rest of the MoE layer (op: quantization, gather, SiLU, weighted sum, pybind; "
               "loop: the Python loop over experts, gather, scatter, weighted sum)")


def measure_arm(core: Any, arm: str, steps: int) -> dict[str, Any]:
    """One arm's untimed and seam-timed decode steps on a warm engine (NOTE in the module docstring)."""
    from sluice.models.moe import MoEBlock

    grouped = arm == "op"
    built = MoEBlock.grouped_op
    if not grouped:
        MoEBlock.grouped_op = lambda self: None  # type: ignore[method-assign]
    try:
        core.step()
        plain = []
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            plain.append(time.perf_counter() - t)
        net = core.runner.model
        eb = expert_bytes(net)
        seams = Seams(net, grouped)
        t0 = time.perf_counter()
        try:
            for _ in range(steps):
                core.step()
        finally:
            seams.restore(eb)
    finally:
        MoEBlock.grouped_op = built  # type: ignore[method-assign]
    timed_step = (time.perf_counter() - t0) / steps
    s = {k: v / steps for k, v in seams.sec.items()}
    read = seams.bytes_read / steps  # bytes of expert weights one step reads
    ms = {
        "expert GEMMs (gate_up, down)": 1e3 * s["experts"],
        "router (F32 linear, softmax, top-k)": 1e3 * s["router"],
        REST_OF_MOE: 1e3 * (s["moe"] - s["experts"] - s["router"]),
        "rest of the layers (attention, its linears, norms)": 1e3 * (s["layers"] - s["moe"]),
        "rest of the step (LM head, sampling, scheduling)": 1e3 * (timed_step - s["layers"]),
    }
    return {
        "arm": arm, "step_ms": 1e3 * statistics.median(plain), "timed_step_ms": 1e3 * timed_step,
        "breakdown_ms": ms, "experts_per_step": seams.experts_read / steps, "expert_mb": eb / 1e6,
        "expert_read_mb": read / 1e6, "expert_read_gb_s": read / s["experts"] / 1e9 if s["experts"] else 0.0,
    }  # fmt: skip


def measure(model: str, batch: int, steps: int, arms: list[str], profile: bool) -> dict[str, Any]:
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    core = EngineCore(EngineConfig(model=model, max_num_seqs=batch, max_num_batched_tokens=4096,
                                   kv_cache_memory=1 << 30))  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=(2 * steps + 2) * len(arms) + 8, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, 128, seed=5)):
        core.add_request(EngineRequest(request_id=f"p{i}", prompt_token_ids=p, sampling=sp, arrival_time=time.monotonic()))
    while core.make_stats().num_decoding < batch:
        core.step()
    for _ in range(2):
        core.step()
    out: dict[str, Any] = {"batch": batch, "threads": kernel_threads(), "kernel_path": core.runner.kernel_path,
                           "arms": {arm: measure_arm(core, arm, steps) for arm in arms}}  # fmt: skip
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            core.step()
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        out["profiler_top"] = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
                                "share": e.self_cpu_time_total / total if total else 0.0} for e in rows]  # fmt: skip
    del core
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="op: one C++ call per MoE layer; loop: the Python loop")
    args = ap.parse_args()
    res: dict[str, Any] = {"machine": machine_line(), "read_gb_s": read_bandwidth_gb_s(),
                           "copy_gb_s": copy_bandwidth_gb_s()}  # fmt: skip
    res["batches"] = [measure(args.model, b, args.steps, args.arms, profile=(i == 0)) for i, b in enumerate(args.batches)]
    cols = [(b, arm, b["arms"][arm]) for b in res["batches"] for arm in args.arms]
    keys = list(cols[0][2]["breakdown_ms"])
    rows: list[list[object]] = [[k, *[f"{a['breakdown_ms'][k]:.1f}" for _, _, a in cols]] for k in keys]
    rows += [["step (untimed, median)", *[f"{a['step_ms']:.1f}" for _, _, a in cols]],
             ["distinct experts run per step (all layers)", *[f"{a['experts_per_step']:.0f}" for _, _, a in cols]],
             ["expert weights read per step (MB)", *[f"{a['expert_read_mb']:.0f}" for _, _, a in cols]],
             ["expert weight-read rate in the expert GEMMs (GB/s)", *[f"{a['expert_read_gb_s']:.1f}" for _, _, a in cols]],
             ["memory: 1 GiB read / copy (GB/s)", *[f"{res['read_gb_s']:.1f} / {res['copy_gb_s']:.1f}" for _ in cols]]]  # fmt: skip
    print(res["machine"])
    print(markdown_table(["decode step (ms unless noted)", *[f"batch {b['batch']}, {arm}" for b, arm, _ in cols]], rows))
    top = res["batches"][0].get("profiler_top", [])
    if top:
        print(f"\ntorch.profiler, one decode step at batch {res['batches'][0]['batch']} (op arm), "
              "top operators by self CPU time:")
        print(markdown_table(["operator", "calls", "self ms", "share"],
                             [[t["op"], t["calls"], f"{t['self_ms']:.1f}", f"{t['share']:.0%}"] for t in top]))  # fmt: skip
    print_json_last(res)


if __name__ == "__main__":
    main()
