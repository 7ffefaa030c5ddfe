"""Speculative decoding (issue 55): tok/s with and without drafts, in-process (``sluice.LLM``), greedy.

    python benchmarks/speculative.py                       # SmolLM2; writes docs/speculative.md and docs/speculative.png
    python benchmarks/speculative.py --small --no-write    # a quick look (fewer tokens, one round)

Parts (``--parts``):

    self      c=1, chat prompts: the fp32 target alone (``--quantization none``), the fp32 target drafted by its
              own Q4_1 copy (``{"model": "self:q4"}``, adaptive k and fixed k=4), the int8 target with and
              without it, and the default Q4_1 path alone; whether the drafted run's tokens equal the target's own
    ngram     an input-grounded workload (the answer copies from the prompt) at ``--levels`` running requests
              (3x as many submitted at once, the engine's slot cap at the level, so a steady load): the Q4_1
              path off, off again (a second engine: the noise arm), n-gram fixed k=4 and adaptive; drafted /
              kept tokens and the mean k the policy chose; ``docs/speculative.png`` plots tok/s against concurrency
    llama1b   the Llama-1B shape: a Q8_0 target with a Q4_0 draft, against llama-server's own speculation
    profile   one decode step at k=0 and k=4, split at the engine's seams, with the weight bytes read and the
              rate: the fp32 target + self:q4 on SmolLM2, and the Llama-1B pair when its files exist

Each figure is the median of ``--rounds`` runs, modes interleaved.  NOTE(paired-rounds): these hosts'
speed moves by 10-20% within minutes (other tenants), more than the effect at c=32, so the n-gram table
also gives each round's ratio to the "off" run of the same round, as median (min-max): a mode that never
loses has its whole range at or above 1, whatever the host did between rounds.  A second engine without
drafts ("off, a second engine") runs in every round too: its range is what the host alone does to a
ratio, so a mode whose range sits inside it is not told apart from "off" by this run.  The order of
the modes turns by one every round: on a Zen 4 host the mode that ran first in a round was the fastest in
3 of 4 rounds, so a fixed order put the last mode (adaptive) at a disadvantage.  Prints tables, writes the
``speculative`` section of docs/speculative.md (unless ``--no-write``), and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOC = DOCS / "speculative.md"
PLOT = DOCS / "speculative.png"
LLAMA_DIR = Path(__file__).resolve().parent.parent / ".peers" / "llama1b"

QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
]
PASSAGES = [
    "The lighthouse stood on a rock at the mouth of the bay. Every evening the keeper climbed the iron stairs, "
    "trimmed the wick, wound the clockwork that turned the lens, and wrote the weather in a book. Ships that "
    "passed at night saw the beam sweep across the water once every ten seconds, and they knew where they were.",
    "To make bread, mix flour, water, salt and yeast into a dough. Knead the dough for ten minutes until it is "
    "smooth. Let it rise in a warm place for one hour. Shape it into a loaf, let it rise again for thirty "
    "minutes, and bake it in a hot oven for forty minutes until the crust is brown.",
    "The meeting is on Tuesday at ten in room 4B. Alice will present the budget, Bob will report on the new "
    "warehouse, and Carol will answer questions about the hiring plan. Please bring the printed agenda and "
    "send any new topics to Alice before Monday noon.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "sugar and oxygen. It takes place in the chloroplasts, which contain chlorophyll, the pigment that makes "
    "leaves green. The oxygen is released into the air, and the sugar feeds the plant.",
]
TASKS = ["Repeat the following text exactly, word for word:", "Copy this text, then stop:",
         "Rewrite the following text without changing it:", "Quote the following text in full:"]  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SELF_Q4 = {"model": "self:q4", "num_speculative_tokens": 4}


def _chat_ids(llm: Any, texts: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) for t in texts]


def _grounded(n: int) -> list[str]:
    return [f"{TASKS[i % len(TASKS)]}\n\n{PASSAGES[(i + i // len(TASKS)) % len(PASSAGES)]}" for i in range(n)]


def _run(llm: Any, prompts: list[list[int]], tokens: int, concurrency: int,
         ignore_eos: bool = False) -> tuple[float, list[list[int]], dict[str, Any]]:  # fmt: skip
    """(tok/s, tokens per prompt, speculation counters of the run): every prompt submitted at once, at most
    ``concurrency`` running (the engine's slot cap; a finished request's slot goes to the next at once)."""
    from sluice.engine.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=ignore_eos)
    llm.engine.scheduler.max_num_seqs = concurrency
    s0 = llm.engine.make_stats()
    t0 = time.monotonic()
    out = [r.token_ids for r in llm.generate(prompts, params)]
    wall = time.monotonic() - t0
    s1 = llm.engine.make_stats()
    drafted = s1.spec_drafted_tokens - s0.spec_drafted_tokens
    accepted = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    runs = s1.spec_verify_runs - s0.spec_verify_runs
    ks = [b - a for a, b in zip(s0.spec_k_counts or [0] * len(s1.spec_k_counts), s1.spec_k_counts)]
    mean_k = sum(k * n for k, n in enumerate(ks)) / max(1, sum(ks))
    spec = {"drafted": drafted, "accepted": accepted, "accept_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_len": accepted / runs if runs else 0.0, "mean_k": mean_k}  # fmt: skip
    return sum(len(t) for t in out) / wall, out, spec


def _median_runs(modes: dict[str, Any], prompts: dict[str, list[list[int]]], tokens: int, concurrency: int,
                 rounds: int, per_round: dict[str, list[float]] | None = None,
                 ) -> dict[str, tuple[float, list[list[int]], dict[str, Any]]]:  # fmt: skip
    """Each mode's median tok/s over ``rounds`` interleaved runs (its last run's tokens and counters);
    ``per_round`` (if given) gets every run's tok/s by mode, in round order.  Round i starts at mode i
    (NOTE(paired-rounds)): no mode always runs first or last in a round."""
    tps: dict[str, list[float]] = {m: [] for m in modes} if per_round is None else per_round
    last: dict[str, tuple[float, list[list[int]], dict[str, Any]]] = {}
    names = list(modes)
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            last[name] = _run(modes[name], prompts[name], tokens, concurrency)
            tps.setdefault(name, []).append(last[name][0])
    return {m: (statistics.median(tps[m]), *last[m][1:]) for m in modes}


def paired_ratios(tps: dict[str, list[float]], mode: str, base: str = "off") -> tuple[float, float, float]:
    """(min, median, max) over rounds of ``mode``'s tok/s over ``base``'s in the same round: the two ran
    back to back, so a round's ratio sees the same host load (NOTE(paired-rounds))."""
    r = sorted(a / b for a, b in zip(tps[mode], tps[base], strict=True))
    return r[0], statistics.median(r), r[-1]


