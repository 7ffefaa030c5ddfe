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
