"""Offline throughput of the engine vs transformers' batched generate, where a decode step goes, KV memory.

    python benchmarks/offline_throughput.py                          # full run (~10 min on 2 quiet cores)
    python benchmarks/offline_throughput.py --quick                  # smaller, for a smoke check
    python benchmarks/offline_throughput.py --model .peers/llama1b/llama1b-q4_0.gguf --quick --no-write

Side by side in one run, greedy, ignore_eos, equal-length prompts: sluice's
``LLM.generate`` as it serves by default (the GGUF's quantized weights on the
native int8-activation kernels), the same with ``quantization="none"`` (every
weight dequantized to float32: the old path), and transformers'
``LlamaForCausalLM.generate`` on the same fp32 weights, batched (all prompts in
one call) and one prompt at a time.  Target (issue 10): sluice >= 2x
transformers' batched ``generate``.  Then: dtype / attention variants, one
decode step at batch 1 and 32 split at the model's seams (see
benchmarks/_step_profile.py), and paged-vs-contiguous KV memory.

Prints tables, writes the ``offline_throughput`` section of docs/benchmarks.md
(``offline_throughput_<stem>`` for another ``--model``), with the CPU model and
flags, and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from sluice.engine.block_manager import BlockManager  # noqa: E402
from sluice.engine.protocol import SamplingParams  # noqa: E402
from sluice.engine.request import Request  # noqa: E402

TARGET_VS_BATCHED = 2.0  # issue 10: >= 2x transformers' batched generate


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]


def hf_model(model: str = "smollm2"):  # type: ignore[no-untyped-def]
    """transformers' LlamaForCausalLM with the same (dequantized) weights, built without a 40 s GGUF load."""
    import transformers

    from sluice.models.files import gguf_hf_config, gguf_reader, load_gguf_state_dict
    from sluice.models.source import resolve_model

    src = resolve_model(model)
    reader = gguf_reader(src.path)
    cfg = gguf_hf_config(reader, src.path)
    sd = load_gguf_state_dict(reader, src.path, cfg)
    conf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    hf = transformers.LlamaForCausalLM(conf).eval()
    hf.load_state_dict(sd, strict=False)
    if conf.tie_word_embeddings:
        hf.tie_weights()
    return hf


def bench_sluice(model: str, ps: list[list[int]], out_len: int, **kw: object) -> dict[str, Any]:
    """Output tok/s of one ``LLM.generate`` over all prompts (after a 2-prompt warm-up), and how it served."""
    from sluice import LLM

    llm = LLM(model, max_num_seqs=max(64, len(ps)), max_num_batched_tokens=2048, **kw)  # type: ignore[arg-type]
    info = llm.engine.model_info
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(ps[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), progress=False)
    t = time.perf_counter()
    outs = llm.generate(ps, sp, progress=False)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    if n != out_len * len(ps):
        raise RuntimeError(f"sluice produced {n} tokens, expected {out_len} x {len(ps)}")
    del llm
    gc.collect()
    return {"tok_s": n / dt, "seconds": dt, "quantization": info.quantization, "kernel_path": info.kernel_path,
            "dtype": info.dtype}


def bench_hf_batched(model, ps: list[list[int]], out_len: int) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor(ps)  # equal lengths: no padding needed, attention mask all ones
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=2)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * out.shape[0] / dt


def bench_hf_single(model, ps: list[list[int]], out_len: int) -> float:  # type: ignore[no-untyped-def]
    n, t = 0, time.perf_counter()
    with torch.no_grad():
        for p in ps:
            out = model.generate(torch.tensor([p]), max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=2)
            n += out.shape[1] - len(p)
    return n / (time.perf_counter() - t)


def served_as(r: dict[str, Any]) -> str:
    if r["quantization"] == "none":
        return f"dequantized to {r['dtype']}"
    return f"{r['quantization']} on {r['kernel_path'] or '-'}"