def bench_self(model: str, tokens: int, rounds: int) -> tuple[list[list[object]], dict[str, Any]]:
    from sluice import LLM

    modes = {
        "fp32 target": LLM(model, quantization="none"),
        "fp32 + self:q4, adaptive": LLM(model, quantization="none", speculative_config=SELF_Q4),
        "fp32 + self:q4, k=4": LLM(model, quantization="none", speculative_config={**SELF_Q4, "k_policy": "fixed"}),
        "int8 target": LLM(model, quantization="int8"),
        "int8 + self:q4, adaptive": LLM(model, quantization="int8", speculative_config=SELF_Q4),
        "Q4_1 path": LLM(model),
    }
    prompts = {m: _chat_ids(llm, QUESTIONS) for m, llm in modes.items()}
    for m, llm in modes.items():  # warm-up (the draft's first prefill, kernel plans)
        _run(llm, prompts[m][:1], 8, 1)
    res = _median_runs(modes, prompts, tokens, 1, rounds)
    base = res["fp32 target"]
    rows, out = [], {}
    for m, (tps, toks, spec) in res.items():
        same = toks == base[1] if m.startswith("fp32") else (toks == res["int8 target"][1] if m.startswith("int8") else "-")
        q4 = tps / res["Q4_1 path"][0]
        rows.append([m, tps, tps / base[0], q4, spec["accept_rate"] if spec["drafted"] else "-",
                     spec["mean_accepted_len"] if spec["drafted"] else "-", f"{spec['mean_k']:.2f}", same])  # fmt: skip
        out[m] = {"tok_s": tps, "speedup": tps / base[0], "x_q4_1": q4, **spec, "same_tokens": same}
    return rows, out


