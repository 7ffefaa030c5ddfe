"""The benchmark scripts' flags, tables and target verdicts, without starting any server or peer.

The full runs take minutes and need peers (llama-server, vLLM-CPU); these tests
keep the parts that decide what a run reports honest: which systems run, what
counts as a complete answer, how the issue's target ratios are computed and
written, and that the random Llama-shaped GGUF is one sluice loads.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report, make_llama1b_gguf, serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16
"""


# ---------------------------------------------------------------- _report


def test_cpuinfo_gives_the_model_and_each_kernel_relevant_flag() -> None:
    model, flags = _report.parse_cpuinfo(CPUINFO)
    assert model == "AMD EPYC 9R14 96-Core Processor"
    assert flags == {"avx2": True, "avx512f": True, "avx512_vnni": True, "avx_vnni": False,
                     "avx512_bf16": True, "amx": False}
    line = _report.cpu_line((model, flags))
    assert line == ("CPU AMD EPYC 9R14 96-Core Processor with avx2, avx512f, avx512_vnni, avx512_bf16, "
                    "without avx_vnni, amx")


def test_any_amx_flag_counts_as_amx() -> None:
    _, flags = _report.parse_cpuinfo("model name : Xeon\nflags : avx2 amx_tile amx_int8\n")
    assert flags["amx"] and flags["avx2"] and not flags["avx512f"]


