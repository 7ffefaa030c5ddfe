"""Calibration: run the float32 reference model on bundled English text and measure quantization error.

    tokens = calibration_tokens(tokenizer)                 # the last 256 tokens of data/english.txt
    ref = ReferenceModel(raw_cfg, float_sd, len(tokens))   # sluice's LlamaForCausalLM, float32
    errors = ref.linear_errors(tokens, candidates)         # {hf name: ||X Wq^T - X W^T|| / ||X W^T||}
    base = ref.logprobs(tokens)                            # (T, vocab)
    ref.load(mixed_sd); kl = mean_kl(base, ref.logprobs(tokens))

The per-linear error is measured on that linear's *own float input* X (the
activations of the float model), so layers are scored independently of each
other; the model-level error is the final-logit KL divergence of a complete
mixed-precision model, which sees every interaction.

NOTE(capture): the forward pass is sluice's own ``LlamaForCausalLM`` (weights
fused into ``qkv`` / ``gate_up``); each GEMM's input is caught with a
``TorchFunctionMode`` that watches ``F.linear`` calls on the model's weight
parameters, so calibration follows whatever the model does without a second
copy of the forward pass.  Weights enter as their exact float32 values
(``QuantWeight.dequantize()``): the figures measure weight quantization only,
not the kernels' int8 activation rounding.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from sluice.kernels.qweight import QuantWeight

__all__ = [
    "english_text",
    "calibration_tokens",
    "eval_tokens",
    "ReferenceModel",
    "mean_kl",
    "CALIBRATION_TOKENS",
]

CALIBRATION_TOKENS = 256  # "a few hundred tokens": the tail of english.txt
_TAIL = 512  # calibration never reads before the last 512 tokens; evaluation never reads them


@functools.lru_cache(maxsize=1)
def english_text() -> str:
    """The bundled English prose (see data/README.md for its origin)."""
    return resources.files("sluice.models.quant").joinpath("data/english.txt").read_text(encoding="utf-8")


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False) if hasattr(tokenizer, "encode") else tokenizer(text)
    return [int(i) for i in ids]


def calibration_tokens(tokenizer: Any, n: int = CALIBRATION_TOKENS) -> list[int]:
    ids = _encode(tokenizer, english_text())
    return ids[-min(n, _TAIL):]


def eval_tokens(tokenizer: Any, n: int) -> list[int]:
    """Up to ``n`` tokens from the start of the text, never overlapping the calibration tail."""
    ids = _encode(tokenizer, english_text())
    return ids[: max(0, min(n, len(ids) - _TAIL))]


def causal_attention(scale: float) -> Any:
    """An ``AttentionFn`` for one contiguous sequence starting at position 0 (no KV cache)."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        # q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D); options: window, softcap, scale (models/attention.py)
        if options:
            from sluice.models.attention import masked_attention

            return masked_attention(q, k, v, **options)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
        )
        return o.transpose(0, 1)

    return attend


def _dense(w: QuantWeight | torch.Tensor) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantWeight) else w.to(torch.float32)


class _LinearTap(TorchFunctionMode):
    """Calls ``on_linear(watched[id(weight)], (x, weight, bias), out)`` for every ``F.linear``
    whose weight is one of ``watched``."""

    def __init__(self, watched: dict[int, Any], on_linear: Any):
        super().__init__()
        self.watched, self.on_linear = watched, on_linear

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.linear and len(args) >= 2 and id(args[1]) in self.watched:
            self.on_linear(self.watched[id(args[1])], tuple(args) + ((kwargs or {}).get("bias"),) * (len(args) == 2), out)
        return out