def bench_ngram(model: str, tokens: int, levels: list[int], rounds: int, n_prompts: int) -> tuple[list[list[object]], dict[str, Any]]:
    from sluice import LLM

    seqs = max(levels)
    modes = {
        "off": LLM(model, max_num_seqs=seqs),
        "off, a second engine": LLM(model, max_num_seqs=seqs),  # NOTE(paired-rounds): the host's own spread
        "ngram k=4": LLM(model, max_num_seqs=seqs, speculative_config={**NGRAM, "k_policy": "fixed"}),
        "ngram adaptive": LLM(model, max_num_seqs=seqs, speculative_config=NGRAM),
    }
    prompts = {m: _chat_ids(llm, _grounded(max(n_prompts, 3 * seqs))) for m, llm in modes.items()}
    for m, llm in modes.items():
        _run(llm, prompts[m][:2], 8, 2)
    rows, out = [], {}
    for c in levels:
        n = max(n_prompts, 3 * c)  # past the first wave, slots free one by one: a steady c running
        runs: dict[str, list[float]] = {}
        res = _median_runs(modes, {m: p[:n] for m, p in prompts.items()}, tokens, c, rounds, runs)
        base = res["off"]
        for m, (tps, toks, spec) in res.items():
            lo, mid, hi = paired_ratios(runs, m)
            rows.append([c, m, tps, tps / base[0], f"{mid:.3g} ({lo:.3g}-{hi:.3g})",
                         spec["accept_rate"] if spec["drafted"] else "-",
                         spec["mean_accepted_len"] if spec["drafted"] else "-", f"{spec['mean_k']:.2f}",
                         toks == base[1]])  # fmt: skip
            out[f"c{c}_{m}"] = {"tok_s": tps, "speedup": tps / base[0], "paired": [lo, mid, hi], "runs": runs[m],
                                **spec, "same_tokens": toks == base[1]}  # fmt: skip
    return rows, out



# ---------------------------------------------------------------- Llama-1B shape: Q8_0 target, Q4_0 draft

LLAMA_PROMPT_TOKENS = 32  # random token ids per prompt (the weights are random: any text is as good)


def _id_prompts(n: int, length: int = LLAMA_PROMPT_TOKENS, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


class LlamaServer:
    """llama-server on one GGUF with ``extra`` flags (a draft model, lookup), one slot: a c=1 arm."""

    def __init__(self, binary: str, gguf: Path, extra: list[str], threads: int):
        import subprocess

        from benchmarks.serving_procs import _wait_healthy, free_port

        port = free_port()
        # SLUICE_LLAMA_ARGS: as in serving.py (e.g. --no-repack where ggml's AMX path dies of SIGILL)
        cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", "1", "-c", "2048", *extra, *os.environ.get("SLUICE_LLAMA_ARGS", "").split()]  # fmt: skip
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(self.proc, self.url, 600, "llama-server")
        except BaseException:
            self.stop()
            raise

    def run(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], dict[str, Any]]:
        """(tok/s, tokens per prompt, draft counters): the prompts one after another (c=1), greedy."""
        import httpx

        out, drafted, accepted, n = [], 0, 0, 0
        t0 = time.monotonic()
        for p in prompts:
            r = httpx.post(self.url + "/completion", timeout=600, json={
                "prompt": p, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, "stream": False})  # fmt: skip
            r.raise_for_status()
            body = r.json()
            out.append(list(body.get("tokens") or []))
            n += int(body.get("timings", {}).get("predicted_n", len(out[-1])))
            drafted += int(body.get("timings", {}).get("draft_n", 0) or 0)
            accepted += int(body.get("timings", {}).get("draft_n_accepted", 0) or 0)
        wall = time.monotonic() - t0
        spec = {"drafted": drafted, "accepted": accepted, "accept_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_len": 0.0, "mean_k": 0.0}  # fmt: skip
        return n / wall, out, spec

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 -- a server that does not stop is killed
                self.proc.kill()
                self.proc.wait(10)


