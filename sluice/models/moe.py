"""Mixture-of-experts MLP: a router picks k experts per token, each expert runs once over its rows.

    moe = MoEBlock(cfg)                 # cfg.num_experts experts of cfg.moe_intermediate_size
    moe.load(router_w, [(gate_e, up_e, down_e) for e ...], invariant)   # float tensors or QuantWeight
    y = moe(x)                          # (T, hidden) -> (T, hidden)

Routing (qwen3_moe, olmoe, mixtral alike, as transformers computes it):
``p = softmax(x @ Wr^T)`` in float32, the top-k of ``p``, renormalised to sum
to 1 when the model says so (``norm_topk_prob``; mixtral always).

NOTE(grouped-experts): the T*k (token, slot) pairs are sorted by expert
(stable, so by token within an expert); each expert with rows runs its
gate_up and down GEMMs once over the gathered rows (the quantized-linear
kernels, int8 activations).  The kernels give every row the same bits
whatever the number of rows (NOTE(batch-buckets) in kernels/linear.py), so
the grouped pass equals running each token through its experts one by one,
bit for bit; the k expert outputs of a token are then summed in slot order,
never in the order experts happened to run, so a token's output does not
depend on which other tokens share its step.

    x (T, H) --route--> ids (T, k), w (T, k)
    slots = argsort(ids.flatten())          expert 0 rows | expert 1 rows | ...
    y[slot] = down_e(act(gate_up_e(x[slot // k])))         (T*k, H)
    out[t] = sum_j w[t, j] * y[t*k + j]                     j = 0..k-1
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.linear import Linear, make_linear
from sluice.models.config import ModelConfig

__all__ = ["MoEBlock", "Expert", "route"]


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> weights (T, k) float32, expert ids (T, k) int64."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inter)
        self.down = Linear(inter, hidden)


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = Linear(h, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(h, i) for _ in range(cfg.num_experts))

    def load(self, router: Any, experts: list[tuple[Any, Any, Any]], invariant: bool) -> None:
        """Router weight (E, H) and per expert (gate (I, H), up (I, H), down (H, I)), each a float
        tensor or a ``QuantWeight``; ``invariant``: float parts on the batch-invariant kernel."""
        self.router = make_linear([router], invariant=invariant)
        for e, (gate, up, down) in enumerate(experts):
            ex = self.experts[e]
            ex.gate_up = make_linear([gate, up], invariant=invariant)
            ex.down = make_linear([down], invariant=invariant)
            for w in (gate, up, down):  # NOTE(lazy-experts) in models/quant/gguf.py: packed, so unpacked can go
                getattr(w, "release", lambda: None)()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.router(x), self.top_k, self.normalize)

    def forward(
        self,
        x: torch.Tensor,  # (T, H), the normed hidden state
        act: Any,  # (rows, 2I) -> (rows, I): SwiGLU
        residual: torch.Tensor | None = None,  # (T, H): returns residual + moe(x), written into it
    ) -> torch.Tensor:
        t, h = x.shape
        w, ids = self.route(x)  # (T, k) each
        k = self.top_k
        flat = ids.flatten()  # (T*k,)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            ex = self.experts[e]
            y[slots] = ex.down(act(ex.gate_up(x[slots // k])))
        y = y.view(t, k, h)
        wx = w.to(x.dtype)
        out = residual if residual is not None else torch.zeros(t, h, dtype=x.dtype, device=x.device)
        for j in range(k):  # slot order: the sum does not depend on the batch
            out.add_(y[:, j] * wx[:, j : j + 1])
        return out

    def forward_one_by_one(self, x: torch.Tensor, act: Any) -> torch.Tensor:
        """The reference of NOTE(grouped-experts): every (token, slot) through its expert alone."""
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for r in range(x.shape[0]):
            for j in range(self.top_k):
                ex = self.experts[int(ids[r, j])]
                yr = ex.down(act(ex.gate_up(x[r : r + 1])))
                out[r : r + 1].add_(yr * w[r, j].to(x.dtype))
        return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
