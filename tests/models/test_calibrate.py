"""Calibration: the reference model catches every linear's input, errors are exact zeros for
unchanged weights, and ``assign`` switches single layers like a full reload does."""

from __future__ import annotations

from pathlib import Path

import torch

from sluice.models.loader import load_hf_state_dict, load_model_config, resolve_model
from sluice.models.quant import is_linear_weight
from sluice.models.quant.calibrate import ReferenceModel, calibration_tokens, eval_tokens, mean_kl
from sluice.models.quant.rtn import quantize_rtn
from sluice.models.tokenizer import load_tokenizer


def test_bundled_text_splits_calibration_from_evaluation() -> None:
    tok = load_tokenizer("smollm2")
    cal, ev = calibration_tokens(tok, 256), eval_tokens(tok, 10**6)
    assert len(cal) == 256 and len(ev) >= 25000, "the issue asks for >= 20k evaluation tokens"
    assert ev[-256:] != cal


def test_linear_errors_and_assign(tiny_llama_dir: Path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    sd = {k: v.float() for k, v in load_hf_state_dict(src.path).items()}
    tokens = list(range(100, 148))
    ref = ReferenceModel(load_model_config(src), sd, len(tokens))
    same = {n: w for n, w in sd.items() if is_linear_weight(n) or n == "lm_head.weight"}
    errors = ref.linear_errors(tokens, same)
    assert set(errors) == set(same) and all(e == 0.0 for e in errors.values()), "unchanged weights have no error"
    quant = {n: quantize_rtn(w, 4, 32) for n, w in same.items()}
    errors = ref.linear_errors(tokens, quant)
    assert all(0.0 < e < 0.5 for e in errors.values()), errors
    base = ref.logprobs(tokens)
    ref.assign(quant)
    switched = ref.logprobs(tokens)
    ref.load({**sd, **quant})
    assert torch.equal(switched, ref.logprobs(tokens)), "assign must equal a full reload"
    assert mean_kl(base, switched) > 0 and mean_kl(base, base) == 0.0


def test_assign_never_writes_into_the_callers_float_weights(tiny_llama_dir: Path) -> None:
    # NOTE(ref-owns): o_proj / down_proj / the embedding load unfused; were they the caller's tensors,
    # switching them to their quantized values would change the float state dict the fallback keeps
    src = resolve_model(str(tiny_llama_dir))
    sd = {k: v.float() for k, v in load_hf_state_dict(src.path).items()}
    before = {k: v.clone() for k, v in sd.items()}
    tokens = list(range(100, 132))
    ref = ReferenceModel(load_model_config(src), sd, len(tokens))
    quant = {n: quantize_rtn(w, 4, 32) for n, w in sd.items() if is_linear_weight(n)}
    assert any(".o_proj." in n for n in quant) and any(".down_proj." in n for n in quant)
    ref.linear_errors(tokens, quant)
    ref.assign(quant)
    changed = sorted(k for k in sd if not torch.equal(sd[k], before[k]))
    assert changed == [], f"the caller's float weights changed: {changed[:4]}"
