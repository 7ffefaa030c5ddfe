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

import hashlib
from pathlib import Path

__all__ = ["EXTENSIONS", "CSRC", "SOURCE_HASH_MACRO", "SOURCE_HASH_PATTERN", "source_hash"]

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
        ["qgemm.cpp", "qgemm_amx.cpp", "ops.cpp", "qlinear_op.cpp", "moe_op.cpp", "quant_bindings.cpp"],
        ["-O3", "-fopenmp", "-ffp-contract=off"],
    ),
    # lora: the LoRA deltas of a step, one call per seam for every adapter group
    # (sluice/models/lora.py); no FP contraction, like quant: batch invariant.
    "lora": ("sluice.kernels._C_lora", ["lora.cpp"], ["-O3", "-fopenmp", "-ffp-contract=off"]),
}

SOURCE_HASH_MACRO = "SLUICE_SOURCE_HASH"  # csrc/build_info.h binds it as the module's source_hash()
SOURCE_HASH_PATTERN = rb"sh_[0-9a-f]{16}"  # what source_hash() returns, as found in a built module's bytes


def source_hash(name: str, csrc: str | Path = CSRC) -> str:
    """The digest a build of extension ``name`` from the sources in ``csrc`` carries: ``sh_<16 hex>``.

    NOTE(source-hash): it covers the extension's sources, every header and
    ``.inc`` file of ``csrc`` (any of them may be included) and its flags.
    ``setup.py`` and the JIT build compile it in (``-DSLUICE_SOURCE_HASH=...``,
    a plain identifier, so no quoting reaches a shell); ``sluice.kernels.ext``
    loads a prebuilt module only when its ``source_hash()`` equals the digest of
    the sources installed beside it.  A module compiled from older sources (an
    editable install whose C++ was edited since, a build directory copied
    across versions) is rebuilt from today's sources instead of being run
    against Python that expects other bindings or other results.
    """
    _, files, flags = EXTENSIONS[name]
    root = Path(csrc)
    h = hashlib.sha256()
    headers = sorted(p.name for p in root.iterdir() if p.suffix in (".h", ".inc"))
    for f in [*files, *headers]:
        h.update(f.encode() + b"\0")
        h.update((root / f).read_bytes())
    h.update(" ".join(flags).encode())
    return "sh_" + h.hexdigest()[:16]
