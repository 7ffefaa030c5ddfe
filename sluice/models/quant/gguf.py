"""GGUF tensors -> the canonical ``QuantWeight`` form, without changing a weight value.

    qweight_from_gguf(reader_tensor)   -> QuantWeight (quantized types) | float32 tensor (F32/F16/BF16)
    unpermute_rows(w, n_head)          -> undo llama.cpp's q/k row permutation (QuantWeight or tensor)
    gguf_quant_state_dict(reader, path, cfg) -> HF-named {name: QuantWeight | float32 tensor}

Each ggml block type is unpacked into integers ``q`` plus per-group ``d`` and
``m`` so that ``d * (q - z) + m`` in float32 is, bit for bit, what gguf-py's
``quants.dequantize`` (and ggml's ``dequantize_row_*``) compute:

    type   block  bytes  -> G   bits  z    d              m
    Q4_0     32    18       32   4     8    d              0
    Q4_1     32    20       32   4     0    d              m
    Q5_0     32    22       32   5    16    d              0
    Q5_1     32    24       32   5     0    d              m
    Q8_0     32    34       32   8   128    d              0        (signed q -> q + 128)
    Q4_K    256   144       32   4     0    d*sc[j]        -(dmin*mn[j])
    Q5_K    256   176       32   5     0    d*sc[j]        -(dmin*mn[j])
    Q6_K    256   210       16   6    32    d*sc[j]        0

(fp16 scales widened to float32; ``d*sc`` and ``dmin*mn`` are the float32
products ggml forms, and ``x - y`` equals ``x + (-y)`` exactly in IEEE.)  Q5_0
and Q5_1 are included because llama.cpp's Q4_K_M/Q5_K_M files fall back to
them for rows whose length is not a multiple of 256.

Vectorised numpy over row chunks: a 1B model unpacks in a few seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight

__all__ = [
    "GGUF_QUANT_TYPES",
    "GGUF_FLOAT_TYPES",
    "qweight_from_gguf",
    "qweight_from_blocks",
    "unpermute_rows",
    "gguf_quant_state_dict",
    "LazyQuantWeight",
]

# unpacker(blocks (nb, type_size) uint8) -> q (nb, block) uint8, d (nb, groups) f32, m (nb, groups) f32 | None
_Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]

_ROWS_PER_CHUNK = 2048  # bounds the temporaries to a few tens of MB per chunk


def _f16(b: np.ndarray) -> np.ndarray:
    """(nb, 2) uint8 little-endian fp16 -> (nb, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) bytes -> (nb, 32): the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) bytes (a little-endian uint32) -> (nb, 32) bit j of the word, as 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q4_0(b: np.ndarray) -> _Unpacked:
    return _nibbles_32(b[:, 2:18]), _f16(b[:, 0:2]), None


def _q4_1(b: np.ndarray) -> _Unpacked:
    return _nibbles_32(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> _Unpacked:
    return _nibbles_32(b[:, 6:22]) | (_high_bits_32(b[:, 2:6]) << 4), _f16(b[:, 0:2]), None


def _q5_1(b: np.ndarray) -> _Unpacked:
    return _nibbles_32(b[:, 8:24]) | (_high_bits_32(b[:, 4:8]) << 4), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> _Unpacked:
    return b[:, 2:34] ^ np.uint8(0x80), _f16(b[:, 0:2]), None  # int8 x -> x + 128


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit (scale, min) pairs of Q4_K/Q5_K -> two (nb, 8) float32 arrays.

        bytes 0-3:  scale[0..3] low 6 bits | scale[4..7] bits 4-5 in the top 2
        bytes 4-7:  min[0..3]   low 6 bits | min[4..7]   bits 4-5 in the top 2
        bytes 8-11: scale[4..7] bits 0-3 (low nibble), min[4..7] bits 0-3 (high nibble)
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 128) bytes -> (nb, 256): sub-block 2j is the low nibbles of bytes 32j..32j+31, 2j+1 the high."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> _Unpacked:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return _k_low_nibbles(b[:, 16:144]), d * sc, -(dmin * mn)


def _q5_k(b: np.ndarray) -> _Unpacked:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j -> sub-block j
    q = _k_low_nibbles(b[:, 48:176]) | ((qh & 1).reshape(-1, 256) << 4)
    return q, d * sc, -(dmin * mn)


def _q6_k(b: np.ndarray) -> _Unpacked:
    # ql: 128 bytes, two halves of 64: low nibbles are elements 0..63, high 64..127 of the half
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    ql = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 256)
    # qh: 64 bytes, two halves of 32: bits 2i..2i+1 are the top bits of the half's element 32i + byte
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ql | ((qh & 0x03).reshape(-1, 256) << 4)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q, _f16(b[:, 208:210]) * sc, None