def find_llama_server(given: str | None) -> str | None:
    import shutil

    from benchmarks.serving_procs import LLAMA_SERVER_GLOBS, find_first

    return given or os.environ.get("SLUICE_LLAMA_SERVER") or shutil.which("llama-server") or find_first(LLAMA_SERVER_GLOBS)


def bench_llama1b(target: Path, draft: Path, tokens: int, rounds: int, n_prompts: int, k: int,
                  llama_bin: str | None, self_q4: bool = False) -> tuple[list[list[object]], dict[str, Any]]:  # fmt: skip
    """c=1, one prompt after another: sluice's Q8_0 target alone and drafted by the Q4_0 file (adaptive k,
    fixed k), the Q4_0 file alone (the draft's own speed), and llama-server on the same files plain,
    with the Q4_0 file as ``--model-draft`` and with n-gram lookup; interleaved rounds, medians."""
    from sluice import LLM

    draft_cfg = {"model": str(draft), "num_speculative_tokens": k}
    kw: dict[str, Any] = {"kv_cache_memory": 256 << 20, "max_num_seqs": 1}  # c=1: one short request at a time
    sluice_modes: dict[str, Any] = {
        "sluice Q8_0 target": LLM(str(target), **kw),
        f"sluice Q8_0 + Q4_0 draft, adaptive (k<={k})": LLM(str(target), **kw, speculative_config=draft_cfg),
        f"sluice Q8_0 + Q4_0 draft, k={k}": LLM(str(target), **kw, speculative_config={**draft_cfg, "k_policy": "fixed"}),
        "sluice Q4_0 alone (the draft)": LLM(str(draft), **kw),
    }
    if self_q4:
        sluice_modes["sluice Q8_0 + self:q4, adaptive"] = LLM(str(target), **kw, speculative_config={**SELF_Q4, "num_speculative_tokens": k})
    prompts = _id_prompts(n_prompts)
    runners: dict[str, Any] = {m: (lambda ps, t, llm=llm: _run(llm, ps, t, 1, ignore_eos=True)) for m, llm in sluice_modes.items()}
    servers: list[LlamaServer] = []
    details: dict[str, str] = {}
    try:
        if llama_bin:
            threads = os.cpu_count() or 1
            arms = {
                "llama-server Q8_0": [],
                f"llama-server Q8_0 + Q4_0 draft (--spec-draft-n-max {k})": ["-md", str(draft), "--spec-type", "draft-simple",
                                                                          "--spec-draft-n-max", str(k)],
                "llama-server Q8_0 + lookup (ngram-simple, n=3, m=8)": ["--spec-type", "ngram-simple",
                                                                         "--spec-ngram-simple-size-n", "3",
                                                                         "--spec-ngram-simple-size-m", "8"],
            }  # fmt: skip
            for name, extra in arms.items():
                srv = LlamaServer(llama_bin, target, extra, threads)
                servers.append(srv)
                runners[name] = srv.run
                details[name] = " ".join(srv.cmd[1:])
        for run in runners.values():  # warm-up: kernel plans, the draft's first prefill, llama's graphs
            run(prompts[:1], 8)
        tps: dict[str, list[float]] = {m: [] for m in runners}
        last: dict[str, tuple[float, list[list[int]], dict[str, Any]]] = {}
        loads = [os.getloadavg()[0]]
        for _ in range(rounds):
            for name, run in runners.items():
                last[name] = run(prompts, tokens)
                tps[name].append(last[name][0])
                print(f"{name}: {last[name][0]:.1f} tok/s (1-min load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            loads.append(os.getloadavg()[0])
    finally:
        for srv in servers:
            srv.stop()
    base_s = statistics.median(tps["sluice Q8_0 target"])
    base_l = statistics.median(tps["llama-server Q8_0"]) if "llama-server Q8_0" in tps else None
    best_l = max((statistics.median(v) for m, v in tps.items() if m.startswith("llama-server") and m != "llama-server Q8_0"),
                 default=None)  # fmt: skip
    rows, out = [], {"load_1min": loads, "llama_cmd": details}
    ref = last["sluice Q8_0 target"][1]
    for m in runners:
        tok_s = statistics.median(tps[m])
        spec = last[m][2]
        same: object = "-"
        if m.startswith("sluice Q8_0"):
            same = last[m][1] == ref
        vs_llama = tok_s / best_l if best_l and m.startswith("sluice") else "-"
        rows.append([m, tok_s, f"{min(tps[m]):.1f}-{max(tps[m]):.1f}", tok_s / base_s,
                     tok_s / base_l if base_l else "-", vs_llama,
                     spec["accept_rate"] if spec["drafted"] else "-",
                     spec["mean_accepted_len"] if spec["drafted"] and m.startswith("sluice") else "-",
                     f"{spec['mean_k']:.2f}" if m.startswith("sluice") else "-", same])  # fmt: skip
        out[m] = {"tok_s": tok_s, "runs": tps[m], "x_sluice_q8": tok_s / base_s, **spec, "same_tokens": same}
    out["best_llama_spec_tok_s"] = best_l
    return rows, out


# ---------------------------------------------------------------- one speculative step at its seams


def spec_step_profile(target: str, spec: dict[str, Any] | None, steps: int = 12, ctx: int = 128,
                      **engine_kw: Any) -> dict[str, Any]:  # fmt: skip
    """One decode step of one request (``ctx``-token prompt), split at the speculation's seams (ms per step),
    with the tokens it emits, the weight bytes its forwards read and the rate they read them at."""
    from benchmarks._step_profile import _Timer, read_bandwidth_gb_s, weight_bytes
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    core = EngineCore(EngineConfig(model=target, max_num_seqs=1, kv_cache_memory=1 << 30, speculative_config=spec,
                                   **engine_kw))  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=ctx * 4, ignore_eos=True)
    core.add_request(EngineRequest(request_id="p", prompt_token_ids=_id_prompts(1, ctx, seed=7)[0], sampling=sp,
                                   arrival_time=time.monotonic()))  # fmt: skip
    while core.make_stats().num_decoding < 1:
        core.step()
    for _ in range(6):  # decode steps outside the measurement (the adaptive fit, the draft's prefill)
        core.step()
    net = core.runner.model
    spec_obj = core.speculator
    draft = getattr(getattr(spec_obj, "proposer", None), "draft", None)
    def timers(*pairs: tuple[Any, str]) -> list[_Timer]:  # the seams that exist in this engine
        return [_Timer(obj, name) for obj, name in pairs if obj is not None and callable(getattr(obj, name, None))]

    seams: dict[str, list[_Timer]] = {
        "plan (adaptive k)": timers((spec_obj, "plan")),
        "schedule": timers((core.scheduler, "schedule")),
        "propose (draft steps)": timers((spec_obj, "propose")),
        "sampling rows": timers((core, "_sampling_rows")),
        "target step (execute)": timers((core.runner, "execute")),
        "verify + observe": timers((spec_obj, "verify"), (spec_obj, "observe")),
        "update_from_output": timers((core.scheduler, "update_from_output")),
    }
    inner = {"target forward + LM head": [_Timer(net, "forward"), _Timer(net, "compute_logits")]}
    if draft is not None:
        inner["draft forwards"] = [_Timer(draft, "forward")]
        inner["draft model forward + LM head"] = [_Timer(draft.model, "forward"), _Timer(draft.model, "compute_logits")]
    d_steps0 = draft.num_steps if draft is not None else 0
    emitted = 0
    t_steps = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            outs = core.step()
            t_steps.append(time.perf_counter() - t)
            emitted += sum(len(o.new_token_ids) for o in outs)
    finally:
        for ts in [*seams.values(), *inner.values()]:
            for tm in ts:
                tm.restore()
    step_s = sum(t_steps) / steps
    ms = {k: 1e3 * sum(tm.seconds for tm in ts) / steps for k, ts in seams.items() if ts}
    ms["rest of the step (Python, counters)"] = max(0.0, 1e3 * step_s - sum(ms.values()))
    inner_ms = {k: 1e3 * sum(tm.seconds for tm in ts) / steps for k, ts in inner.items()}
    tbytes = weight_bytes(net)
    dbytes = weight_bytes(draft.model) if draft is not None else 0
    d_per_step = (draft.num_steps - d_steps0) / steps if draft is not None else 0.0
    read = tbytes + dbytes * d_per_step  # weight bytes one step reads (each forward reads every weight once)
    fwd_s = (inner_ms["target forward + LM head"] + inner_ms.get("draft model forward + LM head", 0.0)) / 1e3
    return {
        "spec": spec, "step_ms": 1e3 * step_s, "tokens_per_step": emitted / steps, "ms_per_token": 1e3 * step_s * steps / max(1, emitted),
        "seams_ms": ms, "inner_ms": inner_ms, "draft_forwards_per_step": d_per_step,
        "target_weight_mb": tbytes / 1e6, "draft_weight_mb": dbytes / 1e6, "weight_mb_per_step": read / 1e6,
        "weight_gb_s_forwards": read / fwd_s / 1e9 if fwd_s else float("nan"),
        "weight_gb_s_step": read / step_s / 1e9,
        "target_gb_s": tbytes / (inner_ms["target forward + LM head"] / 1e3) / 1e9,
        "draft_gb_s": (dbytes * d_per_step / (inner_ms["draft model forward + LM head"] / 1e3) / 1e9) if draft is not None and d_per_step else float("nan"),
        "read_bandwidth_gb_s": read_bandwidth_gb_s(),
    }  # fmt: skip