def test_steal_is_read_from_the_first_line_of_proc_stat_and_shared_over_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(steal): the 8th number after ``cpu`` is the time the hypervisor gave other guests, in clock ticks."""
    tick = os.sysconf("SC_CLK_TCK")
    stat = f"cpu  100 0 50 900 3 0 1 {3 * tick} 0 0\ncpu0 50 0 25 450 1 0 0 {tick} 0 0\n"
    assert _report.steal_seconds(stat) == pytest.approx(3.0)
    assert _report.steal_seconds("intr 1 2 3\n") is None and _report.steal_seconds("cpu 1 2 3\n") is None
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _report.steal_share(10.0, 11.0, 5.0) == pytest.approx(0.1), "1 s stolen of 2 CPUs x 5 s"
    assert _report.steal_share(None, 11.0, 5.0) is None and _report.steal_share(1.0, 2.0, 0.0) is None
    assert _report.steal_share(5.0, 4.0, 1.0) == 0.0, "a counter that went back is no negative share"
    if Path("/proc/stat").exists():
        now = _report.steal_seconds()
        assert now is None or now >= 0.0


def test_machine_line_names_the_cpu_flags() -> None:
    line = _report.machine_line()
    assert "CPU " in line and "avx2" in line, "every table must record the CPU flags the kernels chose by"


def test_write_section_replaces_only_its_own_block(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    _report.write_section("a", "first", doc)
    _report.write_section("b", "other", doc)
    _report.write_section("a", "second", doc)
    text = doc.read_text()
    assert "second" in text and "first" not in text and "other" in text


# ---------------------------------------------------------------- serving: flags


def test_peer_list_takes_both_peers_in_one_run() -> None:
    assert serving.parse_peers("vllm,llama") == ["vllm", "llama"]
    assert serving.parse_peers("llama.cpp, vllm,llama") == ["llama", "vllm"]
    assert serving.parse_peers("") == []
    with pytest.raises(ValueError, match="unknown peer"):
        serving.parse_peers("tgi")


def test_flags_choose_the_systems_in_order() -> None:
    args = serving.build_parser().parse_args(["--peer", "vllm,llama", "--also-fp32", "--levels", "1,8,32"])
    assert serving.systems_to_run(args) == ["sluice", "sluice-fp32", "vllm", "llama"]
    assert args.levels == [1, 8, 32]
    args = serving.build_parser().parse_args(["--no-sluice", "--peer", "llama"])
    assert serving.systems_to_run(args) == ["llama"]
    assert serving.build_parser().parse_args([]).levels == [1, 8, 32], "the issue's concurrency levels by default"


def test_an_unknown_peer_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        serving.build_parser().parse_args(["--peer", "nope"])


def test_sluice_variants_differ_only_by_weight_path() -> None:
    assert serving.SLUICE_VARIANTS["sluice"][1] == [], "the default row is sluice as it serves by default"
    assert serving.SLUICE_VARIANTS["sluice-fp32"][1] == ["--quantization", "none"]


def test_llama_server_command_batches_on_localhost() -> None:
    cmd = serving.llama_command("/bin/llama-server", Path("m.gguf"), 8100, threads=2, slots=32)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("-np") + 1] == "32" and "-cb" in cmd
    assert int(cmd[cmd.index("-c") + 1]) >= 32 * (serving.PROMPT_TOKENS + serving.OUTPUT_TOKENS)
    assert cmd[cmd.index("-t") + 1] == "2"


def test_sections_and_labels_per_model(tmp_path: Path) -> None:
    assert serving.section_name("smollm2") == "serving"
    assert serving.section_name(".peers/llama1b/llama1b-q4_0.gguf") == "serving_llama1b-q4_0"
    f = tmp_path / "x-q8_0.gguf"
    f.write_bytes(b"\0" * 2_000_000)
    assert serving.model_gguf(str(f)) == f
    assert "x-q8_0" in serving.model_label(str(f)) and "2 MB" in serving.model_label(str(f))
    assert serving.model_gguf("smollm2").suffix == ".gguf"


def test_every_peer_gets_the_same_request() -> None:
    body = serving.request_body("m", [1, 2, 3])
    assert body["max_tokens"] == serving.OUTPUT_TOKENS == 64 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == [1, 2, 3] and body["temperature"] == 0


def test_only_a_64_token_length_cut_answer_counts() -> None:
    assert serving.check_tokens(64, {"length"}) == ""
    assert "63" in serving.check_tokens(63, {"length"})
    assert "stop" in serving.check_tokens(64, {"stop"})
    assert serving.requests_at(1, 1) == 4 and serving.requests_at(32, 2) == 64


def test_level_stats_count_only_complete_answers() -> None:
    rs = [serving.Result(True, 0.1, 1.0, 64), serving.Result(True, 0.3, 2.0, 64),
          serving.Result(False, tokens=10, error="10 completion tokens, not 64")]
    row = serving.level_stats(rs, 2, wall=2.0, api_cpu_s=float("nan"))
    assert row["errors"] == 1 and row["requests"] == 3
    assert row["output_tok_per_s"] == 64.0, "tokens of incomplete answers must not inflate throughput"
    assert row["ttft_p50_s"] == pytest.approx(0.2)
    assert math.isnan(row["api_cpu_us_per_token"])


# ---------------------------------------------------------------- serving: targets


def _row(c: int, tps: float, ttft: float, errors: int = 0) -> dict[str, Any]:
    return {"concurrency": c, "output_tok_per_s": tps, "ttft_p95_s": ttft, "errors": errors, "requests": 4}


def _systems(**levels: list[dict[str, Any]]) -> dict[str, Any]:
    names = {"sluice": "sluice", "llama": "llama-server", "vllm": "vllm-cpu"}
    return {sid: {"name": names.get(sid, sid), "details": "", "startup_s": 1.0, "peak_rss_mib": 100.0, "levels": rows}
            for sid, rows in levels.items()}


def test_targets_from_one_run_met() -> None:
    systems = _systems(sluice=[_row(1, 60, 0.1), _row(32, 400, 2.0)], llama=[_row(1, 45, 0.5), _row(32, 60, 15)],
                       vllm=[_row(1, 25, 0.2), _row(32, 190, 4.0)])
    rows = serving.target_rows(systems)
    assert [r["status"] for r in rows] == ["met"] * 4
    assert rows[0]["ratio"] == pytest.approx(60 / 45)
    assert rows[2]["ratio"] == pytest.approx(400 / 190)
    assert rows[3]["ratio"] == pytest.approx(2.0 / 4.0), "c=32 TTFT is compared with the best peer"


def test_targets_missed_by_ratio_and_by_ttft() -> None:
    systems = _systems(sluice=[_row(1, 50, 0.6), _row(32, 300, 5.0)], llama=[_row(1, 45, 0.5), _row(32, 60, 15)],
                       vllm=[_row(32, 190, 4.0)])
    status = {r["target"]: r["status"] for r in serving.target_rows(systems)}
    assert status == {
        "c=1 output tok/s >= 1.2x llama-server": "missed",  # 1.11x
        "c=1 p95 TTFT lower than llama-server": "missed",
        "c=32 output tok/s >= 2x vLLM-CPU": "missed",  # 1.58x
        "c=32 p95 TTFT lower than every peer": "missed",  # vLLM's 4.0 s beats 5.0 s
    }


def test_unmeasured_targets_are_never_reported_as_met() -> None:
    rows = serving.target_rows(_systems(sluice=[_row(1, 60, 0.1), _row(32, 400, 2.0)], llama=[_row(32, 60, 15)]))
    by = {r["target"].split(" (")[0]: r["status"] for r in rows}
    assert by["c=1 output tok/s >= 1.2x llama-server"] == "not measured"
    assert by["c=32 output tok/s >= 2x vLLM-CPU"] == "not measured"
    assert by["c=32 p95 TTFT lower than every peer"] == "not measured", "vLLM was not run: cannot confirm"
    worse = serving.target_rows(_systems(sluice=[_row(32, 400, 20.0)], llama=[_row(32, 60, 15)]))
    assert worse[3]["status"] == "missed", "beaten by a peer that ran: refuted even without the other"


def test_a_sluice_level_with_failures_meets_nothing() -> None:
    systems = _systems(sluice=[_row(1, 60, 0.1, errors=1)], llama=[_row(1, 45, 0.5)])
    assert serving.target_rows(systems)[0]["status"] == "missed"


def test_section_renders_tables_targets_and_cpu(tmp_path: Path) -> None:
    systems = _systems(sluice=[{**_row(1, 60, 0.1), "req_per_s": 1.0, "ttft_p50_s": 0.1, "tpot_mean_s": 0.01,
                                "e2e_p95_s": 1.0, "api_cpu_us_per_token": 50.0, "load_avg_1m": 0.5}])
    results = {"model_label": "SmolLM2-135M-Instruct", "systems": systems, "targets": serving.target_rows(systems)}
    body = serving.render_section(results, "x86_64, 2 cores, CPU Test with avx2")
    assert "CPU Test with avx2" in body
    assert "| sluice | 1 |" in body and "0/4" in body
    assert "not measured" in body and "c=32 output tok/s >= 2x vLLM-CPU" in body
    doc = tmp_path / "benchmarks.md"
    _report.write_section(serving.section_name("smollm2"), body, doc)
    assert "<!-- BEGIN serving -->" in doc.read_text()


# ---------------------------------------------------------------- offline throughput


def test_offline_target_is_twice_transformers_batched() -> None:
    from benchmarks import offline_throughput as ot

    native = {"tok_s": 400.0, "quantization": "gguf:Q4_1+gguf:Q8_0", "kernel_path": "avx2", "dtype": "float32"}
    fp32 = {"tok_s": 160.0, "quantization": "none", "kernel_path": "", "dtype": "float32"}
    rows, verdict = ot.throughput_rows(native, fp32, hf_batched=180.0, hf_single=16.0, n_single=4)
    assert verdict["status"] == "met" and verdict["ratio"] == pytest.approx(400 / 180)
    assert rows[1][1] == "dequantized to float32" and "avx2" in str(rows[0][1])
    _, verdict = ot.throughput_rows({**native, "tok_s": 300.0}, fp32, 180.0, 16.0, 4)
    assert verdict["status"] == "missed"
    assert ot.section_name("smollm2") == "offline_throughput"


# ---------------------------------------------------------------- the Llama-shaped GGUF


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama1b")
    [path] = make_llama1b_gguf.main(["--shape", "tiny", "--types", "q4_0", "--out", str(out)])
    return path


def test_random_gguf_has_the_shape_tokenizer_and_block_types(tiny_gguf: Path) -> None:
    import gguf
    import numpy as np

    from sluice.models.files import gguf_hf_config, gguf_reader, load_gguf_state_dict

    reader = gguf_reader(tiny_gguf)
    cfg = gguf_hf_config(reader, tiny_gguf)
    tiny = make_llama1b_gguf.SHAPES["tiny"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (
        tiny.hidden, tiny.layers, tiny.intermediate)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        tiny.heads, tiny.kv_heads, tiny.head_dim)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"], "SmolLM2's vocabulary, tied like Llama-3.2-1B"
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{%"), "chat template copied"
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q4_0
    sd = load_gguf_state_dict(reader, tiny_gguf, cfg)
    w = sd["model.layers.0.mlp.down_proj.weight"]
    assert tuple(w.shape) == (tiny.hidden, tiny.intermediate)
    arr = np.asarray(w, dtype=np.float32)
    assert np.isfinite(arr).all() and 0.005 < arr.std() < 0.05, "valid blocks with weight std about 0.02"


def test_the_llama1b_shape_is_llama_3_2_1b() -> None:
    s = make_llama1b_gguf.SHAPES["llama1b"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate) == (2048, 16, 32, 8, 64, 8192)


@pytest.mark.slow
def test_sluice_loads_and_generates_from_the_random_gguf(tiny_gguf: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams
    from sluice.kernels.qlinear import available_paths

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLUICE_KERNEL_PATH", available_paths()[0].label)  # no autotune: a load test, not a speed one
    core = EngineCore(EngineConfig(model=str(tiny_gguf), kv_cache_memory=16 << 20))
    assert core.model_info.quantization == "gguf:Q4_0+gguf:Q8_0", "served natively, not dequantized"
    core.add_request(EngineRequest(request_id="a", prompt_token_ids=[1000, 2000, 3000],
                                   sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    assert len(tokens) == 4 and all(0 <= t < 49152 for t in tokens)


def test_gemm_candidates_runs_and_times_every_candidate() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm_candidates.py"), "--batches", "1", "--no-write"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "gemm_candidates" and len(result["results"]) == 4  # one per shape at M=1
    for r in result["results"]:
        for key in ("sluice int4", "sluice int8", "torch int4pack", "torch int8pack"):
            assert r[key] > 0, (key, r)


# ---------------------------------------------------------------- overload_engine


def test_overload_engine_run_reports_every_class_and_counts_express_steps(tmp_path: Path) -> None:
    from benchmarks import overload_engine
    from tests.model_factory import make_tiny_model_dir

    model = str(make_tiny_model_dir(tmp_path / "tiny-llama"))
    targets = (0.05, 2.0, 5.0)
    runs = {mode: overload_engine.run_load(mode, 80.0, 1.0, 8, targets, seed=3, model=model)
            for mode in overload_engine.MODES}  # fmt: skip
    assert len({r["sent"] for r in runs.values()}) == 1 and runs["off"]["sent"] > 20, "the same seeded arrivals"
    for r in runs.values():
        assert set(r["classes"]) == {"p0", "p1", "p2"}
        assert sum(c["sent"] for c in r["classes"].values()) == r["sent"]
        assert all(c["first_tokens"] == c["sent"] for c in r["classes"].values()), "the queue drains: every request starts"
        assert 0.0 <= r["classes"]["p0"]["attainment"] <= 1.0
    assert runs["off"]["express_steps"] == 0, "--no-express-steps: never an express step"
    assert runs["boundary"]["mid_step_express"] == 0 == runs["off"]["mid_step_express"], "no arrivals hook: none mid-step"
    assert runs["mid-step"]["mid_step_express"] <= runs["mid-step"]["express_steps"]
    assert all(r["steal_share"] is None or 0.0 <= r["steal_share"] <= 1.0 for r in runs.values()), "NOTE(steal)"
    solo = overload_engine.run_load("mid-step", 40.0, 1.0, 8, targets, seed=3, model=model, mix=(1.0, 0.0, 0.0))
    assert set(solo["classes"]) == {"p0"} and solo["classes"]["p0"]["sent"] == solo["sent"] > 10, "--mix 1,0,0: P0 only"


def test_overload_engine_at_a_given_rate_runs_each_seed_of_the_chosen_modes(tmp_path: Path) -> None:
    from tests.model_factory import make_tiny_model_dir

    model = str(make_tiny_model_dir(tmp_path / "tiny-llama"))
    script = str(ROOT / "benchmarks" / "overload_engine.py")
    args = [sys.executable, script, "--model", model, "--loads", "1", "--step-s", "0.5", "--no-write"]
    proc = subprocess.run([*args, "--rate", "30", "--modes", "mid-step", "--seeds", "4,5"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["capacity_rps"] == 30.0, "--rate: the given capacity, no closed loop"
    assert [(r["mode"], r["seed"], r["rate"]) for r in out["results"]] == [("mid-step", 4, 30.0), ("mid-step", 5, 30.0)]
    assert out["results"][0]["sent"] != out["results"][1]["sent"] or out["results"][0]["classes"] != out["results"][1]["classes"]
    bad = subprocess.run([*args, "--rate", "30", "--modes", "sideways"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--modes" in bad.stderr and "Traceback" not in bad.stderr


def test_overload_engine_capacity_loop_sends_the_capacity_mix_and_takes_the_median(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import overload_engine
    from tests.model_factory import make_tiny_model_dir

    model = str(make_tiny_model_dir(tmp_path / "tiny-llama"))
    sent: list[int] = []
    make = overload_engine._request

    def spy(rng, rid, priority, targets, arrival):  # type: ignore[no-untyped-def]
        sent.append(priority)
        return make(rng, rid, priority, targets, arrival)

    monkeypatch.setattr(overload_engine, "_request", spy)
    assert overload_engine.capacity(8, 0.5, (0.05, 2.0, 5.0), model, mix=(0.0, 0.0, 1.0)) > 0
    assert len(sent) >= 8 and set(sent) == {2}, "--capacity-mix 0,0,1: every closed-loop request is P2"
    monkeypatch.undo()
    script = str(ROOT / "benchmarks" / "overload_engine.py")
    args = [sys.executable, script, "--model", model, "--loads", "1", "--step-s", "0.3", "--no-write",
            "--modes", "mid-step", "--seeds", "1", "--concurrency", "8", "--calibrate-s", "0.4"]  # fmt: skip
    proc = subprocess.run([*args, "--capacity-mix", "0,0,1", "--capacity-runs", "3"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]  # "capacity C req/s of a, b, c"
    runs = [float(x) for x in first.split(" of ")[1].split(", ")]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(runs) == 3 and out["capacity_rps"] == pytest.approx(sorted(runs)[1], abs=0.051), first
    bad = subprocess.run([*args, "--capacity-mix", "1,2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--capacity-mix" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- overload_repeat


def test_overload_repeat_reads_labelled_gauges_and_ignores_prefixes() -> None:
    from benchmarks import overload_repeat

    text = "\n".join([
        "# HELP sluice_num_requests_waiting_by_priority Waiting.",
        'sluice_num_requests_waiting_by_priority{priority="p1"} 4.0',
        'sluice_num_requests_waiting_by_priority_extra{priority="p1"} 9.0',
        'sluice_predicted_ttft_seconds{priority="p2"} 12.5',
        "sluice_num_requests_waiting 7.0",
    ])  # fmt: skip
    got = overload_repeat._gauges(text, overload_repeat._TIMELINE)
    assert got == {'sluice_num_requests_waiting_by_priority{priority="p1"}': 4.0,
                   'sluice_predicted_ttft_seconds{priority="p2"}': 12.5}  # fmt: skip


def test_overload_repeat_timeline_counts_misses_and_late_admissions_per_second() -> None:
    from benchmarks import overload, overload_repeat

    targets = {"p0": 0.08, "p1": 2.0, "p2": 5.0}
    records = [
        overload.Record("p0", 0.1, 200, ttft=0.05),  # within
        overload.Record("p0", 0.5, 200, ttft=0.2),  # late: a miss
        overload.Record("p0", 0.9, 429),  # shed: a miss
        overload.Record("p1", 0.2, 200, ttft=2.5),  # served, late
        overload.Record("p1", 0.3, 429),
        overload.Record("p1", 1.2, 200, ttft=0.4),
        overload.Record("p2", 0.4, 200, ttft=3.0),
        overload.Record("p2", 0.6, 429),
    ]
    g = 'sluice_num_requests_waiting_by_priority{priority="p1"}'
    r = 'sluice_num_requests_running_by_priority{priority="p0"}'
    samples = [(0.0, {g: 2.0, r: 5.0}), (0.5, {g: 4.0, r: 7.0}), (1.1, {g: 1.0})]
    lines = overload_repeat._timeline(samples, records, targets).splitlines()
    second0 = [c.strip() for c in lines[2].strip("|").split("|")]
    second1 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert second0[:7] == ["0", "3", "2", "2", "1", "1", "1"], second0
    assert second0[8] == "3.0", "the mean of the second's samples"
    assert second0[12] == "6.0", "P0 running in the engine, the mean of the second's samples"
    assert second1[:7] == ["1", "0", "0", "1", "1", "0", "0"], second1


def _fake_overload_repeat(monkeypatch: pytest.MonkeyPatch, lone_ttft: Any, load_step: Any, **over: Any) -> Any:
    """``overload_repeat.run``'s arguments, with a fake server, lone-TTFT probe and load step patched in."""
    import argparse
    import contextlib
    import os

    from benchmarks import overload, overload_repeat

    @contextlib.contextmanager
    def start_server(*_: Any) -> Any:
        yield overload.Server("sluice", "http://127.0.0.1:1", "m", False, [argparse.Namespace(pid=os.getpid())])

    async def sleep(_: float) -> None:
        return None

    monkeypatch.setattr(overload_repeat.ov, "start_server", start_server)
    monkeypatch.setattr(overload_repeat.ov, "lone_ttft", lone_ttft)
    monkeypatch.setattr(overload_repeat.ov, "load_step", load_step)
    monkeypatch.setattr(overload_repeat.asyncio, "sleep", sleep)
    args = dict(sluice_args="", rate=40.0, lone_ttft=0.012, mult=3.0, seeds=[0, 1], step_s=1.0, max_tokens=16,
                timeout=5.0, timeline=False, pause_s=0.0, concurrency=8, calibrate_s=1.0, neighbour=0.0)  # fmt: skip
    return argparse.Namespace(**{**args, **over})


