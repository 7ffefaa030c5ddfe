"""Metric names and label matchers used by the dashboard, the Prometheus rules and
the deploy files, checked against what ``/metrics`` exposes.

Expressions are parsed with ``promql-parser`` (the Prometheus parser's grammar,
in Rust): every vector selector gives a metric name and its label matchers.
Grafana's variables are substituted first (``$__rate_interval`` -> ``5m``,
``$instance`` -> ``.*``).  Names recorded by the rules themselves, and the
series Prometheus makes up (``up``, ``scrape_*``), are not required of sluice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import promql_parser
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Use", "Exposed", "dashboard_uses", "rules_uses", "selectors", "problems", "exposed_from_text"]

PROMETHEUS_MADE = re.compile(r"^(up|scrape_.*|ALERTS|ALERTS_FOR_STATE)$")
TARGET_LABELS = {"job", "instance", "__name__"}  # added by Prometheus at scrape time


@dataclass(frozen=True)
class Use:
    where: str  # "dashboard panel 'Time to first token'", "rule SluiceDegraded"
    expr: str


@dataclass
class Exposed:
    """What one or more ``/metrics`` pages expose."""

    names: set[str] = field(default_factory=set)  # sample names and family names (+ their suffixes)
    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name -> label names seen
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (sample, label) -> values seen

    def add_text(self, text: str) -> None:
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "summary": ("_count", "_sum", "_created"), "gauge": (), "info": ("_info",)}  # fmt: skip
        for fam in text_string_to_metric_families(text):
            self.names.add(fam.name)
            self.names.update(fam.name + s for s in suffixes.get(fam.type, ()))
            for s in fam.samples:
                self.names.add(s.name)
                self.labels.setdefault(s.name, set()).update(s.labels)
                for k, v in s.labels.items():
                    self.values.setdefault((s.name, k), set()).add(v)


def exposed_from_text(*texts: str) -> Exposed:
    e = Exposed()
    for t in texts:
        e.add_text(t)
    return e


def _grafana_vars(expr: str) -> str:
    expr = re.sub(r"\$__(rate_interval|interval|range)|\$\{__(rate_interval|interval|range)\}", "5m", expr)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr)


def dashboard_uses(doc: dict[str, Any]) -> list[Use]:
    uses: list[Use] = []

    def panels(items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels") or [])

    for p in panels(doc.get("panels", [])):
        for t in p.get("targets") or []:
            if t.get("expr"):
                uses.append(Use(f"dashboard panel {p.get('title')!r}", t["expr"]))
    for v in (doc.get("templating") or {}).get("list", []):
        query = v.get("query")
        if v.get("type") == "query" and isinstance(query, str):
            m = re.match(r"\s*label_values\(\s*(.+?)\s*,\s*[A-Za-z_]\w*\s*\)\s*$", query)
            uses.append(Use(f"dashboard variable {v.get('name')!r}", m.group(1) if m else query))
    return uses


def rules_uses(doc: dict[str, Any]) -> tuple[list[Use], set[str]]:
    """(expressions, names the rules record themselves)."""
    uses, recorded = [], set()
    for g in doc.get("groups", []):
        for r in g.get("rules", []):
            if "record" in r:
                recorded.add(r["record"])
            uses.append(Use(f"rule {r.get('alert') or r.get('record')}", str(r["expr"])))
    return uses, recorded


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """[(metric name, [(label, op, value), ...])] of every vector selector in ``expr``."""
    tree = promql_parser.parse(_grafana_vars(expr))
    found: list[tuple[str, list[tuple[str, str, str]]]] = []

    def visit(node: Any, *_: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = [(m.name, str(m.op), m.value) for m in node.matchers.matchers]
            name = node.name or next((v for k, _, v in matchers if k == "__name__"), "")
            found.append((name, [m for m in matchers if m[0] != "__name__"]))
        return True

    promql_parser.walk(tree, visit)
    return found


def problems(uses: Iterable[Use], exposed: Exposed, recorded: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Every name that is not exposed, every label a metric does not carry, and every
    ``le`` bound a histogram does not have; one line each, naming where it is used."""
    out = []
    for use in uses:
        for name, matchers in selectors(use.expr):
            if name in recorded or PROMETHEUS_MADE.match(name):
                continue
            if name not in exposed.names:
                out.append(f"{use.where}: metric {name!r} is not exposed ({use.expr})")
                continue
            seen = exposed.labels.get(name)
            if not seen:
                continue  # no sample yet (a counter never incremented): its labels are unknown
            for label, op, value in matchers:
                if label in TARGET_LABELS:
                    continue
                if label not in seen:
                    out.append(f"{use.where}: metric {name!r} has no label {label!r} (it has {sorted(seen)})")
                elif label == "le" and op.endswith("Equal") and "Not" not in op:
                    bounds = exposed.values.get((name, "le"), set())
                    if value not in bounds:
                        out.append(f"{use.where}: {name} has no bucket le={value!r} (bounds: {sorted(bounds, key=float)})")
    return out
