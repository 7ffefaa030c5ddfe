"""KV tiers: TTFT cold / memory hit / disk hit / after a restart, throughput past memory, KV dtypes.

    python benchmarks/kv_tiers.py               # SmolLM2, 2k-token shared prefixes (quiet machine, ~15 min)
    python benchmarks/kv_tiers.py --quick       # 256-token prefixes, few requests (smoke, ~3 min on 2 cores)

Everything runs in-process on ``EngineCore`` (no HTTP), one request at a time
for TTFT so that nothing queues, greedy, ``max_tokens=1`` unless stated.

1. TTFT of a prefix + short question: cold (recompute), memory hit, disk hit
   (memory too small for the prefixes, which come back from disk), and after a
   restart (a new engine on the same --kv-disk-dir, after a graceful close).
2. Concurrency: 32 requests sharing one on-disk prefix, submitted together:
   blocks read from disk (once is right), each TTFT against one load alone.
3. Throughput of a workload whose prefixes do not fit in memory, with and
   without the disk tier; and a multi-turn chat replay (each turn's prompt is
   the previous prompt + answer + a new question) with memory for one chat.
4. Per KV dtype: tokens that fit in --kv-cache-memory, decode throughput.

Targets (issue 12): disk-hit TTFT <= 25% of cold; after a restart hit rate >=
95% and TTFT within 1.5x of a memory hit.  Prints tables, writes the
`kv_tiers` section of docs/benchmarks.md and docs/kv_tiers.png (not with
--quick / --no-write), prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def engine(model: str, kv_memory: int, disk: str | None, **kw: Any) -> Any:
    from sluice.engine.core import EngineCore

    return EngineCore(model=model, kv_cache_memory=kv_memory, kv_disk_dir=disk, max_num_batched_tokens=512,
                      max_model_len=8192, **kw)


def run(eng: Any, prompts: list[list[int]], max_tokens: int = 1) -> list[dict[str, Any]]:
    """Submit all prompts at once; per request: ttft (s), cached tokens, output tokens."""
    from sluice.engine.protocol import EngineRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    base = f"r{time.monotonic_ns()}-"
    res: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(request_id=f"{base}{i}", prompt_token_ids=p, sampling=params,
                                      arrival_time=time.monotonic()))
        res[f"{base}{i}"] = {"tokens": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            r = res[o.request_id]
            r["tokens"] += o.new_token_ids
            r["cached"] = o.num_cached_tokens
            if o.timings is not None and o.timings.first_token is not None:
                r["ttft"] = o.timings.first_token - o.timings.arrival
    return [res[f"{base}{i}"] for i in range(len(prompts))]


def one_by_one(eng: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [run(eng, [p])[0] for p in prompts]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ttft_section(model: str, prefix_len: int, num_prefixes: int, questions: int, kv_memory: int, disk: str) -> dict[str, Any]:
    prefixes = [_tokens(prefix_len, 1000 + i) for i in range(num_prefixes)]
    qs = [[_tokens(12, 5000 + 100 * i + j) for j in range(questions)] for i in range(num_prefixes)]
    first = [prefixes[i] + qs[i][0] for i in range(num_prefixes)]
    later = [prefixes[i] + qs[i][j] for j in range(1, questions) for i in range(num_prefixes)]
    out: dict[str, Any] = {}
    # cold and memory hit: memory holds every prefix; the disk tier is on (it is written through)
    eng = engine(model, kv_memory, disk)
    out["bytes_per_block"] = eng.runner.kv_cache.bytes_per_block
    cold = one_by_one(eng, first)
    mem = one_by_one(eng, [prefixes[i] + qs[i][1 % questions] for i in range(num_prefixes)])
    out["cold"] = [r["ttft"] for r in cold]
    out["memory_hit"] = [r["ttft"] for r in mem]
    eng.close()
    # after a restart: a new engine on the same directory, memory empty
    eng = engine(model, kv_memory, disk)
    t0 = time.monotonic()
    restart = one_by_one(eng, later)
    out["restart_seconds"] = time.monotonic() - t0
    out["after_restart"] = [r["ttft"] for r in restart]
    out["restart_hit_rate"] = sum(r["cached"] for r in restart) / sum(len(p) for p in later)
    out["restart_prefix_hit_rate"] = sum(min(r["cached"], prefix_len) for r in restart) / (prefix_len * len(later))
    eng.close()
    # disk hit: memory holds about one prefix, so each prefix comes back from disk
    eng = engine(model, out["bytes_per_block"] * (prefix_len // 16 + 16), disk)
    disk_hit = one_by_one(eng, later)
    out["disk_hit"] = [r["ttft"] for r in disk_hit]
    out["disk_hit_rate"] = sum(min(r["cached"], prefix_len) for r in disk_hit) / (prefix_len * len(later))
    eng.close()
    return out


def concurrency_section(model: str, prefix_len: int, kv_memory: int, disk: str, n: int = 32) -> dict[str, Any]:
    prefix = _tokens(prefix_len, 777)
    eng = engine(model, kv_memory, disk)
    run(eng, [prefix + [5, 6, 7]])
    eng.close()  # checkpoint: the prefix is on disk
    eng = engine(model, kv_memory, disk)
    alone = run(eng, [prefix + [8, 9, 10]])[0]["ttft"]
    eng.close()
    eng = engine(model, kv_memory, disk, max_num_seqs=max(64, n))
    reads0 = eng.make_stats()
    res = run(eng, [prefix + _tokens(8, 9000 + i) for i in range(n)])
    stats = eng.make_stats()
    disk_stats = next(t for t in stats.kv_tiers if t.name == "disk")
    prev = next(t for t in reads0.kv_tiers if t.name == "disk")
    eng.close()
    ttfts = [r["ttft"] for r in res]
    return {"n": n, "alone_ttft": alone, "ttft_p50": pct(ttfts, 0.5), "ttft_max": max(ttfts),
            "blocks_read": disk_stats.num_block_reads - prev.num_block_reads, "prefix_blocks": prefix_len // 16}


def throughput_section(model: str, prefix_len: int, num_prefixes: int, rounds: int, kv_memory_small: int,
                       disk_root: str) -> dict[str, Any]:
    prefixes = [_tokens(prefix_len, 3000 + i) for i in range(num_prefixes)]
    work = [prefixes[i] + _tokens(16, 4000 + 10 * r + i) for r in range(rounds) for i in range(num_prefixes)]
    out = {}
    for label, disk in (("no disk tier", None), ("disk tier", tempfile.mkdtemp(dir=disk_root))):
        eng = engine(model, kv_memory_small, disk)
        t0 = time.monotonic()
        res = one_by_one(eng, work)
        dt = time.monotonic() - t0
        eng.close(checkpoint=False)
        out[label] = {"seconds": dt, "requests_per_s": len(work) / dt,
                      "prompt_tokens_per_s": sum(len(p) for p in work) / dt,
                      "hit_rate": sum(r["cached"] for r in res) / sum(len(p) for p in work)}
    # multi-turn replay: 3 chats x 4 turns; memory holds about one chat
    chats = [_tokens(prefix_len // 2, 6000 + c) for c in range(3)]
    for label, disk in (("chat, no disk tier", None), ("chat, disk tier", tempfile.mkdtemp(dir=disk_root))):
        eng = engine(model, kv_memory_small, disk)
        hist = [list(c) for c in chats]
        t0, hits, total = time.monotonic(), 0, 0
        for turn in range(4):
            for c in range(3):
                r = run(eng, [hist[c] + _tokens(20, 7000 + 10 * turn + c)], max_tokens=16)[0]
                hits += r["cached"]
                total += len(hist[c]) + 20
                hist[c] += _tokens(20, 7000 + 10 * turn + c) + r["tokens"]
        out[label] = {"seconds": time.monotonic() - t0, "hit_rate": hits / total}
        eng.close(checkpoint=False)
    return out


def dtype_section(model: str, kv_memory: int, num_seqs: int = 16, out_tokens: int = 32) -> list[dict[str, Any]]:
    rows = []
    for kv in ("auto", "bf16", "fp8", "int8"):
        eng = engine(model, kv_memory, None, kv_cache_dtype=kv, max_num_seqs=32)
        capacity = eng.runner.num_blocks * 16
        ps = [_tokens(128, 8000 + i) for i in range(num_seqs)]
        t0 = time.monotonic()
        res = run(eng, ps, max_tokens=out_tokens)
        dt = time.monotonic() - t0
        rows.append({"kv_dtype": eng.runner.kv_format.name if kv == "auto" else kv, "capacity_tokens": capacity,
                     "tokens_per_s": sum(len(r["tokens"]) for r in res) / dt})
        eng.close(checkpoint=False)
    return rows


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = res["ttft"]
    names = ["cold", "memory_hit", "disk_hit", "after_restart"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, [statistics.median(t[n]) * 1e3 for n in names], color=["#999", "#4a4", "#48c", "#c84"])
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(f"{res['prefix_len']}-token shared prefix + short question")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(res: dict[str, Any]) -> str:
    t = res["ttft"]
    cold = statistics.median(t["cold"])
    rows = []
    for n in ("cold", "memory_hit", "disk_hit", "after_restart"):
        p50 = statistics.median(t[n])
        rows.append([n.replace("_", " "), f"{p50 * 1e3:.0f}", f"{pct(t[n], 0.95) * 1e3:.0f}", f"{p50 / cold:.2f}"])
    c = res["concurrency"]
    tp = res["throughput"]
    lines = [
        "## KV tiers", "",
        f"`python benchmarks/kv_tiers.py` on {res['model']} ({machine_line()}); {res['prefix_len']}-token shared "
        f"prefixes + 12-token questions, one request at a time, `max_tokens=1`.", "",
        markdown_table(["TTFT", "p50 (ms)", "p95 (ms)", "p50 / cold"], rows), "",
        f"After the restart: hit rate {t['restart_hit_rate']:.3f} of all prompt tokens "
        f"({t['restart_prefix_hit_rate']:.3f} of the prefix tokens); disk-hit run: {t['disk_hit_rate']:.3f} of "
        f"the prefix tokens.  Targets: disk hit <= 0.25 x cold, after restart >= 0.95 hits and <= 1.5 x memory hit.", "",
        f"{c['n']} requests sharing one on-disk {res['prefix_len']}-token prefix, submitted together: "
        f"{c['blocks_read']} blocks read for {c['prefix_blocks']} prefix blocks; TTFT p50 "
        f"{c['ttft_p50'] * 1e3:.0f} ms, max {c['ttft_max'] * 1e3:.0f} ms (one request alone "
        f"{c['alone_ttft'] * 1e3:.0f} ms; the max includes the 32 prefills of the questions).", "",
        markdown_table(["workload (memory holds ~1 prefix)", "seconds", "hit rate"],
                       [[k, f"{v['seconds']:.1f}", f"{v['hit_rate']:.2f}"] for k, v in tp.items()]), "",
        markdown_table(["KV dtype", "tokens in 64 MiB", "decode tokens/s"],
                       [[r["kv_dtype"], f"{r['capacity_tokens']:,}", f"{r['tokens_per_s']:.1f}"] for r in res["dtypes"]]),
        "", "![KV tiers](kv_tiers.png)", "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    ap.add_argument("--disk-root", default=None, help="where the disk tiers go (default: a temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.prefix_len, a.prefixes, a.questions, a.no_write = 256, 3, 2, True
    root = a.disk_root or tempfile.mkdtemp(prefix="sluice-kv-bench-")
    res: dict[str, Any] = {"model": a.model, "prefix_len": a.prefix_len}
    res["ttft"] = ttft_section(a.model, a.prefix_len, a.prefixes, a.questions, a.kv_cache_memory,
                               tempfile.mkdtemp(dir=root))
    print("ttft", res["ttft"], flush=True)
    res["concurrency"] = concurrency_section(a.model, a.prefix_len, a.kv_cache_memory, tempfile.mkdtemp(dir=root),
                                             n=8 if a.quick else 32)
    print("concurrency", res["concurrency"], flush=True)
    small = res["ttft"]["bytes_per_block"] * (a.prefix_len // 16 + 16)  # about one prefix
    res["throughput"] = throughput_section(a.model, a.prefix_len, a.prefixes, 2 if a.quick else 3, small, root)
    print("throughput", res["throughput"], flush=True)
    res["dtypes"] = dtype_section(a.model, 64 << 20, *((4, 8) if a.quick else (16, 32)))
    text = report(res)
    print(text)
    if not a.no_write:
        write_section("kv_tiers", text)
        plot(res, ROOT / "docs" / "kv_tiers.png")
    print_json_last(res)


if __name__ == "__main__":
    main()