def test_overload_repeat_probes_the_lone_ttft_before_each_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(host-drift): each run is preceded by a lone-TTFT probe on the idle server, tabulated beside
    it; the SLA targets stay those of the start."""
    import argparse
    import asyncio

    from benchmarks import overload, overload_repeat

    calls: list[str] = []
    probes = iter([0.011, 0.019, 0.023, 0.031])

    async def lone_ttft(*_: Any) -> float:
        calls.append("lone")
        return next(probes)

    async def load_step(*_: Any) -> tuple[list[Any], list[float]]:
        calls.append("run")
        return [overload.Record("p0", 0.1, 200, ttft=0.03), overload.Record("p0", 0.2, 200, ttft=0.09)], [0.01]

    args = _fake_overload_repeat(monkeypatch, lone_ttft, load_step)
    out = asyncio.run(overload_repeat.run(args))
    assert calls == ["lone", "run", "lone", "run"], "a given lone TTFT: a probe before each run"
    assert out["targets_s"]["p0"] == pytest.approx(0.048), "the targets derive from the given lone TTFT only"
    assert [r["lone_ttft_before_s"] for r in out["runs"]] == [0.011, 0.019]
    rows = overload_repeat.table(out).splitlines()
    assert "lone TTFT before (ms)" in rows[0]
    assert rows[2].startswith("| 1 | 0 | 11.0 | 50.0% | 0.0% |") and rows[3].startswith("| 2 | 1 | 19.0 | 50.0% |"), rows

    calls.clear()
    out = asyncio.run(overload_repeat.run(argparse.Namespace(**{**vars(args), "lone_ttft": 0.0})))
    assert calls == ["lone", "run", "lone", "run"], "measured at the start: that measurement is the first run's probe"
    assert out["targets_s"]["p0"] == pytest.approx(0.092), "the targets derive from the start's lone TTFT only"
    assert [r["lone_ttft_before_s"] for r in out["runs"]] == [0.023, 0.031]


def test_overload_repeat_reports_the_engines_time_and_token_cost_by_kind_of_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(step-kinds): a run's share of the engine in each kind of step, and ms per batched token in it."""
    import asyncio

    from benchmarks import overload, overload_repeat

    sec, tok = (f"{m}{{kind=\"{k}\"}}" for m, k in zip(overload_repeat._BY_KIND, ("normal", "normal")))
    before = {sec: 1.0, tok: 100.0, 'sluice_engine_busy_seconds_total{kind="nested"}': 0.5,
              'sluice_engine_batched_tokens_by_kind_total{kind="nested"}': 40.0,
              'sluice_engine_steps_by_kind_total{kind="nested"}': 10.0}  # fmt: skip
    after = {sec: 7.0, tok: 10100.0, 'sluice_engine_busy_seconds_total{kind="nested"}': 3.5,
             'sluice_engine_batched_tokens_by_kind_total{kind="nested"}': 4040.0,
             'sluice_engine_steps_by_kind_total{kind="nested"}': 260.0}  # fmt: skip
    kinds = overload_repeat.step_kinds(before, after, wall=10.0)
    assert kinds["normal"] == {"busy_share": pytest.approx(0.6), "ms_per_token": pytest.approx(0.6), "steps_per_s": 0.0}
    assert kinds["nested"] == {"busy_share": pytest.approx(0.3), "ms_per_token": pytest.approx(0.75),
                               "steps_per_s": pytest.approx(25.0)}  # fmt: skip
    assert kinds["express"] == {"busy_share": 0.0, "ms_per_token": 0.0, "steps_per_s": 0.0}, "no express step: nothing to show"
    assert overload_repeat._kinds_cell(kinds, "steps_per_s") == "0.0 / 0.0 / 25.0"
    assert overload_repeat.step_kinds(before, {}, 10.0) == {}, "a server without these metrics"

    pool_before = {"sluice_engine_pool_wait_seconds_total": 2.0, "sluice_engine_pool_stalls_total": 100.0,
                   "sluice_engine_pool_stall_seconds_total": 1.0}  # fmt: skip
    pool_after = {"sluice_engine_pool_wait_seconds_total": 3.5, "sluice_engine_pool_stalls_total": 850.0,
                  "sluice_engine_pool_stall_seconds_total": 2.2}  # fmt: skip
    assert overload_repeat.pool_waits(pool_before, pool_after, wall=10.0) == {
        "wait_share": pytest.approx(0.15), "stalls_per_s": pytest.approx(75.0), "stall_share": pytest.approx(0.12)}
    assert overload_repeat.pool_waits(pool_before, {}, 10.0) == {}, "a server without them"
    before, after = {**before, **pool_before}, {**after, **pool_after}
    totals = iter([before, after, {}, {}])

    async def step_totals(_: str) -> dict[str, float]:
        return next(totals)

    async def lone_ttft(*_: Any) -> float:
        return 0.012

    async def load_step(*_: Any) -> tuple[list[Any], list[float]]:
        return [overload.Record("p0", 0.1, 200, ttft=0.03)], [0.01]

    monkeypatch.setattr(overload_repeat, "_step_totals", step_totals)
    out = asyncio.run(overload_repeat.run(_fake_overload_repeat(monkeypatch, lone_ttft, load_step)))
    rows = overload_repeat.table(out).splitlines()
    assert "ms per batched token: normal / express / nested" in rows[0]
    assert "| 0.60 / - / 0.75 | 0.0 / 0.0 / " in rows[2], rows[2]
    assert "pool waits: share of the run / stalls a second / stalls' share" in rows[0]
    assert rows[3].endswith("| - | - | - | - |"), "the second run's server exported nothing"


