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

With quantized experts in float32 on the CPU the whole layer (router, top-k,
both GEMMs of every routed expert, SiLU, the weighted sum) is one C++ call,
``MoEOp`` (NOTE(grouped-op) in kernels/csrc/moe_op.cpp), with the same
arithmetic; the loop here serves every other case (float experts, other
activations, no kernels, CUDA).  The op's softmax is its own, so its routing
weights may differ from ``route``'s in the last bits: ``MoEBlock.route`` gives
the routing of whichever pass the block runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import qlinear as ql
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
        self.act = cfg.hidden_act
        self.router = Linear(h, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(h, i) for _ in range(cfg.num_experts))
        self._op: Any = None  # the C++ MoEOp (NOTE(grouped-op)), built by grouped_op()
        self._op_over: Any = None  # experts[0].gate_up.op when it was built: a new one means the linears changed
        self._python_router = False  # the op takes the router's logits (a router it cannot run itself)

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

    def grouped_op(self) -> Any:
        """The C++ op that runs this layer in one call, over the experts' packed weights and kernel
        plans as they are now (rebuilt after the linears' ops are); None where the Python loop serves:
        an expert that is not one quantized matrix per linear, an activation other than SiLU, no kernels."""
        first = self.experts[0].gate_up.op
        if first is None:
            return None
        if first is not self._op_over:
            self._op_over = first
            self._op = self._build_op()
        return self._op

    def _build_op(self) -> Any:
        if self.act != "silu":
            return None
        args = []
        for ex in self.experts:
            gate_up, down = ex.gate_up.quant_kernel_args(), ex.down.quant_kernel_args()
            if gate_up is None or down is None:
                return None
            args.append((gate_up, down))
        try:
            mod = ql.kernel_module()
        except Exception:  # noqa: BLE001 -- no kernels: the Python loop serves
            return None
        down0 = args[0][1][0]
        op = mod.MoEOp(down0.n, down0.k, self.num_experts, self.top_k, self.normalize)
        for e, linears in enumerate(args):
            for which, (pw, tops, paths) in enumerate(linears):  # 0: gate_up, 1: down
                op.set_expert(e, which, pw.data, pw.scale, pw.mins, pw.group_size, pw.mode, tops, paths)
        router = self.router.fp32_kernel_weight()
        self._python_router = router is None
        if router is not None:  # every path gives its bits: the experts' preferred one (fp32_tile.h)
            op.set_router(router, int(self.experts[0].gate_up.plan.default))
        return op

    def _op_for(self, x: torch.Tensor) -> Any:
        return self.grouped_op() if x.dtype == torch.float32 and x.device.type == "cpu" else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> weights (T, k) float32, expert ids (T, k) int64: the routing ``forward`` uses."""
        op = self._op_for(x)
        if op is not None:
            x = x if x.stride(-1) == 1 else x.contiguous()
            w, ids = op.route(x, self._logits(x))
            return w, ids
        return route(self.router(x), self.top_k, self.normalize)

    def _logits(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.router(x).float().contiguous() if self._python_router else None

    def forward(
        self,
        x: torch.Tensor,  # (T, H), the normed hidden state
        act: Any,  # (rows, 2I) -> (rows, I): SwiGLU, for the Python loop (the C++ op runs ops.cpp's silu_mul)
        residual: torch.Tensor | None = None,  # (T, H): returns residual + moe(x), written into it
    ) -> torch.Tensor:
        op = self._op_for(x)
        if op is not None and (residual is None or (residual.dtype == torch.float32 and residual.stride(-1) == 1)):
            x = x if x.stride(-1) == 1 else x.contiguous()
            return op.forward(x, self._logits(x), residual)  # type: ignore[no-any-return]
        w, ids = self.route(x)
        return self.forward_loop(x, act, w, ids, residual)

    def forward_loop(
        self, x: torch.Tensor, act: Any, w: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The grouped pass in Python (NOTE(grouped-experts)), for the routing ``w``, ``ids`` (T, k)."""
        t, h = x.shape
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
