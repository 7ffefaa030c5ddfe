"""Each weight format through the whole engine: AWQ, GPTQ, GGUF (Q4_0, Q8_0, Q4_1) served natively and
int8/int4 quantized at load give logits close to the float model with the same (dequantized) weights,
and the same greedy tokens; the engine reports what it serves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from gguf_factory import write_tiny_gguf  # noqa: E402
from hub_factory import make_hub_checkpoint  # noqa: E402

PROMPT = [1, 504, 3575, 282, 4649, 314, 28, 41, 55, 907, 12, 77]


def first_logits_and_tokens(model: str, quantization: str, **kw: object) -> tuple[torch.Tensor, list[int], EngineCore]:
    eng = EngineCore(EngineConfig(model=model, quantization=quantization, kv_cache_memory=4 << 20, **kw))  # type: ignore[arg-type]
    eng.runner.capture_logits = True
    eng.add_request(EngineRequest(request_id="a", prompt_token_ids=PROMPT,
                                  sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))  # fmt: skip
    first: torch.Tensor | None = None
    toks: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks += o.new_token_ids
        if first is None and eng.runner.last_logits is not None:
            first = eng.runner.last_logits[0].clone()
    assert first is not None
    return first, toks, eng


def check_close(model: str, quantization: str, source: str, **kw: object) -> None:
    ref, ref_toks, _ = first_logits_and_tokens(model, "none")
    got, toks, eng = first_logits_and_tokens(model, quantization, **kw)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.05, f"{quantization}: first-token logits {rel:.3f} away from the float model"
    assert toks == ref_toks, "greedy tokens of the tiny (peaked) model are the float model's"
    assert source in eng.model_info.quantization, eng.model_info.quantization
    assert eng.model_info.kernel_path, "a quantized model names its kernel path"


@pytest.mark.parametrize("method,fmt", [("awq", "gemm"), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_awq_and_gptq_checkpoints_are_served_natively(tiny_llama_dir: Path, tmp_path: Path, method: str, fmt: str) -> None:
    out = tmp_path / method
    make_hub_checkpoint(tiny_llama_dir, out, method, fmt=fmt)
    check_close(str(out), "auto", method)


@pytest.mark.parametrize("linear_type,embed_type", [("Q4_0", "Q8_0"), ("Q8_0", "Q8_0"), ("Q4_1", "Q8_0")])
def test_gguf_is_served_natively(tiny_llama_dir: Path, tmp_path: Path, linear_type: str, embed_type: str) -> None:
    path = write_tiny_gguf(tiny_llama_dir, tmp_path / f"tiny-{linear_type}.gguf", linear_type, embed_type)
    check_close(str(path), "auto", f"gguf:{linear_type}")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float_checkpoint_quantized_at_load(tiny_llama_dir: Path, tmp_path: Path, mode: str) -> None:
    # the float reference of a model quantized at load is the model with its quantized
    # weights dequantized: write them as a sluice checkpoint, whose 'none' is exactly that
    from sluice.models.loader import load_model_config, resolve_model
    from sluice.models.quant import load_quantized_weights
    from sluice.models.quant.checkpoint import save_quantized

    src = resolve_model(str(tiny_llama_dir))
    sd, report = load_quantized_weights(src, mode, "none")
    out = save_quantized(tmp_path / mode, sd, load_model_config(src), report, tokenizer_source=src)
    from tests.model_factory import stable_mtimes

    stable_mtimes(out)  # one cache key for the same checkpoint run after run
    check_close(str(out), "auto", "rtn")
    # and straight from the float checkpoint: the same packed weights, the same logits
    direct, _, eng = first_logits_and_tokens(str(tiny_llama_dir), mode, quant_fallback="none")
    via_ckpt, _, _ = first_logits_and_tokens(str(out), "auto")
    assert torch.equal(direct, via_ckpt), "quantizing at load == loading the written checkpoint"
    assert eng.model_info.kernel_path
