"""How long an engine step takes for a number of batched tokens: ``a + b * tokens``, measured.

``StepTimeModel.observe(num_tokens, seconds)`` after each step; the fit is an
exponentially weighted least-squares line over the last ~``1 / (1 - decay)``
steps, so it follows the machine (a neighbour taking a core, a warm cache).
The engine publishes ``base`` (a, seconds) and ``per_token`` (b, seconds per
token) in its stats; the API process predicts time to first token from them
(``sluice.server.admission``).

NOTE(flat-fit): while every step has about the same size, the two terms
cannot be told apart; the model then charges everything per token (``a = 0``,
``b = mean time / mean tokens``), which is right at that size and errs on the
slow side for larger steps.
"""

from __future__ import annotations

__all__ = ["StepTimeModel"]


class StepTimeModel:
    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.num_samples = 0
        # exponentially weighted sums: weight, n, t, n*n, n*t
        self._s = [0.0, 0.0, 0.0, 0.0, 0.0]
        self.base = 0.0  # seconds per step
        self.per_token = 0.0  # seconds per batched token

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0.0:
            return
        d, n, t = self.decay, float(num_tokens), seconds
        s = self._s
        for i, v in enumerate((1.0, n, t, n * n, n * t)):
            s[i] = s[i] * d + v
        self.num_samples += 1
        w, sn, st, snn, snt = s
        mean_n, mean_t = sn / w, st / w
        var_n = snn / w - mean_n * mean_n
        if var_n > 0.05 * mean_n * mean_n:  # sizes spread enough to separate a and b
            b = (snt / w - mean_n * mean_t) / var_n
            a = mean_t - b * mean_n
            if b > 0.0 and a >= 0.0:
                self.base, self.per_token = a, b
                return
            if b > 0.0:  # a < 0: noise; keep the slope through the mean
                self.base, self.per_token = 0.0, mean_t / mean_n
                return
        self.base, self.per_token = 0.0, mean_t / mean_n

    def predict(self, num_tokens: int) -> float:
        return self.base + self.per_token * num_tokens
