"""How long an engine step takes: ``a + b * tokens + c * seqs``, measured.

``StepTimeModel.observe(num_tokens, seconds, num_seqs)`` after each step; the fit is an exponentially
weighted least-squares plane over the last ~``1 / (1 - decay)`` steps, so it follows the machine (a
neighbour taking a core, a warm cache).  The engine publishes the terms in its stats; the TTFT model
(``ttft_model``) and the engine's step bounds predict from them.

NOTE(per-seq-cost): a sequence in a step costs more than its tokens (its attention over its context,
its sampling row, its bookkeeping), so a line in tokens alone, fitted on prefill-heavy steps,
mispredicts a decode-heavy wait.  The per-sequence term is fitted only while the steps' token and
sequence counts vary independently enough to tell them apart.

NOTE(flat-fit): while every step has about the same size, the terms cannot be told apart: everything
is charged per token (``a = c = 0``, ``b = mean time / mean tokens``): right at that size, on the slow
side for larger steps.  While tokens and sequences move together (decode-only steps), the line in
tokens alone carries both.
"""

from __future__ import annotations

__all__ = ["StepTimeModel"]

_SPREAD = 0.05  # a regressor's variance must exceed this x its squared mean to be fitted
_INDEPENDENT = 0.05  # the two regressors' correlation^2 must stay under 1 - this


class StepTimeModel:
    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.num_samples = 0
        # exponentially weighted sums: weight, n, s, t, n*n, s*s, n*s, n*t, s*t
        self._s = [0.0] * 9
        self.base = 0.0  # seconds per step
        self.per_token = 0.0  # seconds per batched token
        self.per_seq = 0.0  # seconds per scheduled sequence

    def observe(self, num_tokens: int, seconds: float, num_seqs: int = 0) -> None:
        if num_tokens <= 0 or seconds <= 0.0:
            return
        d, n, q, t = self.decay, float(num_tokens), float(num_seqs), seconds
        s = self._s
        for i, v in enumerate((1.0, n, q, t, n * n, q * q, n * q, n * t, q * t)):
            s[i] = s[i] * d + v
        self.num_samples += 1
        w = s[0]
        mn, mq, mt = s[1] / w, s[2] / w, s[3] / w
        vnn, vqq, vnq = s[4] / w - mn * mn, s[5] / w - mq * mq, s[6] / w - mn * mq
        vnt, vqt = s[7] / w - mn * mt, s[8] / w - mq * mt
        spread_n = vnn > _SPREAD * mn * mn
        spread_q = vqq > _SPREAD * mq * mq and mq > 0.0
        det = vnn * vqq - vnq * vnq
        if spread_n and spread_q and det > _INDEPENDENT * vnn * vqq:
            b = (vnt * vqq - vqt * vnq) / det
            c = (vqt * vnn - vnt * vnq) / det
            a = mt - b * mn - c * mq
            if b > 0.0 and c >= 0.0 and a >= 0.0:
                self.base, self.per_token, self.per_seq = a, b, c
                return
        self.per_seq = 0.0
        if spread_n:  # sizes spread enough to separate a and b
            b = vnt / vnn
            a = mt - b * mn
            if b > 0.0 and a >= 0.0:
                self.base, self.per_token = a, b
                return
        self.base, self.per_token = 0.0, mt / mn  # NOTE(flat-fit); also a < 0 or b <= 0 (noise)

    def predict(self, num_tokens: int, num_seqs: int = 0) -> float:
        return self.base + self.per_token * num_tokens + self.per_seq * num_seqs