def test_overload_repeat_children_include_the_process_itself() -> None:
    import os

    from benchmarks import overload_repeat

    assert overload_repeat._children(os.getpid())[0] == os.getpid()
    assert overload_repeat._cpu_seconds(os.getpid()) > 0.0


def test_kernel_paths_keeps_each_columns_best_round_and_compares_with_the_first_plan() -> None:
    from benchmarks import kernel_paths as kp

    best: dict[str, dict[str, float]] = {}
    a = dict(zip(kp.COLUMNS, [8.0, 12.0, 16.0, 50.0]))
    kp.keep_best(best, "auto", a)
    kp.keep_best(best, "auto", dict(zip(kp.COLUMNS, [9.0, 11.0, 17.0, 52.0])))
    kp.keep_best(best, "avx2", dict(zip(kp.COLUMNS, [10.0, 22.0, 34.0, 100.0])))
    assert best["auto"] == dict(zip(kp.COLUMNS, [8.0, 11.0, 16.0, 50.0]))
    rows = kp.table_rows(["auto", "avx2"], best, {"auto": "amx+avx512vnni", "avx2": "avx2"})
    assert rows[0] == ["auto", "amx+avx512vnni", "8.00", "11.00", "16.00", "50.00", "1.00x"]
    assert rows[1][-1] == "2.00x"


