"""Rotary position embeddings: the tables (every rope scaling sluice reads) and their application.

    cos, sin = rope_tables(cfg, max_positions)       # (P, rotary_dim) each, float32
    rope = Rope(positions, cos, sin)                  # one step's positions; gathered once
    q = apply_rope(q, *rope.gathered())               # HF's rotate-half layout, partial rotary too
"""

from __future__ import annotations

import torch

from sluice.models.config import ModelConfig

__all__ = ["Rope", "apply_rope", "rope_tables"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, H, D); cos/sin: (T, 1, R) with the halves duplicated (HF layout), R <= D (partial rotary)
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(
    cfg: ModelConfig, max_positions: int, device: torch.device | str | None = None, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: (max_positions, rotary_dim) float32 each
    inv_freq = torch.tensor(cfg.rope_inv_freq(local), dtype=torch.float32, device=device)
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # (P, R/2)
    rs = None if local else cfg.rope_scaling
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    # NOTE(dynamic-rope): transformers rescales the rotations (dynamic: the base; phi3's longrope:
    # the long factors) of the whole sequence once it outgrows the trained context, so every cached
    # key's rotation would change.  Here each position keeps one rotation, fixed once written: the
    # same as transformers' inside the trained context; past it, position p gets what transformers
    # uses for a sequence of p + 1 tokens (vLLM's longrope mixes the two sets the same way).
    if kind == "longrope" and max_positions > cfg.rope_original_context():
        old = cfg.rope_original_context()
        long_inv = torch.tensor(cfg.longrope_inv_freq("long_factor"), dtype=torch.float32, device=device)
        freqs[old:] = torch.outer(pos[old:], long_inv)
    if kind == "dynamic":
        old = int(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings)  # type: ignore[union-attr]
        factor, dim = float(rs["factor"]), cfg.rotary_dim  # type: ignore[index]
        if max_positions > old:
            p = torch.arange(old, max_positions, dtype=torch.float64)
            base = cfg.rope_theta * ((factor * (p + 1) / old) - (factor - 1)) ** (dim / (dim - 2))  # (P',)
            exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
            inv = (1.0 / base.unsqueeze(1) ** exps.unsqueeze(0)).float()  # (P', R/2)
            freqs[old:] = p.float().unsqueeze(1).to(freqs.device) * inv.to(freqs.device)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, R)
    scale = 1.0 if local else cfg.rope_attention_factor()
    return emb.cos() * scale, emb.sin() * scale


class Rope:
    """Rotary tables and the step's positions; the torch path gathers them once per step."""

    def __init__(
        self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, local: Rope | None = None
    ):
        self.positions, self.cos_table, self.sin_table = positions, cos_table, sin_table
        self.local = local  # gemma3: the sliding layers' own tables
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:  # (T, 1, D) each
        if self._gathered is None:
            self._gathered = (
                self.cos_table[self.positions].unsqueeze(1),
                self.sin_table[self.positions].unsqueeze(1),
            )
        return self._gathered
