"""Offline throughput of the engine vs transformers, where a decode step's time goes, KV memory.

    python benchmarks/offline_throughput.py            # full run (~10 min on 2 cores)
    python benchmarks/offline_throughput.py --quick    # smaller, for a smoke check

Prints tables, writes the `offline_throughput` section of docs/benchmarks.md,
and prints one JSON line last.  Everything is measured side by side in one
run, on SmolLM2-135M (the embedded GGUF), greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from sluice.engine.block_manager import BlockManager  # noqa: E402
from sluice.engine.protocol import EngineRequest, SamplingParams  # noqa: E402
from sluice.engine.request import Request  # noqa: E402


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]


def hf_model():  # type: ignore[no-untyped-def]
    """transformers' LlamaForCausalLM with the same (dequantized) weights, built without a 40 s GGUF load."""
    import transformers

    from sluice.models.loader import (
        _gguf_reader,
        gguf_hf_config,
        load_gguf_state_dict,
        resolve_model,
    )

    src = resolve_model("smollm2")
    reader = _gguf_reader(src.path)
    cfg = gguf_hf_config(reader, src.path)
    sd = load_gguf_state_dict(reader, src.path, cfg)
    conf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    model = transformers.LlamaForCausalLM(conf).eval()
    model.load_state_dict(sd, strict=False)
    if conf.tie_word_embeddings:
        model.tie_weights()
    return model


def bench_sluice(ps: list[list[int]], out_len: int, **kw: object) -> tuple[float, float]:
    from sluice import LLM

    llm = LLM("smollm2", max_num_seqs=max(64, len(ps)), max_num_batched_tokens=2048, **kw)  # type: ignore[arg-type]
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(ps[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), progress=False)
    t = time.perf_counter()
    outs = llm.generate(ps, sp, progress=False)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    del llm
    gc.collect()
    return n / dt, dt


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


