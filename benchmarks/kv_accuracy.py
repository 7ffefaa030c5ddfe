"""Accuracy of a quantized KV cache against the full-precision cache of the same model.

    python benchmarks/kv_accuracy.py                    # SmolLM2: 512, 2k, 8k tokens; fp8, int8, bf16
    python benchmarks/kv_accuracy.py --quick            # 512 tokens, 2 prompts x 16 tokens (smoke)
    python benchmarks/kv_accuracy.py --model DIR --lengths 64 --no-write

For each KV dtype, over one text of each length (teacher forcing, prefilled
in chunks of 512 so that every chunk after the first reads the cache):

- perplexity, and its change against the reference cache (`--kv-cache-dtype auto`);
- next-token KL(reference || quantized), mean and p99 over positions;
- top-1 agreement of the next-token argmax, position by position;
- free-running greedy agreement: prompts continued for `--gen-tokens` tokens,
  the share of positions with the same token and the mean position of the
  first difference (one flipped near-tie makes the rest of a sequence differ);
- capacity: tokens of this model that fit in `--kv-cache-memory`.

Targets (issue 12): fp8 perplexity within 1%; greedy agreement >= 95% over 64
tokens.  The text is English read from the machine (GPL/GFDL/Apache licence
texts, vim's manual), else this repository's docs.  Prints a table, writes the
`kv_accuracy` section of docs/benchmarks.md (not with --quick / --no-write), and
prints one JSON line last.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

CHUNK = 512
TEXT_SOURCES = [
    "/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3", "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/vim/vim90/doc/usr_01.txt", "/usr/share/vim/vim90/doc/usr_02.txt", "/usr/share/vim/vim90/doc/usr_03.txt",
    "/usr/share/vim/vim90/doc/usr_04.txt", "/usr/share/vim/vim90/doc/usr_05.txt",
]


def corpus() -> str:
    parts = [Path(p).read_text(errors="ignore") for p in TEXT_SOURCES if Path(p).is_file()]
    if sum(len(p) for p in parts) < 60_000:
        root = Path(__file__).resolve().parent.parent
        parts += [p.read_text() for p in sorted((root / "docs").glob("*.md"))] + [(root / "README.md").read_text()]
    return "\n\n".join(parts)


def make_engine(model: str, kv_dtype: str, max_len: int, kv_memory: int) -> Any:
    from sluice.engine.core import EngineCore

    return EngineCore(model=model, kv_cache_dtype=kv_dtype, kv_cache_memory=kv_memory,
                      max_model_len=max(max_len + 1, 1024), max_num_batched_tokens=CHUNK)


class TeacherForced:
    """Feeds one token sequence through an engine's model in chunks; yields (chunk log-probs)."""

    def __init__(self, engine: Any, token_ids: list[int]):
        from sluice.engine.protocol import SamplingParams
        from sluice.engine.request import Request

        self.engine, self.ids = engine, token_ids
        self.req = Request("eval", token_ids, SamplingParams(max_tokens=1))
        if not engine.block_manager.allocate(self.req, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit this engine's KV cache (raise --kv-cache-memory)")

    @torch.inference_mode()
    def chunks(self) -> Any:
        from sluice.engine.scheduler import ScheduledRequest, SchedulerOutput

        runner = self.engine.runner
        for start in range(0, len(self.ids), CHUNK):
            n = min(CHUNK, len(self.ids) - start)
            self.req.num_computed_tokens = start
            ids, pos, meta, _ = runner.build_metadata(SchedulerOutput(scheduled=[ScheduledRequest(self.req, n)]))
            runner.attention.set_metadata(meta)
            hidden = runner.model(ids, pos, runner.attention)
            yield runner.model.compute_logits(hidden).float().log_softmax(-1)  # (n, vocab)

    def close(self) -> None:
        self.engine.block_manager.free_request(self.req)


def compare_teacher_forced(ref: Any, quant: Any, ids: list[int]) -> dict[str, float]:
    a, b = TeacherForced(ref, ids), TeacherForced(quant, ids)
    nll_ref = nll_q = 0.0
    kls: list[torch.Tensor] = []
    agree = 0
    pos = 0
    for lp_r, lp_q in zip(a.chunks(), b.chunks()):
        n = lp_r.shape[0]
        tgt = torch.tensor(ids[pos + 1 : pos + n + 1])
        m = len(tgt)  # the last position has no target
        nll_ref -= float(lp_r[:m].gather(1, tgt.view(-1, 1)).sum())
        nll_q -= float(lp_q[:m].gather(1, tgt.view(-1, 1)).sum())
        kls.append((lp_r.exp() * (lp_r - lp_q)).sum(-1))
        agree += int((lp_r.argmax(-1) == lp_q.argmax(-1)).sum())
        pos += n
    a.close()
    b.close()
    kl = torch.cat(kls)
    count = len(ids) - 1
    ppl_ref, ppl_q = math.exp(nll_ref / count), math.exp(nll_q / count)
    return {
        "ppl_ref": ppl_ref, "ppl": ppl_q, "ppl_change": ppl_q / ppl_ref - 1,
        "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)), "top1_agree": agree / len(ids),
    }


def greedy(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from sluice.engine.protocol import EngineRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"g{i}", prompt_token_ids=p, sampling=params))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(prompts))]