def throughput_rows(native: dict[str, Any], fp32: dict[str, Any], hf_batched: float, hf_single: float,
                    n_single: int) -> tuple[list[list[object]], dict[str, Any]]:
    """The throughput table (engine, served as, tok/s, ratio to transformers batched) and the target verdict."""
    rows: list[list[object]] = [
        ["sluice LLM.generate (default: native quantized)", served_as(native), native["tok_s"], native["tok_s"] / hf_batched],
        ["sluice LLM.generate, quantization=\"none\"", served_as(fp32), fp32["tok_s"], fp32["tok_s"] / hf_batched],
        ["transformers generate, batched", "float32", hf_batched, 1.0],
        [f"transformers generate, one at a time ({n_single} prompts)", "float32", hf_single, hf_single / hf_batched],
    ]
    ratio = native["tok_s"] / hf_batched
    verdict = {"target": f">= {TARGET_VS_BATCHED:g}x transformers' batched generate", "ratio": ratio,
               "status": "met" if ratio >= TARGET_VS_BATCHED else "missed"}
    return rows, verdict


def section_name(model: str) -> str:
    if model.lower() == "smollm2":
        return "offline_throughput"
    stem = Path(model).name.removesuffix(".gguf")
    return "offline_throughput_" + re.sub(r"[^A-Za-z0-9_.-]+", "-", stem)