def step_breakdown(batch: int, ctx: int, steps: int = 8) -> dict[str, float]:
    """Time one decode step at `batch` sequences of `ctx` tokens, split by kind of op."""
    from torch.profiler import ProfilerActivity, profile

    from sluice import LLM

    llm = LLM("smollm2", max_num_seqs=batch, max_num_batched_tokens=4096, kv_cache_memory=1 << 30)
    eng = llm.engine
    for i, p in enumerate(prompts(batch, ctx, seed=5)):
        eng.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p,
                                      sampling=SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)))
    while any(not r.is_prefill_done for r in eng.requests.values()):
        eng.step()
    eng.step()
    t = time.perf_counter()
    for _ in range(steps // 2):
        eng.step()
    wall = (time.perf_counter() - t) / (steps // 2)
    # the C++ kernel is not a torch op, so the profiler does not see it: time the
    # attention backend's calls directly
    backend = eng.runner.attention
    attn_time = [0.0]
    inner = backend.__class__.__call__

    def timed(self, *a):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = inner(self, *a)
        attn_time[0] += time.perf_counter() - t0
        return out

    backend.__class__.__call__ = timed  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps // 2):
            eng.step()
    backend.__class__.__call__ = inner  # type: ignore[method-assign]
    cats = {"matmul": 0.0, "attention": attn_time[0] * 1e6, "sampling": 0.0, "other ops": 0.0}
    for ev in prof.key_averages():
        name, us = ev.key, ev.self_cpu_time_total
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"):
            cats["matmul"] += us
        elif "scaled_dot_product" in name or "index_copy" in name or name.startswith("aten::_scaled_dot"):
            pass  # inside the attention backend, timed above
        elif name in ("aten::argmax", "aten::topk", "aten::sort", "aten::exponential_", "aten::log_softmax", "aten::_log_softmax", "aten::softmax", "aten::_softmax"):
            cats["sampling"] += us
        elif name.startswith("aten::"):
            cats["other ops"] += us
    per_step = {k: v / 1e3 / (steps // 2) for k, v in cats.items()}  # ms
    # the same GEMM shapes as one step, as plain torch.mm (the roofline we can reach)
    cfg = eng.runner.model_config
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)] * cfg.num_layers + [(h, cfg.vocab_size)]
    ws = [torch.randn(k, n) for k, n in shapes]
    xs = {k: torch.randn(batch, k) for k, _ in shapes}
    for _ in range(2):
        for w in ws:
            torch.mm(xs[w.shape[0]], w)
    t = time.perf_counter()
    for _ in range(3):
        for w in ws:
            torch.mm(xs[w.shape[0]], w)
    mm_ms = (time.perf_counter() - t) / 3 * 1e3
    flops = 2 * batch * sum(k * n for k, n in shapes)
    accounted = sum(per_step.values())
    per_step["python + glue"] = max(0.0, wall * 1e3 - accounted)
    per_step["step"] = wall * 1e3
    per_step["plain torch.mm of the same GEMMs"] = mm_ms
    per_step["GEMM GFLOP/s (torch.mm)"] = flops / (mm_ms / 1e3) / 1e9
    del llm, eng
    gc.collect()
    return per_step


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    n_prompts, in_len, out_len = (16, 128, 32) if args.quick else (64, 128, 128)
    n_single = 2 if args.quick else 4
    ps = prompts(n_prompts, in_len)

    print(f"# offline throughput: {n_prompts} prompts x {in_len} in / {out_len} out, SmolLM2-135M, greedy", flush=True)
    s_tps, s_dt = bench_sluice(ps, out_len)
    print(f"sluice LLM.generate: {s_tps:.1f} tok/s ({s_dt:.1f} s)", flush=True)
    hf = hf_model()
    hb_tps = bench_hf_batched(hf, ps, out_len)
    print(f"transformers batched: {hb_tps:.1f} tok/s", flush=True)
    hs_tps = bench_hf_single(hf, ps[:n_single], out_len)
    print(f"transformers one at a time ({n_single} prompts): {hs_tps:.1f} tok/s", flush=True)
    del hf
    gc.collect()

    dt_ps = ps[:16]
    f32, _ = bench_sluice(dt_ps, 32, dtype="float32")
    bf16, _ = bench_sluice(dt_ps, 32, dtype="bfloat16")
    att_torch, _ = bench_sluice(dt_ps, 32, attention_backend="torch")
    att_paged, _ = bench_sluice(dt_ps, 32, attention_backend="cpu_paged")
    print(f"dtype fp32 {f32:.1f} vs bf16 {bf16:.1f}; attention torch {att_torch:.1f} vs cpu_paged {att_paged:.1f}", flush=True)

    b1 = step_breakdown(1, in_len)
    b32 = step_breakdown(32, in_len)
    kv = {c: kv_memory(c) for c in (1024, 8192)}
    kv_ln = {c: kv_memory(c, dist="lognormal") for c in (1024, 8192)}
    kv_shared = kv_memory(8192, shared_prefix=4096)

    tput = markdown_table(
        ["engine", "output tok/s", "sluice ratio"],
        [
            ["sluice LLM.generate (continuous batching)", s_tps, 1.0],
            ["transformers generate, batched", hb_tps, s_tps / hb_tps],
            [f"transformers generate, one at a time ({n_single} prompts)", hs_tps, s_tps / hs_tps],
        ],
    )
    variants = markdown_table(
        ["variant (16 prompts, 32 out)", "output tok/s"],
        [["float32", f32], ["bfloat16", bf16], ["attention: torch (gather + SDPA)", att_torch], ["attention: cpu_paged (in-place kernel)", att_paged]],
    )
    keys = list(b1.keys())
    brk = markdown_table(["decode step (ms unless noted)", "batch 1", "batch 32"], [[k, b1[k], b32[k]] for k in keys])
    kvt = markdown_table(
        ["context", "paged cache (tokens held)", "contiguous max-length (tokens reserved)", "saving"],
        [[f"{c}, 16 seqs, uniform lengths", kv[c][0], kv[c][1], f"{1 - kv[c][0] / kv[c][1]:.0%}"] for c in kv]
        + [[f"{c}, 16 seqs, log-normal lengths (median {c // 8})", kv_ln[c][0], kv_ln[c][1], f"{1 - kv_ln[c][0] / kv_ln[c][1]:.0%}"] for c in kv_ln]
        + [["8192, 4096-token shared prefix", kv_shared[0], kv_shared[1], f"{1 - kv_shared[0] / kv_shared[1]:.0%}"]],
    )
    body = "\n\n".join([
        "## Offline throughput (`benchmarks/offline_throughput.py`)",
        machine_line(),
        f"{n_prompts} prompts of {in_len} tokens, {out_len} output tokens each, greedy, ignore_eos; SmolLM2-135M (GGUF Q4_1 dequantized to fp32).",
        tput,
        "### dtype and attention backend",
        variants,
        "### Where one decode step goes",
        brk,
        "### KV cache memory: paged vs contiguous",
        kvt,
    ])
    print(body)
    if not args.no_write:
        write_section("offline_throughput", body)
    print_json_last({
        "bench": "offline_throughput", "sluice_tok_s": s_tps, "hf_batched_tok_s": hb_tps, "hf_single_tok_s": hs_tps,
        "ratio_vs_batched": s_tps / hb_tps, "ratio_vs_single": s_tps / hs_tps, "fp32_tok_s": f32, "bf16_tok_s": bf16,
        "attn_torch_tok_s": att_torch, "attn_cpu_paged_tok_s": att_paged, "step_ms_b1": b1["step"], "step_ms_b32": b32["step"],
        "kv_saving_8k_uniform": 1 - kv[8192][0] / kv[8192][1],
        "kv_saving_8k_lognormal": 1 - kv_ln[8192][0] / kv_ln[8192][1],
    })


if __name__ == "__main__":
    main()
