"""The KV memory a model with interleaved sliding layers gets back (NOTE(hybrid-blocks)).

    python benchmarks/hybrid_kv.py                                   # the gemma3-1b shape, 256 MiB of KV
    python benchmarks/hybrid_kv.py --model .peers/llama1b/gemma3-1b-q4_0.gguf --kv-mib 256 --requests 4

Two arms on one KV budget, in-process ``EngineCore``, greedy: ``hybrid`` (as served: the sliding layers
read block tables of their own over the one pool, freed out of the window) and ``one pool`` (every layer's
K/V in one block, none freed: the engine before this change; the arm patches ``ModelRunner._window_layers``
to give no layer tables of their own).  For each: the blocks, the tokens one request can hold alone, and a run of
``--requests`` long prompts at once: wall time, output tok/s, preemptions, the most sequences running at
once, and whether both arms' tokens are the same.  Writes section ``hybrid_kv`` of docs/benchmarks.md.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="running sequences cap (the engine's default)")
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
    rows = [[a["arm"], f"{a['blocks']} x {a['layers_a_block']} layers", f"{a['kv_mib']:.0f}", f"{a['lone_request_tokens']:,}",
             f"{a['wall_s']:.1f}", f"{a['out_tok_s']:.1f}", a["preemptions"], a["most_running"]] for a in arms]  # fmt: skip
    head = ["KV layout", "blocks", "KV MiB", "tokens one request can hold", "wall s", "out tok/s", "preemptions",
            "most running at once"]  # fmt: skip
    table = markdown_table(head, rows)
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
        "moves less: the prefill is most of it).\n"
    )
    print(body)
    if not args.no_write:
        write_section("hybrid_kv", body)
    for a in arms:
        a.pop("tokens")
    print_json_last({"benchmark": "hybrid_kv", "args": vars(args), "arms": arms, "same_tokens": same})


if __name__ == "__main__":
    main()
