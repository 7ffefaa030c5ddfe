"""Token sampling for a batch of rows, each with its own ``SamplingParams``.

Order of logit processing (per row): repetition / frequency / presence
penalties -> min_tokens masking of EOS and stop ids -> the grammar's token
mask (structured outputs) -> logprobs (of the penalised, masked distribution,
before temperature) -> greedy argmax, or temperature -> top-k -> top-p ->
min-p -> draw.

NOTE(grammar-mask): a constrained row's disallowed tokens get -inf before
anything reads the logits, so every sampling mode draws from the masked
distribution and its logprobs are that distribution's (alternatives the
grammar forbids are not listed).  Where the grammar allows nothing but EOS
or a stop id that min_tokens bans, the grammar wins: it would allow nothing.

NOTE(seed): a row with a seed draws from its own ``torch.Generator`` (seeded once
per request), so its output does not depend on what else is in the batch.
Rows without a seed share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sluice.engine.protocol import SamplingParams, TokenLogprobs
from sluice.kernels import ext

__all__ = ["SamplingRow", "Sampler"]


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (for repetition penalty)
    num_prompt_tokens: int
    generator: torch.Generator | None  # per-request, when seeded
    banned: list[int]  # token ids masked this step (EOS / stop ids under min_tokens)
    # the grammar's mask (waits for it): a (vocab,) float32 to add to the logits, 0 = allowed, -inf = not
    mask_bias: Callable[[], torch.Tensor] | None = None
    states: list[torch.Tensor] | None = None  # speculation: its generator's state after its draw is appended here


def _argmax_kernel() -> Any:
    try:
        return ext.load("quant").argmax_rows
    except Exception:  # noqa: BLE001 -- no compiler: torch's max(dim) does the same
        return None


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._argmax = _argmax_kernel()

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """The first index of each row's maximum (NOTE(argmax-rows) in sluice/kernels/csrc/ops.cpp)."""
        if self._argmax is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(-1) == 1:
            return self._argmax(logits).tolist()  # type: ignore[no-any-return]
        return logits.max(dim=-1).indices.tolist()  # type: ignore[no-any-return]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        # logits: (N, vocab) float32
        n = logits.shape[0]
        logits = self._penalties(logits, rows)
        for i, r in enumerate(rows):
            if r.mask_bias is not None:  # NOTE(grammar-mask)
                logits[i].add_(r.mask_bias().to(logits.device, non_blocking=True))
                if r.banned:
                    kept = logits[i, r.banned].clone()
                    logits[i, r.banned] = float("-inf")
                    if not bool(torch.isfinite(logits[i]).any()):  # the grammar allows only banned tokens: it wins
                        logits[i, r.banned] = kept
            elif r.banned:
                logits[i, r.banned] = float("-inf")
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs_all = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

        tokens = [0] * n
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        if greedy:
            # NOTE(greedy-max): the first maximal index on ties, like argmax; an all-greedy
            # batch skips the row gather (a 64-row batch of a 49k vocabulary: ~3 ms).
            sel = logits if len(greedy) == n else logits[greedy]
            ids = self.argmax(sel)
            for i, t in zip(greedy, ids):
                tokens[i] = t
        rand = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if rand:
            # on the CPU, where the generators are (seeded requests draw the same tokens on any device)
            probs = self._probs(logits[rand].cpu(), [rows[i].params for i in rand])
            for j, i in enumerate(rand):
                gen = rows[i].generator or self.generator
                # exponential race: argmax p / E with E ~ Exp(1) draws from p
                q = torch.empty_like(probs[j]).exponential_(1.0, generator=gen)
                tokens[i] = int((probs[j] / q).argmax())
                if rows[i].states is not None:  # NOTE(coupled-verification) in engine.spec.verify
                    rows[i].states.append(gen.get_state())

        out_lp: list[TokenLogprobs | None] = [None] * n
        if logprobs_all is not None:
            for j, i in enumerate(logprob_rows):
                k = rows[i].params.logprobs or 0
                lp = logprobs_all[j]
                top: list[tuple[int, float]] = []
                if k > 0:
                    v, ix = lp.topk(k)
                    top = [(t, x) for t, x in zip(ix.tolist(), v.tolist()) if x != float("-inf")]
                out_lp[i] = TokenLogprobs(tokens[i], float(lp[tokens[i]]), top)
        return tokens, out_lp

    @staticmethod
    def _penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.frequency_penalty or p.presence_penalty:
                out = r.token_ids[r.num_prompt_tokens :]
                if out:
                    ids = torch.tensor(out, dtype=torch.long, device=logits.device)
                    counts = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device).index_add_(
                        0, ids, torch.ones(len(out), dtype=logits.dtype, device=logits.device)
                    )
                    logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:  # logits on the CPU
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            for j, k in enumerate(top_ks):
                if 0 < k < logits.shape[1]:
                    kth = logits[j].topk(k).values[-1]
                    logits[j][logits[j] < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            for j, tp in enumerate(top_ps):
                if tp < 1.0:
                    sp, si = probs[j].sort(descending=True)
                    cum = sp.cumsum(0)
                    drop = (cum - sp) > tp  # keep the smallest set whose mass reaches top_p
                    sp[drop] = 0.0
                    probs[j] = torch.zeros_like(probs[j]).scatter_(0, si, sp)
        min_ps = [p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            mp = torch.tensor(min_ps, dtype=probs.dtype).unsqueeze(1)
            probs = torch.where(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
        return probs / probs.sum(dim=-1, keepdim=True)