# name -> (unpacker, block size, bytes per block, group size, bits, zero point)
_FORMATS: dict[str, tuple[Callable[[np.ndarray], _Unpacked], int, int, int, int, int]] = {
    "Q4_0": (_q4_0, 32, 18, 32, 4, 8),
    "Q4_1": (_q4_1, 32, 20, 32, 4, 0),
    "Q5_0": (_q5_0, 32, 22, 32, 5, 16),
    "Q5_1": (_q5_1, 32, 24, 32, 5, 0),
    "Q8_0": (_q8_0, 32, 34, 32, 8, 128),
    "Q4_K": (_q4_k, 256, 144, 32, 4, 0),
    "Q5_K": (_q5_k, 256, 176, 32, 5, 0),
    "Q6_K": (_q6_k, 256, 210, 16, 6, 32),
}
GGUF_QUANT_TYPES = tuple(_FORMATS)
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")


def _unsupported(name: str, qtype: str) -> ModelLoadError:
    return ModelLoadError(
        f"GGUF tensor {name}: type {qtype} is not supported "
        f"(supported: {', '.join(GGUF_QUANT_TYPES + GGUF_FLOAT_TYPES)}); "
        f"re-quantize the model to one of these types with llama.cpp's llama-quantize"
    )


def qweight_from_blocks(data: np.ndarray, qtype: str, shape: tuple[int, ...], name: str = "?") -> QuantWeight:
    """Raw ggml blocks ``data`` (rows, bytes per row) uint8 of a (N, K) tensor -> ``QuantWeight``."""
    if qtype not in _FORMATS:
        raise _unsupported(name, qtype)
    unpack, block, nbytes, g, bits, z = _FORMATS[qtype]
    if len(shape) != 2:
        raise ModelLoadError(f"GGUF tensor {name}: {qtype} tensor of shape {shape} is not a matrix")
    n, k = shape
    if k % block or data.size != n * (k // block) * nbytes:
        raise ModelLoadError(f"GGUF tensor {name}: {data.size} bytes do not hold a {qtype} matrix of shape {shape}")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(n, (k // block) * nbytes)
    q = np.empty((n, k), dtype=np.uint8)
    d = np.empty((n, k // g), dtype=np.float32)
    m = np.zeros((n, k // g), dtype=np.float32)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        r1 = min(n, r0 + _ROWS_PER_CHUNK)
        qb, db, mb = unpack(blocks[r0:r1].reshape(-1, nbytes))
        q[r0:r1] = qb.reshape(r1 - r0, k)
        d[r0:r1] = db.reshape(r1 - r0, k // g)
        if mb is not None:
            m[r0:r1] = mb.reshape(r1 - r0, k // g)
    return QuantWeight(
        q=torch.from_numpy(q),
        d=torch.from_numpy(d),
        m=torch.from_numpy(m),
        bits=bits,
        group_size=g,
        zero_point=z,
        source=f"gguf:{qtype}",
    )


def _float_from_gguf(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype == "F32":
        arr = np.array(data, dtype=np.float32)
    elif qtype == "F16":
        arr = np.asarray(data).view(np.float16).astype(np.float32)
    else:  # BF16: the top half of a float32
        arr = (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def qweight_from_gguf(tensor: Any) -> QuantWeight | torch.Tensor:
    """A ``gguf.GGUFReader`` tensor in sluice's (N out, K in) orientation.

    Quantized matrices come back as ``QuantWeight`` (exact: its ``dequantize()``
    equals ``gguf.quants.dequantize``); F32/F16/BF16 tensors of any rank as
    float32 tensors.  Any other type raises ``ModelLoadError``.
    """
    qtype = tensor.tensor_type.name
    shape = tuple(reversed([int(x) for x in tensor.shape]))  # ggml lists ne0 (the row length) first
    if qtype in GGUF_FLOAT_TYPES:
        return _float_from_gguf(tensor.data, qtype, shape)
    if qtype not in _FORMATS:
        raise _unsupported(tensor.name, qtype)
    return qweight_from_blocks(tensor.data, qtype, shape, tensor.name)


def unpermute_rows(w: QuantWeight | torch.Tensor, n_head: int) -> QuantWeight | torch.Tensor:
    """Undo the q/k row permutation of llama.cpp's converter (see ``files.unpermute``).

    It reorders output rows only, so it applies to ``q``, ``d`` and ``m`` alike and
    changes no value.
    """
    from sluice.models.files import unpermute as _unpermute

    if isinstance(w, torch.Tensor):
        return _unpermute(w, n_head).contiguous()
    return QuantWeight(
        q=_unpermute(w.q, n_head).contiguous(),
        d=_unpermute(w.d, n_head).contiguous(),
        m=_unpermute(w.m, n_head).contiguous(),
        bits=w.bits,
        group_size=w.group_size,
        zero_point=w.zero_point,
        source=w.source,
    )


def gguf_quant_state_dict(reader: Any, path: Any, cfg: dict[str, Any]) -> dict[str, QuantWeight | torch.Tensor]:
    """Every tensor of a GGUF file under its HF name, quantized ones as ``QuantWeight``.

    The quantized twin of ``loader.load_gguf_state_dict``: same names (the
    loader's GGUF -> HF table), same q/k un-permutation for Llama/Mistral, no
    value changed.  ``cfg`` is ``loader.gguf_hf_config(reader, path)``.
    """
    from sluice.models.files import gguf_field
    from sluice.models.files import gguf_hf_name as _gguf_hf_name

    permute = cfg["model_type"] in ("llama", "mistral", "mixtral")
    arch = gguf_field(reader, "general.architecture", "llama")
    heads = {"q_proj.weight": cfg["num_attention_heads"], "k_proj.weight": cfg["num_key_value_heads"]}
    sd: dict[str, QuantWeight | torch.Tensor] = {}
    for t in reader.tensors:
        hf = _gguf_hf_name(t.name, arch)
        if hf is None:
            continue
        try:
            if "{}" in hf:  # an expert stack: one matrix per expert (NOTE(expert-stacks))
                sd.update({hf.format(e): w for e, w in enumerate(_expert_matrices(t))})
                continue
            w = qweight_from_gguf(t)
        except ModelLoadError as e:
            raise ModelLoadError(f"GGUF file {path}: {e}") from e
        n_head = next((h for suffix, h in heads.items() if hf.endswith(suffix)), None)
        if permute and n_head is not None:
            w = unpermute_rows(w, int(n_head))
        sd[hf] = w
    return sd


def _expert_matrices(tensor: Any) -> list[QuantWeight | torch.Tensor]:
    """NOTE(expert-stacks): llama.cpp stores a MoE layer's experts as one 3D tensor (ne: cols, rows, E);
    its data is E consecutive matrices, each converted like any 2D tensor (no value changed)."""
    qtype = tensor.tensor_type.name
    shape = tuple(reversed([int(x) for x in tensor.shape]))  # (E, rows, cols)
    if len(shape) != 3:
        raise ModelLoadError(f"GGUF tensor {tensor.name}: expected an (experts, rows, cols) stack, got shape {shape}")
    n_exp, rows, cols = shape
    if qtype in GGUF_FLOAT_TYPES:
        full = _float_from_gguf(tensor.data, qtype, shape)
        return [full[e].contiguous() for e in range(n_exp)]
    if qtype not in _FORMATS:
        raise _unsupported(tensor.name, qtype)
    _, block, nbytes, g, bits, z = _FORMATS[qtype]
    if cols % block or np.asarray(tensor.data).size != n_exp * rows * (cols // block) * nbytes:
        raise ModelLoadError(f"GGUF tensor {tensor.name}: its bytes do not hold a {qtype} stack of shape {shape}")
    data = np.asarray(tensor.data).reshape(n_exp, -1)  # a view of the memory-mapped file: nothing read yet
    return [
        LazyQuantWeight(partial(qweight_from_blocks, data[e], qtype, (rows, cols), f"{tensor.name}[{e}]"),
                        (rows, cols), bits, g, z, f"gguf:{qtype}")  # fmt: skip
        for e in range(n_exp)
    ]


class LazyQuantWeight(QuantWeight):
    """NOTE(lazy-experts): a ``QuantWeight`` whose integers are unpacked from the memory-mapped file
    when first read, and dropped by ``release()`` once the kernels' packed copy exists.  A MoE
    model's experts are most of its weights; unpacked all at once (a byte per weight, plus the
    float scales) they would need about twice the file's size in memory before packing, so a
    Qwen3-30B-A3B Q4 file (17 GB) would need ~40 GB to load.  Expert by expert, the peak is the
    packed model plus one expert."""

    def __init__(self, convert: Callable[[], QuantWeight], shape: tuple[int, int], bits: int, group_size: int,
                 zero_point: int, source: str):  # fmt: skip
        self._convert, self._shape, self._value = convert, shape, None
        self.bits, self.group_size, self.zero_point, self.source = bits, group_size, zero_point, source

    def _get(self) -> QuantWeight:
        if self._value is None:
            self._value = self._convert()
        return self._value

    @property  # type: ignore[override]
    def q(self) -> torch.Tensor:
        return self._get().q

    @property  # type: ignore[override]
    def d(self) -> torch.Tensor:
        return self._get().d

    @property  # type: ignore[override]
    def m(self) -> torch.Tensor:
        return self._get().m

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def is_loaded(self) -> bool:
        return self._value is not None

    def release(self) -> None:
        self._value = None