def test_overload_summary_counts_sheds_by_code_and_mid_stream_errors_apart() -> None:
    from benchmarks import overload

    targets = {"p0": 0.1, "p1": 2.0, "p2": 5.0}
    records = [
        overload.Record("p0", 0.1, 200, ttft=0.05, answered=0.01),
        overload.Record("p1", 0.2, 429, answered=0.004, code="slo_unattainable", retry_after="2"),
        overload.Record("p2", 0.3, 429, answered=10.02, code="expired", retry_after="1"),
        # started, then shed mid-stream (NOTE(stalled)): HTTP 200, an error event, no 429
        overload.Record("p2", 0.4, 200, ttft=0.3, answered=0.3, error="error event in stream", code="expired"),
        overload.Record("p2", 0.5, 0, error="timeout"),
    ]
    s = overload.summarize(records, [0.01], targets, 1.0)
    assert s["shed_by_code"] == {"expired": {"count": 1, "answer_p99_s": 10.02},
                                 "slo_unattainable": {"count": 1, "answer_p99_s": 0.004}}  # fmt: skip
    assert s["stream_errors_by_code"] == {"expired": 1}
    assert s["classes"]["p2"]["shed"] == 1 and s["classes"]["p2"]["errors"] == 2 and s["num_timeouts"] == 1
    assert s["shed_within_50ms"] == 0.5
    s["steal_share"] = 0.045  # NOTE(steal): each step's row says how much CPU the host took
    header, _, row = overload.table({"sluice": {"steps": {"3": s}}}).splitlines()
    assert header.rstrip(" |").endswith("CPU stolen (%)") and row.rstrip(" |").endswith("| 4.5")


