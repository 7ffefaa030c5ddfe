"""Bit-packed int32 words of the hub formats (AWQ, GPTQ) <-> small unsigned integers.

    unpack_int32(words (R, C) int32, bits)  -> (R, C * 32 // bits) int16, sequential order:
        value j of word c is bits [j*bits, (j+1)*bits) of that word (j = 0 first)

Both AWQ and GPTQ pack ``32 // bits`` values into one int32 this way; AWQ then
interleaves the order of the output columns (see ``awq.py``), GPTQ packs its
``qweight`` along the input dimension instead (see ``gptq.py``).  Only widths
that divide 32 evenly (2, 4, 8) are sequential; 3-bit GPTQ straddles words and
is not read here.

``pack_int32`` is the inverse, used by the tests to build checkpoints.
"""

from __future__ import annotations

import torch

__all__ = ["unpack_int32", "pack_int32"]


def unpack_int32(words: torch.Tensor, bits: int) -> torch.Tensor:
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot unpack {bits}-bit values from int32 words (supported: 2, 4, 8)")
    per = 32 // bits
    w = words.to(torch.int32)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = torch.bitwise_right_shift(w.unsqueeze(-1), shifts) & ((1 << bits) - 1)  # (R, C, per)
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per).to(torch.int16)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C * 32 // bits) integers in [0, 2**bits) -> (R, C) int32 words (two's complement)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // per, per)
    if bool((v < 0).any()) or bool((v >= 1 << bits).any()):
        raise ValueError(f"values out of range for {bits} bits")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    word = (v << shifts).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