def run(model: str, kv_dtypes: list[str], lengths: list[int], num_prompts: int, gen_tokens: int,
        kv_memory: int, capacity_memory: int, token_ids: list[int]) -> dict[str, Any]:
    max_len = max(lengths)
    if len(token_ids) < max_len + 1:
        reps = -(-(max_len + 1) // len(token_ids))
        token_ids = (token_ids * reps)[: max_len + 1]
    prompts = [token_ids[i * 256 : i * 256 + 128] for i in range(num_prompts)]
    ref = make_engine(model, "auto", max_len, kv_memory)
    ref_greedy = greedy(ref, prompts, gen_tokens)
    cfg = ref.runner.model_config
    results: dict[str, Any] = {"model": model, "reference": ref.runner.kv_format.name, "rows": []}
    for kv in kv_dtypes:
        eng = make_engine(model, kv, max_len, kv_memory)
        row: dict[str, Any] = {"kv_dtype": kv}
        for length in lengths:
            t0 = time.monotonic()
            row[str(length)] = compare_teacher_forced(ref, eng, token_ids[:length])
            row[str(length)]["seconds"] = time.monotonic() - t0
            print(f"  {kv} {length}: {row[str(length)]}", flush=True)
        got = greedy(eng, prompts, gen_tokens)
        same = sum(a == b for r, g in zip(ref_greedy, got) for a, b in zip(r, g))
        first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), gen_tokens) for r, g in zip(ref_greedy, got)]
        row["greedy_agree"] = same / (gen_tokens * len(prompts))
        row["greedy_first_diff_mean"] = sum(first) / len(first)
        fmt = eng.runner.kv_format
        row["capacity_tokens"] = fmt.num_blocks(capacity_memory, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) * 16
        results["rows"].append(row)
        del eng
    ref_fmt = ref.runner.kv_format
    results["reference_capacity_tokens"] = ref_fmt.num_blocks(capacity_memory, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) * 16
    return results


def report(res: dict[str, Any], lengths: list[int], gen_tokens: int, num_prompts: int, capacity_memory: int) -> str:
    headers = ["KV dtype", *[f"ppl change @{n}" for n in lengths], *[f"KL mean @{n}" for n in lengths],
               f"top-1 agree @{lengths[-1]}", f"greedy agree ({num_prompts}x{gen_tokens})", "first diff (mean pos)",
               f"tokens in {capacity_memory / 2**30:g} GiB"]
    rows = [[f"{res['reference']} (reference)", *["0"] * len(lengths), *["0"] * len(lengths), "1", "1", str(gen_tokens),
             f"{res['reference_capacity_tokens']:,}"]]
    for r in res["rows"]:
        rows.append([r["kv_dtype"], *[f"{r[str(n)]['ppl_change'] * 100:+.2f}%" for n in lengths],
                     *[f"{r[str(n)]['kl_mean']:.4f}" for n in lengths], f"{r[str(lengths[-1])]['top1_agree']:.3f}",
                     f"{r['greedy_agree']:.3f}", f"{r['greedy_first_diff_mean']:.1f}", f"{r['capacity_tokens']:,}"])
    ppl = ", ".join(f"{n}: {res['rows'][0][str(n)]['ppl_ref']:.2f}" for n in lengths) if res["rows"] else ""
    return "\n".join([
        "## KV cache dtype: accuracy and capacity", "",
        f"`python benchmarks/kv_accuracy.py` on {res['model']} ({machine_line()}). Teacher-forced over one English "
        f"text per length (reference perplexity {ppl}); greedy over {num_prompts} prompts of 128 tokens.", "",
        markdown_table(headers, rows), "",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-dtypes", default="fp8,int8,bf16")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine (must hold the longest text)")
    ap.add_argument("--capacity-memory", type=int, default=1 << 30, help="budget for the capacity column")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 2 prompts x 16 tokens; no docs update")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.prompts, a.gen_tokens, a.no_write = "512", 2, 16, True
    lengths = [int(x) for x in a.lengths.split(",")]
    from sluice.models.tokenizer import load_tokenizer

    tok = load_tokenizer(a.model)
    ids = list(tok.encode(corpus()))
    res = run(a.model, a.kv_dtypes.split(","), lengths, a.prompts, a.gen_tokens, a.kv_cache_memory,
              a.capacity_memory, ids)
    text = report(res, lengths, a.gen_tokens, a.prompts, a.capacity_memory)
    print(text)
    if not a.no_write:
        write_section("kv_accuracy", text)
    print_json_last(res)


if __name__ == "__main__":
    main()
