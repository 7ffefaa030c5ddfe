"""``/v1/models`` and ``sluice doctor`` say what the model is: its architecture, parameter count,
active parameters per token (MoE) and weight bytes (issue 56)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.obs.cli import render
from sluice.server.admin import doctor_report, model_report
from sluice.server.app import build_app
from sluice.server.config import load_settings
from tests.server.conftest import ServerThread


def hf_parameter_count(model_dir: Path) -> int:
    """transformers' own count of the checkpoint's parameters (tied embeddings counted once)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.arch_factory import make_arch_dir

    return make_arch_dir(tmp_path_factory.mktemp("moe") / "tiny-moe", "qwen3_moe")


def serve(model_dir: Path, **kw: object) -> ServerThread:
    s = load_settings(model=str(model_dir), kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=4, **kw)
    return ServerThread(build_app(s)).start(timeout=120)


@pytest.fixture(scope="module")
def dense_entry(tiny_dir: Path) -> Iterator[dict[str, object]]:
    srv = serve(tiny_dir, quantization="none")
    try:
        yield httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
    finally:
        srv.stop()


def test_v1_models_lists_architecture_and_the_counted_parameters(dense_entry: dict[str, object], tiny_dir: Path) -> None:
    n = hf_parameter_count(tiny_dir)
    assert dense_entry["architecture"] == "llama"
    assert dense_entry["num_parameters"] == n, "the parameter count must equal transformers' count of the checkpoint"
    assert dense_entry["num_active_parameters"] == n, "a dense model runs every weight for every token"
    assert dense_entry["weight_bytes"] == 4 * n, "unquantized fp32: four bytes a weight"
    assert dense_entry["quantization"] == "none"


def test_v1_models_shows_quantized_weight_bytes_and_moe_active_parameters(moe_dir: Path) -> None:
    n = hf_parameter_count(moe_dir)
    srv = serve(moe_dir, quantization="int8", quant_fallback="none")  # the tiny vocabulary gives no calibration text
    try:
        entry = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
    finally:
        srv.stop()
    import json

    cfg = json.loads((moe_dir / "config.json").read_text())
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["moe_intermediate_size"]
    idle = layers * (cfg["num_local_experts"] - cfg["num_experts_per_tok"]) * 3 * h * inter  # experts a token skips
    assert entry["architecture"] == "qwen3_moe"
    assert entry["num_parameters"] == n, "the parameter count must equal transformers' count (every expert)"
    assert entry["num_active_parameters"] == n - idle, "active: the router and the top-k experts of each layer"
    assert 0 < entry["weight_bytes"] < 2 * n, "int8 linears: about a byte a weight (fp32 embeddings and norms aside)"


def test_doctor_shows_the_configured_model(tiny_dir: Path, moe_dir: Path) -> None:
    report = doctor_report({"SLUICE_MODEL": str(moe_dir)})
    m = report["model"]
    assert m["architecture"] == "qwen3_moe" and m["num_parameters"] == hf_parameter_count(moe_dir)
    assert m["num_active_parameters"] < m["num_parameters"] and m["weight_file_bytes"] > 0
    line = next(x for x in render(_machine(report)).splitlines() if x.startswith("model"))
    assert "qwen3_moe" in line and "active per token (2 of 8 experts)" in line, line
    dense = model_report(str(tiny_dir))
    assert dense["num_parameters"] == dense["num_active_parameters"] == hf_parameter_count(tiny_dir)
    assert "active" not in _model_line(dense), "a dense model has no separate active count"


def test_doctor_goes_on_when_the_model_is_missing(tmp_path: Path) -> None:
    m = model_report(str(tmp_path / "nowhere"))
    assert "error" in m and m["name"].endswith("nowhere")
    line = next(x for x in render(_machine({"model": m})).splitlines() if x.startswith("model"))
    assert "unavailable" in line


def _model_line(m: dict[str, object]) -> str:
    return next(x for x in render(_machine({"model": m})).splitlines() if x.startswith("model"))


def _machine(extra: dict[str, object]) -> dict[str, object]:
    """The least of a doctor report that ``render`` needs, plus the probe's keys."""
    topo = {"allowed_cpus": [0], "nodes": [], "gpus": [], "nics": []}
    cpu = {"model": "cpu", "arch": "x86_64", "physical_cores": 1, "logical_cpus": 1, "usable_cpus": 1, "simd": []}
    return {"sluice": "0", "python": "3", "platform": "p", "torch": None, "gpus": [], "cpu": cpu, "topology": topo,
            "memory": {"total_gib": 1, "available_gib": 1}, "warnings": [], **extra}  # fmt: skip
