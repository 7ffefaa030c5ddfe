"""SLA contracts: YAML targets checked against a run's summary (pure).

A contract file::

    name: chat-release
    description: p95 TTFT under 350 ms at 200 connections
    targets:                  # every run's overall figures
      ttft_p95_ms: 350        # <metric>_<stat>_ms <= value; metric: ttft tpot itl e2e,
      e2e_p95_ms: 800         #   stat: p50 p90 p95 p99 max mean
      min_rps: 120            # min_rps, min_output_tok_s, min_goodput_rps, min_goodput_ratio: >=
      max_error_rate: 0.003   # <=
    per_priority:             # the same keys, for one class only
      p0: {ttft_p95_ms: 200}
    load: {concurrency: 200}  # optional: the load the contract is stated at (CLI flags win)
    workload: {output_len: 128}  # optional: workload keys (see workload.py), CLI flags win
    memory: {kv_bytes_per_token: 23040, block_size: 16}  # optional: report KV memory per request
    settings: {weights: int4}    # optional: settings echoed in the report

``evaluate`` returns one ``TargetResult`` per target; a target whose figure
does not exist (no successful request, a class that sent nothing) fails.
Built-in presets live in ``sluice/bench/presets/<name>.yaml``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sluice.bench.summary import RequestSLO
from sluice.types import parse_priority

__all__ = [
    "Target",
    "TargetResult",
    "Contract",
    "PRESETS_DIR",
    "list_presets",
    "load_contract",
    "contract_from_dict",
    "evaluate",
]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"

_LATENCY_KEY = re.compile(r"^(ttft|tpot|itl|e2e)_(p50|p90|p95|p99|max|mean)_ms$")
_RATE_KEYS = {
    "min_rps": "rps",
    "min_output_tok_s": "output_tok_s",
    "min_goodput_rps": "goodput_rps",
    "min_goodput_ratio": "goodput_ratio",
}
_CONTRACT_KEYS = {"name", "description", "targets", "per_priority", "load", "workload", "memory", "settings"}  # fmt: skip


@dataclass(frozen=True)
class Target:
    key: str  # as written in the YAML, e.g. "ttft_p95_ms"
    threshold: float
    scope: str = "all"  # "all" or a priority label "p0"/"p1"/"p2"

    @property
    def is_upper_bound(self) -> bool:
        """True when the measured value must stay <= threshold."""
        return not self.key.startswith("min_")

    @property
    def label(self) -> str:
        return self.key if self.scope == "all" else f"{self.scope}.{self.key}"

    def measure(self, summary: dict[str, Any]) -> float | None:
        s = summary if self.scope == "all" else summary.get("by_priority", {}).get(self.scope)
        if not s or not s.get("num_requests"):
            return None
        if self.key == "max_error_rate":
            return float(s["error_rate"])
        if self.key in _RATE_KEYS:
            return float(s[_RATE_KEYS[self.key]])
        m = _LATENCY_KEY.match(self.key)
        assert m is not None  # keys were validated when the contract was parsed
        block = s.get(f"{m.group(1)}_ms")
        return None if block is None else float(block[m.group(2)])


@dataclass(frozen=True)
class TargetResult:
    target: Target
    measured: float | None
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        t = self.target
        op = "<=" if t.is_upper_bound else ">="
        return {"target": t.label, "op": op, "threshold": t.threshold, "measured": self.measured, "passed": self.passed}  # fmt: skip


@dataclass(frozen=True)
class Contract:
    name: str
    description: str = ""
    targets: tuple[Target, ...] = ()
    load: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def request_slo(self) -> RequestSLO:
        """Per-request limits for goodput, taken from the overall latency targets.

        NOTE(goodput): a request is "good" when it alone meets every latency
        threshold of the contract (ttft/tpot/e2e; the tightest if several
        percentiles of one metric are given), as vLLM's goodput does.
        """
        lim: dict[str, float] = {}
        for t in self.targets:
            m = _LATENCY_KEY.match(t.key)
            if t.scope == "all" and m and m.group(1) in ("ttft", "tpot", "e2e"):
                lim[m.group(1)] = min(lim.get(m.group(1), math.inf), t.threshold)
        return RequestSLO(lim.get("ttft"), lim.get("tpot"), lim.get("e2e"))


def _parse_targets(d: Any, scope: str, where: str) -> list[Target]:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: targets must be a mapping of key: number")
    out = []
    for key, value in d.items():
        if not (_LATENCY_KEY.match(str(key)) or key in _RATE_KEYS or key == "max_error_rate"):
            raise ValueError(
                f"{where}: unknown target {key!r}; expected <ttft|tpot|itl|e2e>_<p50|p90|p95|p99|max|mean>_ms, "
                f"max_error_rate, or one of {sorted(_RATE_KEYS)}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}: target {key!r} must be a number >= 0, got {value!r}")
        out.append(Target(str(key), float(value), scope))
    return out


def contract_from_dict(d: Any, where: str = "contract") -> Contract:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a contract is a YAML mapping")
    unknown = set(d) - _CONTRACT_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_CONTRACT_KEYS)}")
    targets = _parse_targets(d.get("targets") or {}, "all", where)
    per = d.get("per_priority") or {}
    if not isinstance(per, dict):
        raise ValueError(f"{where}: per_priority must map p0/p1/p2 to targets")
    for cls, sub in per.items():
        try:
            label = parse_priority(str(cls)).label
        except ValueError as e:
            raise ValueError(f"{where}: per_priority: {e}") from None
        targets += _parse_targets(sub, label, f"{where}: per_priority.{label}")
    if not targets:
        raise ValueError(f"{where}: no targets given")
    for k in ("load", "workload", "memory", "settings"):
        if not isinstance(d.get(k) or {}, dict):
            raise ValueError(f"{where}: {k} must be a mapping")
    return Contract(
        name=str(d.get("name", where)),
        description=str(d.get("description", "")),
        targets=tuple(targets),
        load=dict(d.get("load") or {}),
        workload=dict(d.get("workload") or {}),
        memory=dict(d.get("memory") or {}),
        settings=dict(d.get("settings") or {}),
    )


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_contract(name_or_path: str) -> Contract:
    """A preset name (``latency``, ``throughput``, ``cost``) or a YAML file path."""
    path = Path(name_or_path)
    if not path.is_file():
        preset = PRESETS_DIR / f"{name_or_path}.yaml"
        if not preset.is_file():
            raise ValueError(
                f"contract {name_or_path!r} is neither a file nor a preset ({', '.join(list_presets())})"
            )
        path = preset
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    return contract_from_dict(data, str(path))


def evaluate(contract: Contract, summary: dict[str, Any]) -> list[TargetResult]:
    results = []
    for t in contract.targets:
        v = t.measure(summary)
        ok = v is not None and (v <= t.threshold if t.is_upper_bound else v >= t.threshold)
        results.append(TargetResult(t, v, ok))
    return results
