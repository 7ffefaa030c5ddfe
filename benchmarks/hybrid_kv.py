"""The KV memory a model with interleaved sliding layers gets back (NOTE(hybrid-blocks)).

    python benchmarks/hybrid_kv.py                                   # the gemma3-1b shape, 256 MiB of KV
    python benchmarks/hybrid_kv.py --model .peers/llama1b/gemma3-1b-q4_0.gguf --kv-mib 256 --requests 4

Two arms on one KV budget, in-process ``EngineCore``, greedy: ``hybrid`` (as served: the sliding layers
read block tables of their own over the one pool, freed out of the window) and ``one pool`` (every layer's
K/V in one block, none freed: the engine before this change; the arm patches ``ModelRunner._window_layers``
to give no layer tables of their own).  For each: the blocks, the tokens one request can hold alone, and a run of
``--requests`` long prompts at once: wall time, output tok/s, preemptions, the most sequences running at
once, and whether both arms' tokens are the same.  Then the model's layers with options attended by the
kernel or by the torch path, per prompt length: prefill and decode step.  Writes section ``hybrid_kv`` of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from benchmarks._step_profile import _prompts  # noqa: E402

DEFAULT_MODEL = ROOT / ".peers" / "llama1b" / "gemma3-1b-q4_0.gguf"


@contextlib.contextmanager
def one_pool() -> Iterator[None]:
    from sluice.engine.model_runner import ModelRunner

    orig = ModelRunner._window_layers
    ModelRunner._window_layers = lambda self: []  # type: ignore[method-assign]
    try:
        yield
    finally:
        ModelRunner._window_layers = orig  # type: ignore[method-assign]


def pools(core: Any) -> dict[str, Any]:
    bm, runner = core.block_manager, core.runner
    cfg, kv = runner.model_config, runner.kv_cache
    return {"blocks": bm.num_blocks, "layers_a_block": max(kv.layer_slots) + 1, "kv_mib": kv.num_bytes / 2**20,
            "layers": cfg.num_layers, "sliding_layers": len(runner.window_layers), "window": cfg.sliding_window,
            "lone_request_tokens": core.model_info.num_blocks * bm.block_size}  # fmt: skip


def run_arm(model: str, arm: str, kv_bytes: int, max_num_seqs: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    with one_pool() if arm == "one pool" else contextlib.nullcontext():
        core = EngineCore(EngineConfig(model=model, kv_cache_memory=kv_bytes, max_num_seqs=max_num_seqs))
    res: dict[str, Any] = {"arm": arm, **pools(core)}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=sp, arrival_time=time.monotonic()))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    most_running = 0
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.request_id].extend(o.new_token_ids)
        most_running = max(most_running, len(core.scheduler.running))
    wall = time.perf_counter() - t0
    res.update(wall_s=wall, out_tok_s=sum(map(len, tokens.values())) / wall, preemptions=core.scheduler.num_preemptions,
               most_running=most_running, tokens=tokens)  # fmt: skip
    del core
    return res


def attention_ab(model: str, prompt_lens: list[int], rounds: int = 2, kv_bytes: int = 512 << 20) -> list[dict[str, Any]]:
    """Gemma's layers with options (window, soft-capping, own scale) attended by the kernel (``attend_ext``,
    NOTE(window-keys)) or by the torch path models/attention.py takes without it (the arm sets the backend's
    ``attend_ext`` to None), alternating on one engine, no prefix cache: one prompt's prefill and its decode
    steps (median), best round of each."""
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    core = EngineCore(EngineConfig(model=model, kv_cache_memory=kv_bytes, enable_prefix_caching=False))
    att = core.runner.attention
    sp = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    out = []
    for n in prompt_lens:
        best: dict[str, list[float]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(rounds):
            prompt = _prompts(1, n, seed=100 + r)[0]
            for arm in ("torch", "kernel"):
                if arm == "torch":
                    att.attend_ext = None  # type: ignore[assignment,method-assign]
                else:
                    att.__dict__.pop("attend_ext", None)
                core.add_request(EngineRequest(request_id=f"{arm}-{n}-{r}", prompt_token_ids=prompt, sampling=sp,
                                               arrival_time=time.monotonic()))  # fmt: skip
                t0, first, steps, toks = time.perf_counter(), 0.0, [], []
                while core.has_unfinished_requests():
                    t = time.perf_counter()
                    outs = core.step()
                    if first and toks:
                        steps.append(time.perf_counter() - t)
                    for o in outs:
                        toks.extend(o.new_token_ids)
                    if not first and toks:
                        first = time.perf_counter() - t0
                b = best.setdefault(arm, [float("inf"), float("inf")])
                b[0], b[1] = min(b[0], first), min(b[1], statistics.median(steps))
                tokens.setdefault(arm, []).append(toks)
        att.__dict__.pop("attend_ext", None)
        for arm in ("torch", "kernel"):
            out.append({"prompt": n, "arm": arm, "prefill_s": best[arm][0], "decode_ms": 1e3 * best[arm][1],
                        "same_tokens": tokens["torch"] == tokens["kernel"]})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="running sequences cap (the engine's default)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--attention-prompts", default="512,3000", help="prompt lengths of the kernel/torch attention arms")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model}: no such file (python benchmarks/make_llama1b_gguf.py --shape gemma3-1b --types q4_0)")
    prompts = _prompts(args.requests, args.prompt_tokens, seed=3)
    arms = [run_arm(args.model, arm, args.kv_mib << 20, args.max_num_seqs, prompts, args.max_tokens)
            for arm in ("one pool", "hybrid")]  # fmt: skip
    same = arms[0]["tokens"] == arms[1]["tokens"]
    rows = [[a["arm"], f"{a['blocks']} x {a['layers_a_block']} layers", f"{a['kv_mib']:.0f}", f"{a['lone_request_tokens']:,}",
             f"{a['wall_s']:.1f}", f"{a['out_tok_s']:.1f}", a["preemptions"], a["most_running"]] for a in arms]  # fmt: skip
    head = ["KV layout", "blocks", "KV MiB", "tokens one request can hold", "wall s", "out tok/s", "preemptions",
            "most running at once"]  # fmt: skip
    table = markdown_table(head, rows)
    att = attention_ab(args.model, [int(x) for x in args.attention_prompts.split(",")])
    by = {(a["prompt"], a["arm"]): a for a in att}
    att_table = markdown_table(["prompt tokens", "prefill s: torch / kernel", "decode step ms: torch / kernel",
                                "same greedy tokens"],
                               [[n, f"{by[n, 'torch']['prefill_s']:.2f} / {by[n, 'kernel']['prefill_s']:.2f}",
                                 f"{by[n, 'torch']['decode_ms']:.1f} / {by[n, 'kernel']['decode_ms']:.1f}",
                                 "yes" if by[n, "kernel"]["same_tokens"] else "NO"]
                                for n in dict.fromkeys(a["prompt"] for a in att)])  # fmt: skip
    one, hyb = arms
    body = (
        "## Sliding layers' own block tables (`benchmarks/hybrid_kv.py`)\n\n"
        f"{machine_line()}\n\n"
        f"`python benchmarks/hybrid_kv.py --model {Path(args.model).name} --kv-mib {args.kv_mib} --max-num-seqs "
        f"{args.max_num_seqs}`: {one['layers']} layers, {hyb['sliding_layers']} of them sliding (window "
        f"{hyb['window']}), {args.kv_mib} MiB of fp32 KV; {args.requests} prompts of {args.prompt_tokens} token ids at "
        f"once, {args.max_tokens} output tokens each, greedy, in-process. `one pool`: the engine before "
        "NOTE(hybrid-blocks), a block of every layer, none freed; `hybrid`: as served, a block of "
        f"{hyb['layers_a_block']} layers, the sliding layers' tables freed out of the window.\n\n"
        f"{table}\n\n"
        f"Same tokens in both arms: {'yes' if same else 'NO'}. {hyb['most_running']} sequences ran at once with "
        f"{hyb['preemptions']} preemptions, against {one['most_running']} with {one['preemptions']} (the wall time "
        "moves less: the prefill is most of it). The same model's layers with options (sliding window, its own scale) attended in the `cpu_paged` kernel "
        "(NOTE(window-keys)) or by the torch path used before it, alternating on one engine, one prompt at a "
        "time, best of 2 rounds:\n\n"
        f"{att_table}\n"
    )
    print(body)
    if not args.no_write:
        write_section("hybrid_kv", body)
    for a in arms:
        a.pop("tokens")
    print_json_last({"benchmark": "hybrid_kv", "args": vars(args), "arms": arms, "same_tokens": same, "attention": att})


if __name__ == "__main__":
    main()
