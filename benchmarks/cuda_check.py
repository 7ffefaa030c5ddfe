"""The engine on a CUDA device: logits and greedy tokens against transformers, and the TTFT prediction in real time.

    python benchmarks/cuda_check.py                  # needs a CUDA device; ~1 minute
    python benchmarks/cuda_check.py --device cpu     # the same checks on the CPU (a smoke run of the script)

A check, not a speed benchmark.  Tiny random Llama- and Qwen2-shaped models
(``tests/model_factory.py``), fp32, the ``torch`` attention backend (the
paged-attention kernel is a CPU kernel):

1. ``tests/engine/test_correctness.py``'s protocol on the device: 8 prompts of
   5-100 tokens, a 64-token budget (chunked prefill), 17 greedy tokens each; the
   engine's logits at every step against transformers' full recomputation on
   the same device, and the tokens.
2. ``benchmarks/prediction_error.py``'s protocol (``measure``) on the device in
   real time: the admission's TTFT prediction against the TTFT each request got.

Prints a table and one JSON line last; ``--write`` puts the table in section
``cuda_check`` of docs/benchmarks.md (run it where the docs are).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _report import DOC, markdown_table, print_json_last, write_section  # noqa: E402

ENGINE_DOC = DOC.parent / "engine.md"  # the CUDA check is written beside the engine's docs
from prediction_error import BUDGET, SLOTS, measure  # noqa: E402

from sluice.engine.core import EngineCore  # noqa: E402
from sluice.engine.protocol import EngineRequest, SamplingParams  # noqa: E402
from tests.model_factory import make_tiny_model_dir  # noqa: E402

PROMPT_LENS = [5, 16, 17, 31, 33, 48, 70, 100]  # cross block boundaries; 70 and 100 exceed the 64-token budget
DECODE_STEPS = 16
LOGIT_TOL = 1e-3  # fp32 on one device: the engine's paged attention and fused ops against transformers' eager path


def make_prompts(vocab: int) -> list[list[int]]:
    """The correctness protocol's prompts (``tests/engine/test_correctness.py`` uses them too)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_reference(model_dir: Path, prompts: list[list[int]],
                 device: str = "cpu") -> tuple[list[list[torch.Tensor]], list[list[int]]]:  # fmt: skip
    """Greedy continuation by full recomputation with transformers on ``device``: each step's logits (on the
    CPU) and the tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    all_logits, all_tokens = [], []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            steps, toks = [], []
            for _ in range(DECODE_STEPS + 1):
                logits = hf(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
                steps.append(logits)
                toks.append(int(logits.argmax()))
                ids.append(toks[-1])
            all_logits.append(steps)
            all_tokens.append(toks)
    return all_logits, all_tokens


def correctness(model_dir: Path, device: str) -> dict[str, Any]:
    engine = EngineCore(model=str(model_dir), dtype="float32", device=device, attention_backend="torch",
                        max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory=4 << 20)  # fmt: skip
    engine.runner.capture_logits = True
    greedy = make_prompts(engine.model_info.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, p in enumerate(greedy):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=sp))
    # two sampled requests, same prompt and seed, every sampler path (penalties, top-p, min-p, logprobs): the same tokens
    sampled = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, repetition_penalty=1.1, frequency_penalty=0.2,
                             presence_penalty=0.1, seed=7, logprobs=2, max_tokens=DECODE_STEPS + 1, ignore_eos=True)  # fmt: skip
    for k in (100, 101):
        engine.add_request(EngineRequest(request_id=str(k), prompt_token_ids=greedy[2], sampling=sampled))
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in [*range(len(greedy)), 100, 101]}
    tokens: dict[int, list[int]] = {i: [] for i in [*range(len(greedy)), 100, 101]}
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        assert engine.runner.last_logits is not None
        for row, o in enumerate(o for o in outs if o.new_token_ids):
            logits[int(o.request_id)].append(engine.runner.last_logits[row].float().cpu())
            tokens[int(o.request_id)].extend(o.new_token_ids)
    engine_s = time.perf_counter() - t0
    ref_logits, ref_tokens = hf_reference(model_dir, greedy, device)
    worst = max((a - b).abs().max().item() for i in range(len(greedy)) for a, b in zip(logits[i], ref_logits[i]))
    same = sum(int(tokens[i] == ref_tokens[i]) for i in range(len(greedy)))
    sampled_ok = tokens[100] == tokens[101] and len(tokens[100]) == DECODE_STEPS + 1
    return {"steps": steps, "engine_s": round(engine_s, 3), "max_logit_diff": worst, "tokens_equal": same,
            "prompts": len(greedy), "sampled_seeded_equal": sampled_ok,
            "ok": same == len(greedy) and worst <= LOGIT_TOL and sampled_ok}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 2])
    ap.add_argument("--write", action="store_true", help="write section cuda_check of docs/benchmarks.md")
    ap.add_argument("--models", type=Path, default=None,
                    help="a folder of the tiny models made beforehand (llama/, qwen2/: `--make-models DIR` where the "
                         "embedded tokenizer's package is installed); default: made here, in a temporary folder")
    ap.add_argument("--make-models", type=Path, default=None, help="only make the tiny models in this folder, and stop")
    args = ap.parse_args()
    if args.make_models is not None:
        for arch in ("llama", "qwen2"):
            make_tiny_model_dir(args.make_models / arch, arch=arch)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("cuda_check: no CUDA device here (torch.cuda.is_available() is False); try --device cpu")
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    tmp = Path(tempfile.mkdtemp())
    models = {arch: (args.models / arch if args.models else make_tiny_model_dir(tmp / arch, arch=arch))
              for arch in ("llama", "qwen2")}  # fmt: skip
    rows: list[list[object]] = []
    result: dict[str, Any] = {"benchmark": "cuda_check", "device": args.device, "device_name": name,
                              "torch": torch.__version__, "correctness": {}, "prediction": []}  # fmt: skip
    for arch in ("llama", "qwen2"):
        r = correctness(models[arch], args.device)
        result["correctness"][arch] = r
        rows.append([f"logits and greedy tokens, tiny {arch}", f"{r['tokens_equal']}/{r['prompts']} prompts' tokens equal, "
                     f"max logit diff {r['max_logit_diff']:.1e} (<= {LOGIT_TOL:.0e}); two seeded sampled requests "
                     f"{'equal' if r['sampled_seeded_equal'] else 'NOT equal'}", "ok" if r["ok"] else "FAIL"])  # fmt: skip
    model = models["llama"]
    for seed in args.seeds:
        engine = EngineCore(model=str(model), dtype="float32", device=args.device, attention_backend="torch",
                            kv_cache_memory=16 << 20, max_num_seqs=SLOTS, max_num_batched_tokens=BUDGET)  # fmt: skip
        r = measure(engine, time.monotonic, seed)
        r.pop("message")
        result["prediction"].append(r)
        ok = r["within"] >= 0.75 * r["total"]
        rows.append([f"TTFT prediction, seed {seed} (real time)", f"{r['within']}/{r['total']} within the bound, median "
                     f"error {r['median_error']:.0%}, a 64-token step {r['step_time_s'] * 1000:.2f} ms",
                     "ok" if ok else "missed"])  # fmt: skip
    text = markdown_table(["check", "result", ""], rows)
    print(f"{name}, torch {torch.__version__}\n\n{text}", flush=True)
    if args.write:
        write_section("cuda_check", f"## The engine on CUDA (`benchmarks/cuda_check.py`)\n\n{name}, torch "
                                    f"{torch.__version__}, `--device {args.device}`.\n\n{text}\n", ENGINE_DOC)  # fmt: skip
    print_json_last(result)
    if not all(c["ok"] for c in result["correctness"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