def kv_memory(ctx: int, batch: int = 16, shared_prefix: int = 0, dist: str = "uniform") -> tuple[int, int]:
    """Blocks held by the paged cache vs slots a contiguous max-length cache reserves, in tokens.

    uniform: lengths uniform in [ctx/16, ctx]; lognormal: median ctx/8 (sigma 1), capped at ctx,
    closer to chat traffic where most requests are far shorter than the window.
    """
    bm = BlockManager(1_000_000, 16)
    g = torch.Generator().manual_seed(ctx)
    if dist == "uniform":
        lengths = torch.randint(ctx // 16, ctx + 1, (batch,), generator=g).tolist()
    else:
        z = torch.randn(batch, generator=g)
        lengths = [max(shared_prefix + 1, min(ctx, int(ctx / 8 * float(torch.exp(x))))) for x in z]
    prefix = list(range(10**6, 10**6 + shared_prefix))
    held = 0
    reqs = []
    for i, n in enumerate(lengths):
        toks = prefix + [i * 100000 + j for j in range(max(1, n - len(prefix)))]
        r = Request(str(i), toks, SamplingParams())
        cached = bm.lookup_prefix(r)
        bm.allocate(r, r.num_tokens, cached)
        bm.cache_full_blocks(r, r.num_tokens)
        reqs.append(r)
    held = bm.num_used_blocks * 16
    return held, batch * ctx


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or a .gguf file")
    ap.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, no variants: a smoke run")
    ap.add_argument("--no-profile", action="store_true", help="skip the decode-step profile")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    model = args.model
    n_prompts, in_len, out_len = (16, 128, 32) if args.quick else (64, 128, 128)
    n_single = 2 if args.quick else 4
    ps = prompts(n_prompts, in_len)
    label = "SmolLM2-135M" if model.lower() == "smollm2" else Path(model).name

    print(f"# offline throughput: {n_prompts} prompts x {in_len} in / {out_len} out, {label}, greedy", flush=True)
    native = bench_sluice(model, ps, out_len)
    print(f"sluice LLM.generate ({served_as(native)}): {native['tok_s']:.1f} tok/s", flush=True)
    fp32 = bench_sluice(model, ps, out_len, quantization="none")
    print(f"sluice LLM.generate ({served_as(fp32)}): {fp32['tok_s']:.1f} tok/s", flush=True)
    hf = hf_model(model)
    hb_tps = bench_hf_batched(hf, ps, out_len)
    print(f"transformers batched: {hb_tps:.1f} tok/s", flush=True)
    hs_tps = bench_hf_single(hf, ps[:n_single], out_len)
    print(f"transformers one at a time ({n_single} prompts): {hs_tps:.1f} tok/s", flush=True)
    del hf
    gc.collect()
    rows, verdict = throughput_rows(native, fp32, hb_tps, hs_tps, n_single)

    variants: dict[str, float] = {}
    if not args.quick:
        dt_ps = ps[:16]
        for name, kw in [("native (default)", {}), ("quantization none, float32", {"quantization": "none"}),
                         ("quantization none, bfloat16", {"quantization": "none", "dtype": "bfloat16"}),
                         ("native, attention: torch (gather + SDPA)", {"attention_backend": "torch"}),
                         ("native, attention: cpu_paged (in-place kernel)", {"attention_backend": "cpu_paged"})]:
            variants[name] = bench_sluice(model, dt_ps, 32, **kw)["tok_s"]
            print(f"variant {name}: {variants[name]:.1f} tok/s", flush=True)

    profiles: list[dict[str, Any]] = []
    if not args.no_profile:
        from benchmarks._step_profile import profile_rows, step_profile

        profiles = [step_profile(model, b, ctx=in_len) for b in ((1, 4) if args.quick else (1, 32))]
    kv = {c: kv_memory(c) for c in (1024, 8192)}
    kv_ln = {c: kv_memory(c, dist="lognormal") for c in (1024, 8192)}
    kv_shared = kv_memory(8192, shared_prefix=4096)

    tput = markdown_table(["engine", "weights", "output tok/s", "vs transformers batched"], rows)
    kvt = markdown_table(
        ["context", "paged cache (tokens held)", "contiguous max-length (tokens reserved)", "saving"],
        [[f"{c}, 16 seqs, uniform lengths", kv[c][0], kv[c][1], f"{1 - kv[c][0] / kv[c][1]:.0%}"] for c in kv]
        + [[f"{c}, 16 seqs, log-normal lengths (median {c // 8})", kv_ln[c][0], kv_ln[c][1], f"{1 - kv_ln[c][0] / kv_ln[c][1]:.0%}"] for c in kv_ln]
        + [["8192, 4096-token shared prefix", kv_shared[0], kv_shared[1], f"{1 - kv_shared[0] / kv_shared[1]:.0%}"]],
    )
    parts = [
        "## Offline throughput (`benchmarks/offline_throughput.py`)",
        machine_line(),
        f"{n_prompts} prompts of {in_len} tokens, {out_len} output tokens each, greedy, ignore_eos; {label}"
        + (" (a `--quick` smoke run)" if args.quick else "") + ".",
        tput,
        f"**Target** {verdict['target']}: {verdict['ratio']:.2f}x, **{verdict['status']}**.",
    ]
    if variants:
        parts += ["### Weight path, dtype and attention backend",
                  markdown_table(["variant (16 prompts, 32 out)", "output tok/s"], [[k, v] for k, v in variants.items()])]
    if profiles:
        p0 = profiles[0]
        parts += [f"### Where one decode step goes ({p0['quantization']}, kernels {p0['kernel_path'] or '-'}, "
                  f"{p0['threads']} threads, {in_len}-token contexts)",
                  markdown_table(*profile_rows(profiles))]
    parts += ["### KV cache memory: paged vs contiguous", kvt]
    body = "\n\n".join(parts)
    print(body)
    if not args.no_write:
        write_section(section_name(model), body)
    print_json_last({
        "bench": "offline_throughput", "model": model, "machine": machine_line(),
        "sluice_tok_s": native["tok_s"], "sluice_quantization": native["quantization"],
        "sluice_kernel_path": native["kernel_path"], "sluice_fp32_tok_s": fp32["tok_s"],
        "hf_batched_tok_s": hb_tps, "hf_single_tok_s": hs_tps,
        "ratio_vs_batched": verdict["ratio"], "target_vs_batched": verdict["status"],
        "ratio_vs_single": native["tok_s"] / hs_tps, "variants_tok_s": variants,
        "step_profile": profiles,
        "kv_saving_8k_uniform": 1 - kv[8192][0] / kv[8192][1],
        "kv_saving_8k_lognormal": 1 - kv_ln[8192][0] / kv_ln[8192][1],
    })


if __name__ == "__main__":
    main()
