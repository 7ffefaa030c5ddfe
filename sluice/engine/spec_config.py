"""``--speculative-config``: what speculative decoding proposes with, parsed once (vLLM's field names).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"model": "self:q4", "num_speculative_tokens": 4}        # the target's own 4-bit copy drafts
    {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3}
    "auto"                                                   # sluice chooses (``AUTO``)

The engine config holds the normalised dict (``parse_speculative_config``: it
crosses the process boundary as plain data); the engine builds a
``SpeculativeConfig`` from it.  A bad value raises one ``ConfigError`` line that
names the field and what is wrong.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from sluice.errors import ConfigError

__all__ = ["SpecMethod", "KPolicy", "SpeculativeConfig", "parse_speculative_config", "SELF_Q4", "AUTO"]

SELF_Q4 = "self:q4"  # the draft model is the target's own 4-bit copy (made at load, or the GGUF's 4-bit weights)
MAX_SPECULATIVE_TOKENS = 16  # past this a draft run is almost never accepted whole; a step carries k+1 rows per request
FIELD = "speculative_config"


class SpecMethod(str, enum.Enum):
    """Proposers (``spec.proposer.make_proposer``); values match the config's ``method``."""

    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


class KPolicy(str, enum.Enum):
    """How many tokens a request drafts each step: ``adaptive`` (``spec.policy``: by the step-time model and
    its acceptance, 0 when the batch is compute-bound) or ``fixed`` (always ``num_speculative_tokens``)."""

    ADAPTIVE = "adaptive"
    FIXED = "fixed"


# NOTE(spec-auto): "auto" is the n-gram proposer with adaptive k: it costs no model, and where nothing in
# the request repeats it drafts nothing, so a step is what it was without speculation.
AUTO: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 4, "k_policy": "adaptive"}  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int  # k: most tokens one request drafts in a step (the adaptive policy's cap)
    model: str | None = None  # the draft model: a path, a model name, or SELF_Q4 (draft_model only)
    prompt_lookup_min: int = 2  # n-gram: shortest suffix matched (tokens)
    prompt_lookup_max: int = 4  # n-gram: longest suffix matched, tried first (tokens)
    k_policy: KPolicy = KPolicy.ADAPTIVE

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """The config of a normalised dict (``parse_speculative_config``'s)."""
        return cls(
            method=SpecMethod(d["method"]),
            num_speculative_tokens=int(d["num_speculative_tokens"]),
            model=d.get("model"),
            prompt_lookup_min=int(d.get("prompt_lookup_min", 2)),
            prompt_lookup_max=int(d.get("prompt_lookup_max", 4)),
            k_policy=KPolicy(d.get("k_policy", KPolicy.ADAPTIVE.value)),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["method"], d["k_policy"] = self.method.value, self.k_policy.value
        return {k: v for k, v in d.items() if v is not None}


_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "k_policy"}


def parse_speculative_config(value: object) -> dict[str, Any] | None:
    """A ``--speculative-config`` value (JSON text, a dict, ``auto``, or ``none``/empty: off) as a
    normalised dict, or None for off; ``ConfigError`` saying what is wrong, in one line."""

    def bad(reason: str) -> ConfigError:  # the flag or the field is named by the caller (EngineConfig.validate)
        return ConfigError(reason, setting=FIELD)

    if value is None or isinstance(value, SpeculativeConfig):
        return value.to_dict() if isinstance(value, SpeculativeConfig) else None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "off", "null"):
            return None
        if text.lower() == "auto":
            return dict(AUTO)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise bad(f"not valid JSON ({e.msg} at char {e.pos}): {text!r}") from None
        if isinstance(value, str) and value.lower() == "auto":
            return dict(AUTO)
    if not isinstance(value, dict):
        raise bad(f"expected a JSON object or 'auto', got {type(value).__name__}")
    d = dict(value)
    if d.get("method") == "auto" or d.get("model") == "auto" and "method" not in d:
        merged = {**AUTO, **{k: v for k, v in d.items() if k != "method" and k != "model"}}
        d = merged
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(repr, unknown))}: use {', '.join(sorted(_KEYS))}")
    method = d.get("method")
    if method is None:
        method = SpecMethod.DRAFT_MODEL.value if d.get("model") else None
        if method is None:
            raise bad("give 'method' (ngram, draft_model) or a draft 'model'")
    methods = [m.value for m in SpecMethod]
    if method not in methods:
        raise bad(f"unknown method {method!r}: use {', '.join(methods)} (or 'auto')")
    d["method"] = method
    k = d.get("num_speculative_tokens", AUTO["num_speculative_tokens"])
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise bad(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    d["num_speculative_tokens"] = k
    if method == SpecMethod.DRAFT_MODEL.value:
        model = d.get("model")
        if not isinstance(model, str) or not model.strip():
            raise bad(f"method draft_model needs a draft 'model' (a path, a model name, or {SELF_Q4!r})")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            d.pop(name, None)
    else:
        if d.get("model") is not None:
            raise bad(f"method {method} takes no 'model' (the draft model's method is draft_model)")
        lo, hi = d.get("prompt_lookup_min", 2), d.get("prompt_lookup_max", max(4, d.get("prompt_lookup_min", 2)))
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) or not 1 <= lo <= hi:
            raise bad(f"need 1 <= prompt_lookup_min <= prompt_lookup_max (integers), got {lo!r} and {hi!r}")
        d["prompt_lookup_min"], d["prompt_lookup_max"] = lo, hi
    policy = d.get("k_policy", KPolicy.ADAPTIVE.value)
    if policy not in [p.value for p in KPolicy]:
        raise bad(f"unknown k_policy {policy!r}: use adaptive, fixed")
    d["k_policy"] = policy
    return SpeculativeConfig.from_dict(d).to_dict()
