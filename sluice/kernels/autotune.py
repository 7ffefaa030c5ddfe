"""Pick the quantized-GEMM path per weight shape and batch size, by measuring.

Every kernel path gives bit-identical results (sluice/kernels/csrc/qgemm.h), so
choosing per (shape, batch bucket) changes speed only, never a result.  The
first start on a machine times each available path on each quantized shape
of the model at a few batch sizes (a second or two); the choice is cached in
``<sluice cache>/autotune-v6.json`` keyed by the CPU (model name, flags) and
the threads the GEMMs run on, so later starts pay nothing.

``SLUICE_KERNEL_PATH=avx2`` (or avx512vnni, avxvnni, scalar) forces one path.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from sluice.kernels import ext
from sluice.kernels import qlinear as ql
from sluice.kernels.linear import BUCKETS, KernelPlan, Linear

__all__ = ["plan_kernels", "cpu_key", "kernel_threads", "measure_shape"]

log = logging.getLogger("sluice.kernels")

# NOTE(bucket-8): 5-8 rows (a verification of 4-7 drafts, 5-8 running decodes) have a bucket of their own:
# in one 5-16 bucket, timed at 16 rows, AMX won (9.3 against 12.4 ms for SmolLM2's layers) and then ran
# 5 rows at 6.0 ms where AVX-512 VNNI takes 4.8.
_REPRESENTATIVE_M = (1, 4, 8, 16, 64, 256)  # one batch size per bucket of linear.BUCKETS
assert len(_REPRESENTATIVE_M) == len(BUCKETS)


def _cache_file() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sluice"
    )
    return Path(root) / "autotune-v6.json"


def kernel_threads() -> int:
    """Threads a quantized GEMM runs on now: the work pool's where it is on (NOTE(work-pool)), else torch's.

    NOTE(plan-threads): the plan is measured and filed under these, not ``torch.get_num_threads()``: an
    engine that moved its loops onto the pool leaves torch one thread, and a plan measured on two pool
    threads was filed as a one-thread plan (so each machine kept two plans, one of them mislabelled)."""
    return ext.work_pool_threads() or torch.get_num_threads()


def cpu_key() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    feats = ",".join(ql.kernel_module().cpu_features())
    return f"{name}|{feats}|threads={kernel_threads()}"


def _time(fn: Any, budget_s: float = 0.02) -> float:
    fn()
    best, spent, n = float("inf"), 0.0, 0
    while n < 3 or (spent < budget_s and n < 20):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


# NOTE(noise): another path replaces the preferred one (the widest the CPU has) only
# when it is clearly faster; a busy machine's timings otherwise pick at random.
_MARGIN = 0.85


def measure_shape(pw: ql.PackedWeight, paths: list[ql.Path]) -> list[ql.Path]:
    """The fastest path for each batch bucket of one packed weight.

    Candidates are the vector paths (scalar only on a CPU without AVX2); the
    first of ``paths`` is kept unless another takes under 85% of its time.
    """
    candidates = [p for p in paths if p != ql.Path.SCALAR] or list(paths)
    preferred = candidates[0]
    out_paths = []
    gen = torch.Generator().manual_seed(0)
    for m in _REPRESENTATIVE_M:
        x = torch.randn(m, pw.k, generator=gen)
        xq = ql.quantize_activations(x)
        out = torch.empty(m, pw.n)
        times = {p: _time(lambda p=p, xq=xq, out=out: ql.gemm(xq, pw, out, path=p)) for p in candidates}  # type: ignore[misc]
        best = min(times, key=times.__getitem__)
        out_paths.append(best if times[best] < _MARGIN * times[preferred] else preferred)
    return out_paths


def _load_cache() -> dict[str, Any]:
    try:
        return json.loads(_cache_file().read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def _save_cache(doc: dict[str, Any]) -> None:
    f = _cache_file()
    tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, f)
    except OSError:  # a read-only cache only costs the measurement next time
        tmp.unlink(missing_ok=True)


def plan_kernels(model: torch.nn.Module) -> str:
    """Give every Linear of ``model`` that runs on sluice's kernels (quantized, or the batch-invariant float
    kernel) one shared KernelPlan; return a label for reports.  A float-only layer of such a model (an int4
    model's float head) takes the plan's default ISA: without a plan it ran the scalar loop, 38 tok/s for
    SmolLM2 at int4 where int8 made 107."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.needs_op]
    if not linears:
        return ""
    paths = ql.available_paths()
    forced = os.environ.get("SLUICE_KERNEL_PATH", "").strip().lower()
    if forced:
        try:
            chosen = ql.Path[forced.upper()]
        except KeyError:
            raise ValueError(f"SLUICE_KERNEL_PATH={forced!r}: use one of {', '.join(p.label for p in ql.Path)}") from None
        if chosen not in paths:
            raise ValueError(f"SLUICE_KERNEL_PATH={forced}: this CPU supports {', '.join(p.label for p in paths)}")
        plan = KernelPlan(default=chosen)
    else:
        plan = KernelPlan(default=paths[0])
        shapes: dict[tuple[int, int, int], ql.PackedWeight] = {}
        for lin in linears:
            for kind, i, _ in lin.parts:
                if kind == "quant":
                    pw = lin._packed(i)
                    shapes.setdefault((pw.n, pw.k, pw.mode), pw)
        key = cpu_key()
        doc = _load_cache()
        known: dict[str, list[str]] = doc.setdefault(key, {})
        t0, measured = time.monotonic(), 0
        for shape, pw in shapes.items():
            skey = ",".join(map(str, shape))
            if (skey not in known or len(known[skey]) != len(BUCKETS)
                    or any(p not in {q.label for q in paths} for p in known[skey])):  # fmt: skip
                known[skey] = [p.label for p in measure_shape(pw, paths)]
                measured += 1
            plan.by_shape[shape] = [ql.Path[p.upper()] for p in known[skey]]
        if measured:
            _save_cache(doc)
            log.info("kernel autotune: %d shapes measured in %.1fs", measured, time.monotonic() - t0)
    for lin in linears:
        lin.plan = plan
    prepare = getattr(model, "prepare", None)
    if prepare is not None:
        prepare()
    else:
        for lin in linears:
            lin.prepare()
    used = sorted({p for ps in plan.by_shape.values() for p in ps} or {plan.default}, key=int, reverse=True)
    return "+".join(p.label for p in used)
