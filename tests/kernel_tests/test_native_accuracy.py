"""SmolLM2's GGUF served natively (Q4_1/Q8_0 weights, int8 activations) against its fp32
dequantization: next-token distributions on bundled English text stay close (a smoke test of
benchmarks/quant_accuracy.py, which measures 20k tokens)."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels.autotune import plan_kernels
from sluice.models.loader import load_model, resolve_model
from sluice.models.quant.calibrate import causal_attention, eval_tokens
from sluice.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    attn = causal_attention(model.cfg.head_dim**-0.5)  # type: ignore[operator,union-attr]
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        return torch.log_softmax(model.compute_logits(h).double(), -1)  # type: ignore[operator]


def test_native_gguf_stays_close_to_its_fp32_dequantization() -> None:
    src = resolve_model("smollm2")
    ids = eval_tokens(load_tokenizer(src), 1024)
    ref = load_model(src, torch.float32, quantization="none")
    native = load_model(src, torch.float32, quantization="auto")
    plan_kernels(native)
    assert native.embed.is_quantized and native.layers[0].fused, "served as Q8_0/Q4_1 through the fused C++ path"
    a, b = logprobs(ref, ids), logprobs(native, ids)
    kl = float((a.exp() * (a - b)).sum(-1).mean())
    top1 = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    tgt = torch.tensor(ids[1:])
    ppl_ref = float(torch.exp(-a[:-1].gather(1, tgt[:, None]).mean()))
    ppl_nat = float(torch.exp(-b[:-1].gather(1, tgt[:, None]).mean()))
    # measured on 4k tokens: KL 0.003, top-1 97%, perplexity +0.04%
    assert kl < 0.02, f"next-token KL {kl:.4f} nats"
    assert top1 > 0.9, f"top-1 agreement {top1:.3f}"
    assert abs(ppl_nat / ppl_ref - 1) < 0.01, f"perplexity {ppl_nat:.3f} vs {ppl_ref:.3f}"