def test_overload_measures_the_capacity_before_the_lone_p0_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(capacity-first): the lone P0s' target would bound sluice's batches during the closed loop."""
    import argparse
    import asyncio

    from benchmarks import overload

    calls: list[str] = []

    async def capacity(*_: Any) -> float:
        calls.append("capacity")
        return 10.0

    async def lone_ttft(*_: Any) -> float:
        calls.append("lone_ttft")
        return 0.02

    async def server_sums(*_: Any) -> dict[str, float]:
        return {}

    async def load_step(_server: Any, rate: float, *_: Any) -> tuple[list[Any], list[float]]:
        calls.append(f"load_step {rate:g}")
        return [overload.Record("p0", 0.1, 200, ttft=0.05)], [0.01]

    for name, fn in {"capacity": capacity, "lone_ttft": lone_ttft, "server_sums": server_sums,
                     "load_step": load_step}.items():  # fmt: skip
        monkeypatch.setattr(overload, name, fn)
    args = argparse.Namespace(concurrency=4, calibrate_s=1.0, max_tokens=4, seed=0, loads=(3.0,), step_s=1.0,
                              timeout=5.0, pause_s=0.0)  # fmt: skip
    out = asyncio.run(overload.run_server(overload.Server("sluice", "http://127.0.0.1:1", "m", False), args))
    assert calls == ["capacity", "lone_ttft", "load_step 30"]
    assert out["capacity_rps"] == 10.0 and out["lone_ttft_s"] == 0.02


def test_sparse_p0_runs_a_p2_alone_phase_before_each_p0_rate_and_tabulates_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round compares P2 alone with P2 beside sparse P0, on one server, after the last phase's target passed."""
    import argparse
    import asyncio
    import contextlib

    from benchmarks import sparse_p0

    calls: list[tuple[float, float]] = []
    pauses: list[float] = []

    @contextlib.contextmanager
    def start_server(*_: Any) -> Any:
        yield sparse_p0.ov.Server("sluice", "http://127.0.0.1:1", "m", False)

    async def lone_ttft(*_: Any) -> float:
        return 0.02

    async def phase(_server: Any, _users: int, seconds: float, rate: float, target: float, _seed: int) -> dict[str, Any]:
        calls.append((rate, target))
        return {"p0_rate": rate, "p2_rps": 30.0 - rate, "p0_sent": 4 if rate else 0, "p0_within": 3 if rate else 0,
                "p0_refused": 1 if rate else 0, "p0_ttft_p50_s": 0.03 if rate else None,
                "p0_ttft_max_s": 0.2 if rate else None}  # fmt: skip

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(sparse_p0.ov, "start_server", start_server)
    monkeypatch.setattr(sparse_p0.ov, "lone_ttft", lone_ttft)
    monkeypatch.setattr(sparse_p0, "phase", phase)
    monkeypatch.setattr(sparse_p0.asyncio, "sleep", sleep)
    args = argparse.Namespace(sluice_args="", users=8, phase_s=5.0, p0_rates=(0.5, 2.0), rounds=2)
    out = asyncio.run(sparse_p0.run(args))
    assert [r for r, _ in calls] == [0.0, 0.0, 0.5, 2.0, 0.0, 0.5, 2.0], "a warm-up, then P2 alone first in each round"
    assert all(t == pytest.approx(0.08) for _, t in calls[1:]), "P0's target is 4x the lone TTFT"
    assert len(pauses) == 6 and min(pauses) > sparse_p0.TARGET_MEMORY_S, "each phase starts once the last one's target passed"
    text = sparse_p0.table(out)
    assert "| 1 | none | 30.0 | - | - | - |" in text and "| 2 | 2/s | 28.0 | 3/4 | 1 | 30 / 200 |" in text