def profile_table(profiles: dict[str, dict[str, Any]]) -> str:
    names = list(profiles)
    keys: list[str] = []
    for p in profiles.values():
        keys += [k for k in p["seams_ms"] if k not in keys]
    rows: list[list[object]] = [[k, *[profiles[n]["seams_ms"].get(k, "-") for n in names]] for k in keys]
    inner: list[str] = []
    for p in profiles.values():
        inner += [k for k in p["inner_ms"] if k not in inner]
    rows += [[f"(inside) {k}", *[profiles[n]["inner_ms"].get(k, "-") for n in names]] for k in inner]
    rows += [
        ["step (ms)", *[profiles[n]["step_ms"] for n in names]],
        ["tokens emitted per step", *[profiles[n]["tokens_per_step"] for n in names]],
        ["ms per emitted token", *[profiles[n]["ms_per_token"] for n in names]],
        ["draft forwards per step", *[profiles[n]["draft_forwards_per_step"] for n in names]],
        ["weight MB read per step (target + draft x forwards)", *[profiles[n]["weight_mb_per_step"] for n in names]],
        ["weight-read rate in the forwards (GB/s)", *[profiles[n]["weight_gb_s_forwards"] for n in names]],
        ["  target forward alone (GB/s)", *[profiles[n]["target_gb_s"] for n in names]],
        ["  draft forwards alone (GB/s)", *[profiles[n]["draft_gb_s"] for n in names]],
        ["weight-read rate over the whole step (GB/s)", *[profiles[n]["weight_gb_s_step"] for n in names]],
        ["memory: one pass over 1 GiB (GB/s)", *[profiles[n]["read_bandwidth_gb_s"] for n in names]],
    ]  # fmt: skip
    return markdown_table(["one decode step, c=1 (ms unless noted)", *names], rows)


