"""What C++ extensions sluice builds, and with which flags (torch-free, read by setup.py too).

Each extension is compiled when the package is installed (``setup.py``,
torch's ``CppExtension``) and, only if that did not happen (no compiler at
install time, an sdist built without torch), compiled on first use by
``sluice.kernels.ext`` into the sluice cache directory.

NOTE(isa): nothing is compiled with -march=native.  ISA-specific code paths
(AVX2, AVX-512, VNNI) are compiled per function with GCC target attributes and
chosen at run time from the CPU's flags, so one build runs on any x86-64 and
uses what the machine has.
"""

from __future__ import annotations

__all__ = ["EXTENSIONS", "CSRC"]

CSRC = "sluice/kernels/csrc"

# name -> (python module, sources under CSRC, extra compile flags)
EXTENSIONS: dict[str, tuple[str, list[str], list[str]]] = {
    # attention: fast-math lets the dot products vectorise (reassociation); each
    # (token, head) is reduced by one thread in a fixed order either way.
    "attention": ("sluice.kernels._C_attention", ["paged_attention.cpp"], ["-O3", "-fopenmp", "-ffast-math"]),
    # quant: no fast-math and no FP contraction, so every path (AVX-512, AVX2,
    # scalar) performs the same float operations in the same order: results are
    # bit-identical across batch sizes (batch invariance) and across ISAs.
    "quant": (
        "sluice.kernels._C_quant",
        ["qgemm.cpp", "qgemm_amx.cpp", "ops.cpp", "qlinear_op.cpp", "quant_bindings.cpp"],
        ["-O3", "-fopenmp", "-ffp-contract=off"],
    ),
    # lora: the LoRA deltas of a step, one call per seam for every adapter group
    # (sluice/models/lora.py); no FP contraction, like quant: batch invariant.
    "lora": ("sluice.kernels._C_lora", ["lora.cpp"], ["-O3", "-fopenmp", "-ffp-contract=off"]),
}