def test_prediction_error_table_shows_the_backlog_and_the_share_within() -> None:
    from benchmarks import prediction_error

    backlog = [0, 1, 5, 9, 12, 14, 18, 20, 23, 27]  # ten waves sent: the table shows the first eight
    run = {"gap": 30, "seed": 2, "backlog": backlog, "within": 20, "total": 32, "median_error": 0.5,
           "measured_ttft_p50_s": 0.264, "step_time_s": 0.0348, "step_base_s": 0.00397, "step_per_token_s": 481e-6}  # fmt: skip
    rows = prediction_error.table([run]).splitlines()
    assert "not started at waves 1-8" in rows[0] and "waves sent" in rows[0]
    assert rows[2] == "| 30 | 2 | 0 1 5 9 12 14 18 20 | 10 | 20/32 | 50% | 264 | 34.8 | 3.97 / 481 |", rows


def test_cuda_check_runs_its_checks_on_the_cpu_and_refuses_cuda_in_one_line_without_a_device(tmp_path: Path) -> None:
    import torch

    script = str(ROOT / "benchmarks" / "cuda_check.py")
    made = subprocess.run([sys.executable, script, "--make-models", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--models", str(tmp_path), "--seeds", "0"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in ("llama", "qwen2"):
        r = result["correctness"][arch]
        assert r["tokens_equal"] == 8 and r["max_logit_diff"] < 1e-3 and r["sampled_seeded_equal"], r
    assert result["prediction"][0]["total"] == 32
    if not torch.cuda.is_available():
        bad = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
            "cuda_check: no CUDA device here (torch.cuda.is_available() is False); try --device cpu"), bad.stderr


def test_overload_repeat_runs_a_neighbour_during_each_run_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(neighbour): a busy process while each load step runs, gone after it; its CPU is reported."""
    import argparse
    import asyncio
    import contextlib

    from benchmarks import overload, overload_repeat

    seen: list[subprocess.Popen[bytes]] = []

    async def lone_ttft(*_: Any) -> float:
        return 0.012

    real_neighbour = overload_repeat.neighbour

    @contextlib.contextmanager
    def neighbour(duty: float, max_s: float) -> Any:
        assert duty == 0.5 and max_s > 1.0
        with real_neighbour(duty, max_s) as proc:
            seen.append(proc)
            yield proc

    async def load_step(*_: Any) -> tuple[list[Any], list[float]]:
        assert seen and seen[-1].poll() is None, "the neighbour runs while the load does"
        t = time.monotonic()
        while overload_repeat._cpu_seconds(seen[-1].pid) < 0.05 and time.monotonic() - t < 10.0:
            await asyncio.sleep(0.02)
        return [overload.Record("p0", 0.1, 200, ttft=0.03), overload.Record("p0", 0.2, 429)], [0.01]

    args = _fake_overload_repeat(monkeypatch, lone_ttft, load_step, neighbour=0.5)
    monkeypatch.setattr(overload_repeat, "neighbour", neighbour)
    out = asyncio.run(overload_repeat.run(args))
    assert len(seen) == 2 and all(p.poll() is not None for p in seen), "one neighbour per run, each stopped after it"
    assert all(r["cpu_neighbour"] > 0.0 for r in out["runs"]), out["runs"]
    assert all(r["p0_refused"] == 0.5 for r in out["runs"]), "a refused P0 is a miss, and counted as refused"
    assert "CPU neighbour" in overload_repeat.table(out).splitlines()[0]
    with real_neighbour(0.0, 1.0) as none:
        assert none is None, "duty 0: no neighbour"
    with pytest.raises(argparse.ArgumentTypeError):
        overload_repeat._duty("1.0")


# ---------------------------------------------------------------- long_context


def test_long_context_keeps_each_cases_best_round_and_compares_with_the_base() -> None:
    from benchmarks import long_context as lc

    rounds = [{"1 x 2048": [14.0, 9.0], "2 x 2048": [19.0, 14.0]}, {"1 x 2048": [12.0, 7.5], "2 x 2048": [20.0, 13.0]}]
    best = lc.best_of(rounds)
    assert best == {"1 x 2048": [12.0, 7.5], "2 x 2048": [19.0, 14.0]}, "the fastest step's round, attention with it"
    rows = lc.table_rows(best, {"1 x 2048": [15.0, 10.0], "2 x 2048": [19.0, 14.5]})
    assert rows[0] == ["1 x 2048", "12.00", "7.50", "62%", "15.00", "10.00", "0.80x"]
    assert rows[1][-1] == "1.00x" and len(lc.table_rows(best, None)[0]) == 4


@pytest.mark.parametrize(("args", "message"), [(["--base", "/nonexistent"], "not a sluice checkout"),
                                               (["--rounds", "0"], "at least 1")])  # fmt: skip
def test_long_context_refuses_bad_arguments_in_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_context.py"), *args, "--no-write"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_hybrid_kv_arms_differ_only_in_the_pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/hybrid_kv.py: its one-pool arm is the engine without the sliding pool, and on the same budget
    the hybrid arm's global layers hold more context, with the same greedy tokens."""
    from model_factory import make_tiny_model_dir

    from benchmarks import hybrid_kv

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model_dir(tmp_path / "hybrid", "qwen2", seed=3, num_hidden_layers=3, use_sliding_window=True,
                                sliding_window=32, max_window_layers=1)  # fmt: skip
    prompts = [[5 + i + j for j in range(70)] for i in range(3)]
    kv = 64 * 3 * 2 * 16 * 2 * 16 * 4  # 64 blocks of the three layers in one pool
    one, hyb = (hybrid_kv.run_arm(str(model), arm, kv, 3, prompts, 8) for arm in ("one pool", "hybrid"))
    assert (one["sliding_layers"], one["layers_a_block"], one["blocks"]) == (0, 3, 64)
    assert (hyb["sliding_layers"], hyb["layers_a_block"], hyb["blocks"]) == (2, 1, 192), "one global layer a block"
    assert hyb["lone_request_tokens"] > one["lone_request_tokens"] == 64 * 16
    assert hyb["tokens"] == one["tokens"] and all(len(t) == 8 for t in hyb["tokens"].values())
    att = hybrid_kv.attention_ab(str(model), [40], rounds=1, kv_bytes=kv)
    assert [(a["prompt"], a["arm"]) for a in att] == [(40, "torch"), (40, "kernel")]
    assert all(a["same_tokens"] and a["prefill_s"] > 0 and a["decode_ms"] > 0 for a in att)


def test_float_kernel_arms_differ_only_in_the_float_path(tmp_path: Path) -> None:
    """benchmarks/float_kernel.py: the default arm runs every linear on the float kernel on the work pool,
    the BLAS arm keeps dense matrices on torch's threads; each reports every figure of the table."""
    from model_factory import make_tiny_model_dir

    from benchmarks import float_kernel

    model = make_tiny_model_dir(tmp_path / "tiny", "llama", seed=5)  # (the arms' processes share the kernel cache)
    res = float_kernel.main(["--model", str(model), "--rounds", "1", "--no-write", "--tokens", "4",
                             "--prefill-repeat", "1", "--rows", "1,5"])  # fmt: skip
    assert res["kinds"] == {"float kernel": ["fp32"], "BLAS": ["dense"]}
    assert res["pool_threads"]["BLAS"] == 0 and res["pool_threads"]["float kernel"] == (2 if (os.cpu_count() or 1) >= 2 else 0)
    for arm in ("float kernel", "BLAS"):
        assert set(res["median"][arm]) == {"layers_1_ms", "layers_5_ms", "prefill_s", "c1_tok_s", "c8_tok_s"}
        assert all(v > 0 for v in res["median"][arm].values())
    with pytest.raises(SystemExit):
        float_kernel.main(["--rows", "one"])


def test_speculative_paired_ratios_compare_each_round_with_its_own_off_run() -> None:
    from benchmarks import speculative

    runs = {"off": [100.0, 200.0, 150.0], "ngram adaptive": [99.0, 260.0, 150.0]}
    lo, mid, hi = speculative.paired_ratios(runs, "ngram adaptive")
    assert (lo, mid, hi) == pytest.approx((0.99, 1.0, 1.3)), "per round, not the ratio of medians (150/150)"
    with pytest.raises(ValueError):
        speculative.paired_ratios({"off": [1.0], "x": [1.0, 2.0]}, "x")


def test_speculative_ngram_part_reports_every_level_and_round() -> None:
    """benchmarks/speculative.py's n-gram part on SmolLM2, as small as it goes: every mode at every level,
    the same greedy tokens with and without drafts, the per-round ratios."""
    from benchmarks import speculative

    rows, out = speculative.bench_ngram("smollm2", tokens=12, levels=[1, 2], rounds=2, n_prompts=2)
    assert [(r[0], r[1]) for r in rows] == [(c, m) for c in (1, 2) for m in ("off", "off, a second engine", "ngram k=4", "ngram adaptive")]
    for key, v in out.items():
        assert v["same_tokens"] is True, key
        assert len(v["runs"]) == 2 and v["paired"][0] <= v["paired"][1] <= v["paired"][2]
    assert out["c1_off"]["paired"] == [1.0, 1.0, 1.0]
    assert out["c1_ngram k=4"]["drafted"] > 0, "a copying answer drafts"