def plot(out: dict[str, Any], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("off", "ngram k=4", "ngram adaptive"):
        ax.plot(levels, [out[f"c{c}_{m}"]["tok_s"] for c in levels], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title("SmolLM2 Q4_1, input-grounded answers: n-gram speculation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _load_note(loads: list[float]) -> str:
    return f"1-min load average {loads[0]:.2f} at the start, {max(loads):.2f} at most between rounds, {loads[-1]:.2f} at the end"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="self,ngram,llama1b,profile",
                    help="comma-separated: self, ngram (SmolLM2), llama1b (Q8_0 target + Q4_0 draft, llama-server), "
                         "profile (one step at k=0 and k=4: SmolLM2 fp32 + self:q4, and the Llama-1B pair)")  # fmt: skip
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96, help="max output tokens per request")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, default=8, help="requests per run (at least 3x the concurrency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="32 tokens, 4 prompts at c=1, one round")
    ap.add_argument("--skip-self", action="store_true", help="leave out the fp32 + self:q4 part (= --parts ngram,...)")
    ap.add_argument("--target", type=Path, default=LLAMA_DIR / "llama1b-q8_0.gguf", help="llama1b: the Q8_0 target")
    ap.add_argument("--draft", type=Path, default=LLAMA_DIR / "llama1b-q4_0.gguf", help="llama1b: the Q4_0 draft")
    ap.add_argument("--k", type=int, default=4, help="llama1b: num_speculative_tokens (sluice) / --spec-draft-n-max")
    ap.add_argument("--llama-prompts", type=int, default=4, help="llama1b: prompts per run (one after another)")
    ap.add_argument("--also-self-q4", action="store_true", help="llama1b: also the Q8_0 target + self:q4")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: found as serving.py finds it)")
    ap.add_argument("--no-llama", action="store_true", help="llama1b: sluice arms only")
    ap.add_argument("--no-write", action="store_true", help="write no doc")
    ap.add_argument("--section", default="speculative",
                    help="self,ngram: the docs/speculative.md section to write (e.g. speculative_epyc for a second CPU)")
    ap.add_argument("--no-benchmarks-md", action="store_true", help="write docs/speculative.md only")
    args = ap.parse_args()
    if args.small:
        args.tokens, args.rounds, args.prompts, args.llama_prompts = 32, 1, 4, 2
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if args.skip_self:
        parts = [x for x in parts if x != "self"]
    unknown = set(parts) - {"self", "ngram", "llama1b", "profile"}
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}: use self, ngram, llama1b, profile")
    if "llama1b" in parts:
        for f in (args.target, args.draft):
            if not f.is_file():
                ap.error(f"{f}: no such file (python benchmarks/make_llama1b_gguf.py writes the pair)")

    result: dict[str, Any] = {"machine": machine_line(), "tokens": args.tokens, "levels": args.levels}
    write = not args.no_write
    if {"self", "ngram"} & set(parts):
        load0 = os.getloadavg()[0]
        sections = [f"`python benchmarks/speculative.py --parts {','.join(x for x in parts if x in ('self', 'ngram'))}` "
                    f"({args.model}, {machine_line()}; greedy, up to {args.tokens} tokens per request, medians of "
                    f"{args.rounds} interleaved runs; 1-min load average {load0:.2f} at the start):", ""]  # fmt: skip
        if "self" in parts:
            rows, result["self"] = bench_self(args.model, args.tokens, args.rounds)
            table = markdown_table(["c=1, chat", "tok/s", "x fp32", "x Q4_1 path", "accepted", "mean kept run", "mean k", "same tokens"], rows)
            print(table, "\n")
            sections += ["Self-speculation: the fp32 and int8 targets drafted by the file's own Q4_1 weights "
                         "(`same tokens`: against the same target without drafts).", "", table, ""]
        if "ngram" in parts:
            rows, result["ngram"] = bench_ngram(args.model, args.tokens, args.levels, args.rounds, args.prompts)
            table = markdown_table(["c", "input-grounded", "tok/s", "x off", "x off by round: median (min-max)",
                                    "accepted", "mean kept run", "mean k", "same tokens"], rows)  # fmt: skip
            print(table)
            sections += ["N-gram drafts on the Q4_1 path, answers that copy from the prompt.", "", table, ""]
        sections[0] = sections[0].replace("at the start):", f"at the start, {os.getloadavg()[0]:.2f} at the end):")
        if write and "ngram" in parts:
            png = PLOT if args.section == "speculative" else DOCS / f"{args.section}.png"
            plot(result["ngram"], args.levels, png)
            sections += [f"![tok/s against concurrency]({png.name})", ""]
        if write and "self" in parts and "ngram" in parts:
            write_section(args.section, "\n".join(sections), DOC)
    if "llama1b" in parts:
        llama_bin = None if args.no_llama else find_llama_server(args.llama_server)
        rows, res = bench_llama1b(args.target, args.draft, args.tokens, args.rounds, args.llama_prompts, args.k,
                                  llama_bin, args.also_self_q4)  # fmt: skip
        result["llama1b"] = res
        table = markdown_table(["c=1, Llama-1B shape", "tok/s (median)", "range", "x sluice Q8_0", "x llama-server Q8_0",
                                "x llama-server best spec.", "accepted", "mean kept run", "mean k", "same tokens"], rows)  # fmt: skip
        print(table, "\n")
        body = "\n".join([
            f"`python benchmarks/speculative.py --parts llama1b` ({machine_line()}; {_load_note(res['load_1min'])}): "
            f"{args.target.name} as the target, {args.draft.name} as the draft (both from the same float weights, "
            f"`benchmarks/make_llama1b_gguf.py`), {args.llama_prompts} prompts of {LLAMA_PROMPT_TOKENS} random token ids "
            f"one after another (c=1), {args.tokens} output tokens each (`ignore_eos`), greedy; medians of {args.rounds} "
            f"interleaved rounds, every arm in the same run.  sluice in-process (`sluice.LLM`), llama-server over HTTP "
            f"(`/completion`, one slot, {os.cpu_count()} threads; its `accepted` is its own `draft_n_accepted / draft_n`).",
            "", table, ""])  # fmt: skip
        if write:
            write_section("speculative_llama1b", body, DOC)
            if not args.no_benchmarks_md:
                write_section("speculative_llama1b", body)
    if "profile" in parts:
        how = ("one request, a 128-token prompt of random ids, greedy; 12 decode steps timed at the engine's seams "
               "(`time.perf_counter` around each), after 6 untimed ones.")  # fmt: skip
        load0 = os.getloadavg()[0]
        self_q4 = {**SELF_Q4, "k_policy": "fixed"}
        profiles = {  # the self-speculation target (SmolLM2 float32) at k=0 and k=4
            "k=0 (fp32 target alone)": spec_step_profile(args.model, None, quantization="none"),
            "k=4 (fp32 + self:q4, fixed)": spec_step_profile(args.model, self_q4, quantization="none"),
            "Q4_1 path alone": spec_step_profile(args.model, None),
        }
        result["profile_self"] = profiles
        table = profile_table(profiles)
        print(table, "\n")
        body = "\n".join([
            f"`python benchmarks/speculative.py --parts profile` ({args.model}; {machine_line()}; 1-min load average "
            f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end): the float32 target drafted by its own "
            f"Q4_1 weights; {how}", "", table, ""])  # fmt: skip
        if write:
            write_section("speculative_profile_self", body, DOC)
        if args.target.is_file() and args.draft.is_file():
            draft_cfg = {"model": str(args.draft), "num_speculative_tokens": 4, "k_policy": "fixed"}
            load0 = os.getloadavg()[0]
            profiles = {
                "k=0 (Q8_0 target alone)": spec_step_profile(str(args.target), None),
                "k=4 (Q8_0 + Q4_0 draft, fixed)": spec_step_profile(str(args.target), draft_cfg),
                "Q4_0 alone": spec_step_profile(str(args.draft), None),
            }
            result["profile"] = profiles
            table = profile_table(profiles)
            print(table)
            body = "\n".join([
                f"`python benchmarks/speculative.py --parts profile` ({machine_line()}; 1-min load average {load0:.2f} at "
                f"the start, {os.getloadavg()[0]:.2f} at the end): the Llama-1B shape; {how}", "", table, ""])  # fmt: skip
            if write:
                write_section("speculative_profile", body, DOC)
        else:
            print(f"profile: no {args.target.name} / {args.draft.name} (python benchmarks/make_llama1b_gguf.py "
                  "writes them): the Llama-1B profile is left as it is", file=sys.stderr)  # fmt: skip
    print_json_last(result)


if __name__ == "__main__":
    main()
