"""The KV memory a model with interleaved sliding layers gets back (NOTE(hybrid-blocks)).

    python benchmarks/hybrid_kv.py                                   # the gemma3-1b shape, 256 MiB of KV
    python benchmarks/hybrid_kv.py --model .peers/llama1b/gemma3-1b-q4_0.gguf --kv-mib 256 --max-num-seqs 4

Two arms on one KV budget, in-process ``EngineCore``, greedy: ``hybrid`` (as served: the sliding layers
in a pool of their own, freed out of the window) and ``one pool`` (every layer's K/V in one block, none
freed: the engine before this change; the arm patches ``ModelRunner._window_layers`` to give no layer a
pool of its own).  For each: the blocks of each pool, the context tokens the global layers can hold, and a
run of ``--requests`` long prompts at once: wall time, output tok/s, preemptions, the most sequences
running at once, and whether both arms' tokens are the same.  Also the default flags' split (128 slots,
the default KV budget: 5% of free memory), which the sizing rule leaves as one pool's.  Writes section
``hybrid_kv`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
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
    from sluice.engine.hybrid_blocks import HybridBlockManager

    bm, runner = core.block_manager, core.runner
    cfg = runner.model_config
    out = {"global_blocks": bm.num_blocks, "window_blocks": 0, "kv_mib": runner.kv_cache.num_bytes / 2**20,
           "layers": cfg.num_layers, "sliding_layers": len(runner.window_layers), "window": cfg.sliding_window}  # fmt: skip
    if isinstance(bm, HybridBlockManager):
        out["window_blocks"] = bm.win.num_blocks
    out["context_tokens"] = out["global_blocks"] * bm.block_size
    return out


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


def default_split(model: str) -> dict[str, Any]:
    """The split with default flags (128 slots, the default KV budget), engine built, nothing run."""
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore

    return pools(EngineCore(EngineConfig(model=model)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model}: no such file (python benchmarks/make_llama1b_gguf.py --shape gemma3-1b --types q4_0)")
    prompts = _prompts(args.requests, args.prompt_tokens, seed=3)
    arms = [run_arm(args.model, arm, args.kv_mib << 20, args.max_num_seqs, prompts, args.max_tokens)
            for arm in ("one pool", "hybrid")]  # fmt: skip
    same = arms[0]["tokens"] == arms[1]["tokens"]
    dflt = default_split(args.model)
    rows = [[a["arm"], f"{a['global_blocks']} / {a['window_blocks'] or '-'}", f"{a['kv_mib']:.0f}", f"{a['context_tokens']:,}",
             f"{a['wall_s']:.1f}", f"{a['out_tok_s']:.1f}", a["preemptions"], a["most_running"]] for a in arms]  # fmt: skip
    head = ["KV layout", "blocks: global / sliding", "KV MiB", "context tokens held", "wall s", "out tok/s",
            "preemptions", "most running at once"]  # fmt: skip
    table = markdown_table(head, rows)
    one, hyb = arms
    gain = hyb["context_tokens"] / one["context_tokens"]
    body = (
        "## Sliding layers' own KV pool (`benchmarks/hybrid_kv.py`)\n\n"
        f"{machine_line()}\n\n"
        f"`python benchmarks/hybrid_kv.py --model {Path(args.model).name} --kv-mib {args.kv_mib} --max-num-seqs "
        f"{args.max_num_seqs}`: {one['layers']} layers, {one['sliding_layers'] or hyb['sliding_layers']} of them sliding "
        f"(window {hyb['window']}), {args.kv_mib} MiB of fp32 KV; {args.requests} prompts of {args.prompt_tokens} "
        f"token ids at once, {args.max_tokens} output tokens each, greedy, in-process. `one pool` is the engine "
        "before NOTE(hybrid-blocks) (every layer's K/V in one block, none freed); `hybrid` as served.\n\n"
        f"{table}\n\n"
        f"Same tokens in both arms: {'yes' if same else 'NO'}. The global layers hold {gain:.1f}x the context in the "
        f"same budget: {hyb['most_running']} sequences at once with {hyb['preemptions']} preemptions, against "
        f"{one['most_running']} with {one['preemptions']} (the wall time moves less: the prefill is most of it). With default flags (128 slots, 5% of free memory: {dflt['kv_mib']:.0f} MiB) the sliding "
        f"pool sized for every slot's window would not fit, so the split stays one pool's: "
        f"{dflt['global_blocks']} / {dflt['window_blocks']} blocks ({dflt['context_tokens']:,} context tokens).\n"
    )
    print(body)
    if not args.no_write:
        write_section("hybrid_kv", body)
    for a in arms:
        a.pop("tokens")
    print_json_last({"benchmark": "hybrid_kv", "args": vars(args), "arms": arms, "same_tokens": same, "default_split": dflt})


if __name__ == "__main__":
    main()
