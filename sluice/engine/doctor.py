"""The engine's part of ``sluice doctor``: torch, its threads, GPUs, the attention backends,
and the kernel paths (how each C++ extension loads, which quantized GEMM paths
this CPU runs, and the one an engine would most likely pick).

``sluice.cli`` hands ``report`` to ``sluice.obs.cli`` (which imports no layer
above it); torch is imported when the report is made, not when this module is.
"""

from __future__ import annotations

from typing import Any

__all__ = ["report", "accelerators", "kernels"]


def accelerators() -> list[dict[str, Any]]:
    """The CUDA devices torch sees (empty without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append({"device": f"cuda:{i}", "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                        "capability": f"{p.major}.{p.minor}", "pci_address": _pci_address(p)})  # fmt: skip
    return out


def _pci_address(props: Any) -> str | None:
    """``0000:17:00.0`` from torch's device properties (joins the sysfs topology)."""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def kernels() -> dict[str, Any]:
    """How each C++ extension loads and the quantized GEMM paths this CPU supports.

    A running engine measures the paths per GEMM shape at start-up and reports
    its choice as ``ModelInfo.kernel_path`` (printed by ``sluice serve``);
    ``would_pick`` is the fastest by design, which the measurement usually confirms.
    """
    try:
        from sluice.kernels import ext, qlinear

        extensions = ext.status()
        paths = [p.label for p in qlinear.available_paths()]
    except Exception as e:  # noqa: BLE001 -- a broken build: say so, do not crash
        return {"error": f"{type(e).__name__}: {e}"}
    return {"extensions": extensions, "qlinear_paths": paths, "would_pick": paths[0] if paths else None}


def report() -> dict[str, Any]:
    """``torch``, ``torch_threads``, ``gpus`` and ``attention`` for a ``sluice doctor`` report."""
    try:
        import torch
    except ImportError:
        return {"torch": None, "gpus": [], "attention": {"device": "cpu", "available": [], "chosen": None,
                                                         "error": "torch is not installed"}}  # fmt: skip
    gpus = accelerators()
    device = "cuda" if gpus else "cpu"
    out: dict[str, Any] = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "gpus": gpus,
                           "kernels": kernels()}  # fmt: skip
    try:
        from sluice.engine.attention import available_backends
    except Exception as e:  # noqa: BLE001 -- a broken install: say so, do not crash
        out["attention"] = {"device": device, "available": [], "chosen": None, "error": f"{type(e).__name__}: {e}"}
        return out
    names = available_backends(device)
    # NOTE(backend-choice): mirrors EngineCore's default (make_attention_backend(None, ...)).
    chosen = "cpu_paged" if device == "cpu" and "cpu_paged" in names else names[0] if names else None
    out["attention"] = {"device": device, "available": names, "chosen": chosen}
    return out