class ReferenceModel:
    """sluice's float32 ``LlamaForCausalLM`` over a HF-named state dict, run on one sequence."""

    def __init__(self, raw_cfg: dict[str, Any], sd: dict[str, Any], max_positions: int):
        from sluice.models.config import ModelConfig
        from sluice.models.llama import LlamaForCausalLM

        self.cfg = ModelConfig.from_hf(raw_cfg)
        self.model = LlamaForCausalLM(self.cfg, dtype=torch.float32, max_positions=max(1, max_positions)).eval()
        self.attention = causal_attention(self.cfg.head_dim**-0.5)
        self.load(sd)

    def load(self, sd: dict[str, Any]) -> None:
        """(Re)load all weights; ``QuantWeight`` values enter as their exact float32 dequantization.

        NOTE(ref-owns): the model owns its weights.  A float32 weight the loader keeps as it is (a linear
        not fused with another, the embedding) would otherwise be the caller's tensor, and ``assign``,
        which writes a quantized value into the model in place, would write it into the caller's float
        state dict too: a layer the fallback then keeps "in float" would hold its quantized values, and
        only on the start that calibrated (a later start reads the choice from the cache)."""
        self.model.load_hf_state_dict({k: _dense(v) for k, v in sd.items()})
        theirs = {v.untyped_storage().data_ptr() for v in sd.values() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            for mod in self.model.modules():
                for name, t in [*mod.named_buffers(recurse=False), *mod.named_parameters(recurse=False)]:
                    if t is not None and t.untyped_storage().data_ptr() in theirs:  # a new tensor, not new data
                        setattr(mod, name, torch.nn.Parameter(t.clone(), t.requires_grad) if isinstance(t, torch.nn.Parameter) else t.clone())

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF name -> (sluice weight tensor, first row, end row): q/k/v live in ``qkv``, gate/up in ``gate_up``.

        The reference model's linears are full precision, one dense matrix each (``Linear.dense_0``).
        """
        c, m = self.cfg, cast(Any, self.model)

        def w(lin: Any) -> torch.Tensor:
            return cast(torch.Tensor, lin.dense_0)

        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        out: dict[str, tuple[torch.Tensor, int, int]] = {"model.embed_tokens.weight": (w(m.embed), 0, c.vocab_size)}
        if m.lm_head is not None:
            out["lm_head.weight"] = (w(m.lm_head), 0, c.vocab_size)
        for i, layer in enumerate(self.model.layers):
            pre, lay = f"model.layers.{i}.", cast(Any, layer)
            rows = {
                "self_attn.q_proj": (w(lay.qkv), 0, q),
                "self_attn.k_proj": (w(lay.qkv), q, q + kv),
                "self_attn.v_proj": (w(lay.qkv), q + kv, q + 2 * kv),
                "self_attn.qkv_proj": (w(lay.qkv), 0, q + 2 * kv),  # phi3's fused projections
                "self_attn.o_proj": (w(lay.o_proj), 0, c.hidden_size),
            }
            mlps = {"mlp.": (lay.gate_up, lay.down, inter)} if lay.moe is None else {
                f"mlp.experts.{e}.": (ex.gate_up, ex.down, c.moe_intermediate_size) for e, ex in enumerate(lay.moe.experts)
            }  # fmt: skip
            for mp, (gate_up, down, n) in mlps.items():
                rows[mp + "gate_proj"] = (w(gate_up), 0, n)
                rows[mp + "up_proj"] = (w(gate_up), n, 2 * n)
                rows[mp + "gate_up_proj"] = (w(gate_up), 0, 2 * n)
                rows[mp + "down_proj"] = (w(down), 0, c.hidden_size)
            out.update({pre + k + ".weight": v for k, v in rows.items()})
        return out

    def assign(self, updates: dict[str, Any]) -> None:
        """Overwrite only the given weights (linears or head) in place, e.g. to switch a layer
        between its float and quantized values without reloading the model."""
        targets = self._targets()
        with torch.no_grad():
            for name, w in updates.items():
                param, r0, r1 = targets[name]
                param.data[r0:r1].copy_(_dense(w))

    @torch.inference_mode()
    def hidden(self, tokens: list[int]) -> torch.Tensor:  # (T, hidden), final-normed
        ids = torch.tensor(tokens, dtype=torch.long)
        return self.model(ids, torch.arange(len(tokens)), self.attention)

    @torch.inference_mode()
    def logprobs(self, tokens: list[int], chunk: int = 512) -> torch.Tensor:  # (T, vocab) float32
        h = self.hidden(tokens)
        return torch.cat([torch.log_softmax(self.model.compute_logits(h[i : i + chunk]), -1) for i in range(0, len(tokens), chunk)])

    @torch.inference_mode()
    def linear_errors(self, tokens: list[int], candidates: dict[str, QuantWeight | torch.Tensor]) -> dict[str, float]:
        """Relative output error ``||X Wq^T - X W^T||_F / ||X W^T||_F`` of each candidate, on the
        float model's own input X to that linear (the model must hold the float weights)."""
        by_param: dict[int, list[tuple[str, int, int]]] = {}
        for name, (param, r0, r1) in self._targets().items():
            if name in candidates:
                by_param.setdefault(id(param), []).append((name, r0, r1))
        sq: dict[str, list[float]] = {}  # name -> [sum of squared error, sum of squared output]

        def on_linear(parts: list[tuple[str, int, int]], args: tuple[Any, ...], out: torch.Tensor) -> None:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else None
            for name, r0, r1 in parts:
                ref = out[..., r0:r1] if bias is None else out[..., r0:r1] - bias[r0:r1]
                diff = F.linear(x, _dense(candidates[name]) - weight[r0:r1])
                acc = sq.setdefault(name, [0.0, 0.0])
                acc[0] += float(diff.double().pow(2).sum())
                acc[1] += float(ref.double().pow(2).sum())

        with _LinearTap(by_param, on_linear):
            h = self.hidden(tokens)
            self.model.compute_logits(h)  # the LM head, when it is a candidate
        missing = [n for n in candidates if n not in sq and ".experts." not in n]  # an expert may get no token
        sq.update({n: [0.0, 0.0] for n in candidates if n not in sq})
        if missing:
            raise RuntimeError(f"calibration saw no F.linear call for {missing[:3]}: the model's forward changed?")
        return {n: (e / r) ** 0.5 if r > 0 else (0.0 if e == 0 else float("inf")) for n, (e, r) in sq.items()}


def mean_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean over positions of KL(p_ref || p) in nats, from two (T, vocab) log-probability tensors."""
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
