"""Seeded, reproducible workloads: which requests ``sluice bench`` sends.

A workload is a pure generator of ``RequestSpec`` (prompt, max_tokens,
priority, optional send time).  The same ``WorkloadSpec`` and seed always give
the same requests, whatever the server or the arrival pattern::

    spec = WorkloadSpec(input_len=parse_length("lognormal:512,0.5"), output_len=parse_length("128"))
    for req in islice(generate_requests(spec, seed=0), 3):
        print(req.index, req.num_prompt_tokens, req.max_tokens, req.priority.label)

Kinds of workload (combinable where it makes sense):

- lengths: ``fixed:N`` (or plain ``N``), ``uniform:LO,HI``, ``normal:MEAN,STD``,
  ``lognormal:MEAN,SIGMA`` (MEAN is the distribution's mean, not exp(mu));
- shared prefix: ``prefix_groups`` groups, each with its own system prompt of
  ``prefix_len`` tokens that every request of the group repeats (prefix caching);
- priority mix: fractions of p0/p1/p2, sent as ``x-priority``;
- trace replay: a JSONL file, one request per line with ``timestamp`` (seconds,
  optional), ``prompt`` or ``prompt_len``/``input_len``, ``max_tokens``/``output_len``,
  optional ``priority``;
- constrained outputs: ``constraint`` ``json_schema`` (OpenAI ``response_format``
  with ``BENCH_SCHEMA``) or ``tools`` (``BENCH_TOOLS`` with ``tool_choice: required``,
  chat only) on a ``constrained_fraction`` of the requests (docs/structured_outputs.md).
  A constrained request is not sent ``ignore_eos``: its answer ends with its grammar.
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.types import Priority, parse_priority

__all__ = [
    "Api",
    "Constraint",
    "BENCH_SCHEMA",
    "BENCH_TOOLS",
    "constraint_body",
    "parse_constraint",
    "LengthKind",
    "LengthDist",
    "RequestSpec",
    "WorkloadSpec",
    "parse_length",
    "parse_priority_mix",
    "load_trace",
    "workload_from_dict",
    "generate_requests",
]

# NOTE(prompt-words): prompts are built from short common English words, each of
# which is one token in the usual BPE vocabularies (Llama, SmolLM, GPT-2), so a
# prompt of N words is close to N tokens.  The server's `usage.prompt_tokens`,
# when given, is what the report uses.
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part"
)
_WORDS = tuple(_WORD_TEXT.split())


class Api(str, enum.Enum):
    """Which OpenAI endpoint to call; values match the ``--api`` flag."""

    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Api.CHAT else "/v1/completions"


class Constraint(str, enum.Enum):
    """What a request's output is held to; values match the ``--constraint`` flag."""

    NONE = "none"
    JSON_SCHEMA = "json_schema"
    TOOLS = "tools"


# a record of a few typed, bounded fields: what a typical extraction request asks for
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 64},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"type": "string", "enum": ["drama", "comedy", "documentary", "thriller"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["title", "year", "genre", "rating", "tags"],
    "additionalProperties": False,
}
BENCH_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Flights between two airports.",
                                      "parameters": {"type": "object", "properties": {
                                          "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                          "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                          "date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"}},
                                          "required": ["origin", "destination", "date"],
                                          "additionalProperties": False}}},
]  # fmt: skip


def constraint_body(c: Constraint) -> dict[str, Any]:
    """The request fields that ask for the constraint (OpenAI's shapes)."""
    if c is Constraint.JSON_SCHEMA:
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "bench_record", "schema": BENCH_SCHEMA, "strict": True}}}
    if c is Constraint.TOOLS:
        return {"tools": BENCH_TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    return {}


class LengthKind(str, enum.Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    NORMAL = "normal"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; samples are integers clamped to [1, 1_000_000]."""

    kind: LengthKind
    a: float  # fixed: N; uniform: low; normal/lognormal: mean
    b: float = 0.0  # uniform: high; normal: std; lognormal: sigma of log(x)

    def sample(self, rng: random.Random) -> int:
        if self.kind is LengthKind.FIXED:
            x = self.a
        elif self.kind is LengthKind.UNIFORM:
            x = rng.uniform(self.a, self.b)
        elif self.kind is LengthKind.NORMAL:
            x = rng.gauss(self.a, self.b)
        else:
            # mean of lognormal(mu, s) is exp(mu + s^2/2): solve for mu.
            mu = math.log(self.a) - self.b * self.b / 2
            x = rng.lognormvariate(mu, self.b)
        return min(1_000_000, max(1, round(x)))

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind is LengthKind.UNIFORM else self.a

    def __str__(self) -> str:
        if self.kind is LengthKind.FIXED:
            return f"fixed:{self.a:g}"
        return f"{self.kind.value}:{self.a:g},{self.b:g}"


def parse_length(text: str | int | dict[str, Any]) -> LengthDist:
    """``128``, ``fixed:128``, ``uniform:64,256``, ``normal:128,32``, ``lognormal:512,0.5``,
    or a YAML mapping ``{dist: normal, mean: 128, std: 32}``."""
    if isinstance(text, dict):
        return _length_from_dict(text)
    raw = str(text).strip()
    kind_s, _, args_s = raw.partition(":") if ":" in raw else ("fixed", "", raw)
    try:
        kind = LengthKind(kind_s.strip().lower())
    except ValueError:
        raise ValueError(
            f"invalid length {raw!r}: expected N, fixed:N, uniform:LO,HI, normal:MEAN,STD "
            "or lognormal:MEAN,SIGMA"
        ) from None
    try:
        args = [float(x) for x in args_s.split(",")] if args_s.strip() else []
    except ValueError:
        raise ValueError(f"invalid length {raw!r}: arguments must be numbers") from None
    want = 1 if kind is LengthKind.FIXED else 2
    if len(args) != want:
        raise ValueError(f"invalid length {raw!r}: {kind.value} takes {want} number(s)")
    dist = LengthDist(kind, *args)
    _check_length(dist, raw)
    return dist


def _length_from_dict(d: dict[str, Any]) -> LengthDist:
    kind = str(d.get("dist", "fixed")).lower()
    try:
        if kind == "fixed":
            dist = LengthDist(LengthKind.FIXED, float(d.get("value", d.get("mean", 0))))
        elif kind == "uniform":
            dist = LengthDist(LengthKind.UNIFORM, float(d["min"]), float(d["max"]))
        elif kind == "normal":
            dist = LengthDist(LengthKind.NORMAL, float(d["mean"]), float(d["std"]))
        elif kind == "lognormal":
            dist = LengthDist(LengthKind.LOGNORMAL, float(d["mean"]), float(d["sigma"]))
        else:
            raise ValueError(f"invalid length {d!r}: unknown dist {kind!r}")
    except KeyError as e:
        raise ValueError(f"invalid length {d!r}: missing key {e.args[0]!r}") from None
    _check_length(dist, str(d))
    return dist


def _check_length(dist: LengthDist, raw: str) -> None:
    if dist.a < 1:  # a fixed length, a uniform low bound or a mean
        raise ValueError(f"invalid length {raw!r}: lengths must be >= 1")
    if dist.kind is LengthKind.UNIFORM and dist.b < dist.a:
        raise ValueError(f"invalid length {raw!r}: uniform needs LO <= HI")
    if dist.kind in (LengthKind.NORMAL, LengthKind.LOGNORMAL) and dist.b < 0:
        raise ValueError(f"invalid length {raw!r}: spread must be >= 0")


def parse_priority_mix(text: str | dict[str, Any] | None) -> dict[Priority, float]:
    """``p0=0.1,p1=0.6,p2=0.3`` (or a mapping) -> normalised fractions per class."""
    if text is None or text == "" or text == {}:
        return {Priority.P1: 1.0}
    items: list[tuple[Any, Any]]
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in str(text).split(","):
            k, sep, v = part.partition("=")
            if not sep:
                raise ValueError(f"invalid priority mix {text!r}: expected p0=0.1,p1=0.6,p2=0.3")
            items.append((k, v))
    mix: dict[Priority, float] = {}
    for k, v in items:
        try:
            frac = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"invalid priority mix {text!r}: {v!r} is not a number") from None
        if frac < 0:
            raise ValueError(f"invalid priority mix {text!r}: fractions must be >= 0")
        mix[parse_priority(str(k))] = frac
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"invalid priority mix {text!r}: fractions sum to 0")
    return {p: f / total for p, f in sorted(mix.items()) if f > 0}


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    index: int  # 0-based position in the workload
    prompt: str
    num_prompt_tokens: int  # intended input length (words ~ tokens)
    max_tokens: int
    priority: Priority = Priority.P1
    prefix_group: int | None = None  # shared-prefix workload: which system prompt
    send_at_s: float | None = None  # trace replay: seconds after the start
    constraint: Constraint = Constraint.NONE  # what its output is held to


@dataclass(frozen=True)
class TraceEntry:
    timestamp_s: float | None
    prompt: str | None
    prompt_len: int
    max_tokens: int
    priority: Priority | None


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send; every field has a CLI flag and a key in the workload YAML."""

    api: Api = Api.CHAT
    input_len: LengthDist = field(default_factory=lambda: LengthDist(LengthKind.FIXED, 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(LengthKind.FIXED, 64))
    prefix_groups: int = 0  # 0: no shared prefix
    prefix_len: int = 0  # tokens of each group's shared system prompt
    priority_mix: dict[Priority, float] = field(default_factory=lambda: {Priority.P1: 1.0})
    trace: tuple[TraceEntry, ...] = ()  # non-empty: replay these, ignore the length dists
    ignore_eos: bool = True  # ask the server for exactly max_tokens (vLLM, sluice honour it)
    constraint: Constraint = Constraint.NONE
    constrained_fraction: float = 1.0  # of the requests that carry the constraint

    def __post_init__(self) -> None:
        if not 0.0 <= self.constrained_fraction <= 1.0:
            raise ValueError(f"constrained_fraction must be in [0, 1], got {self.constrained_fraction}")
        if self.constraint is Constraint.TOOLS and self.api is Api.COMPLETIONS:
            raise ValueError("a tools workload needs the chat API")
        if self.prefix_groups < 0 or self.prefix_len < 0:
            raise ValueError("prefix groups and prefix length must be >= 0")
        if self.prefix_groups > 0 and self.prefix_len < 1:
            raise ValueError("a shared-prefix workload needs a prefix length >= 1")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_WORDS, k=n))


def generate_requests(spec: WorkloadSpec, seed: int = 0) -> Iterator[RequestSpec]:
    """Endless (synthetic) or finite (trace) stream of requests, identical for one seed."""
    rng = random.Random(seed)
    prefixes = [
        _words(random.Random(f"{seed}-prefix-{g}"), spec.prefix_len)
        for g in range(spec.prefix_groups)
    ]
    classes = list(spec.priority_mix)
    weights = [spec.priority_mix[p] for p in classes]
    # its own stream, so that a constraint leaves the prompts, lengths and classes as they were
    constraint_rng = random.Random(f"{seed}-constraint")

    def constraint() -> Constraint:
        if spec.constraint is Constraint.NONE or constraint_rng.random() >= spec.constrained_fraction:
            return Constraint.NONE
        return spec.constraint

    if spec.trace:
        for i, e in enumerate(spec.trace):
            prio = e.priority if e.priority is not None else rng.choices(classes, weights)[0]
            prompt = e.prompt if e.prompt is not None else _words(rng, e.prompt_len)
            yield RequestSpec(i, prompt, e.prompt_len, e.max_tokens, prio, None, e.timestamp_s, constraint())
        return
    i = 0
    while True:
        n_in = spec.input_len.sample(rng)
        n_out = spec.output_len.sample(rng)
        prio = classes[0] if len(classes) == 1 else rng.choices(classes, weights)[0]
        group = rng.randrange(spec.prefix_groups) if spec.prefix_groups else None
        body = _words(rng, n_in)
        if group is not None:
            prompt, n_total = prefixes[group] + "\n\n" + body, spec.prefix_len + n_in
        else:
            prompt, n_total = body, n_in
        yield RequestSpec(i, prompt, n_total, n_out, prio, group, None, constraint())
        i += 1


def load_trace(path: str | Path) -> tuple[TraceEntry, ...]:
    """Parse a JSONL trace; a bad line raises ``ValueError`` naming the line."""
    entries: list[TraceEntry] = []
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {str(p)!r} does not exist")
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            prompt = d.get("prompt")
            raw_in: Any = d.get("prompt_len", d.get("input_len"))
            if prompt is None and raw_in is None:
                raise ValueError("needs 'prompt' or 'prompt_len'")
            if prompt is not None and not isinstance(prompt, str):
                raise ValueError("'prompt' must be a string")
            n_in = int(raw_in) if raw_in is not None else len(str(prompt).split())
            raw_out: Any = d.get("max_tokens", d.get("output_len", 64))
            n_out = int(raw_out)
            ts = d.get("timestamp")
            prio = parse_priority(d["priority"]) if "priority" in d else None
            if n_in < 0 or n_out < 1:
                raise ValueError("lengths must be positive")
            entries.append(
                TraceEntry(float(ts) if ts is not None else None, prompt, max(1, n_in), n_out, prio)
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"{p}:{lineno}: bad trace line: {e}") from None
    if not entries:
        raise ValueError(f"trace file {str(p)!r} has no requests")
    first = min((e.timestamp_s for e in entries if e.timestamp_s is not None), default=0.0)
    return tuple(
        TraceEntry(
            e.timestamp_s - first if e.timestamp_s is not None else None,
            e.prompt,
            e.prompt_len,
            e.max_tokens,
            e.priority,
        )
        for e in entries
    )


_WORKLOAD_KEYS = {
    "api", "input_len", "output_len", "prefix_groups", "prefix_len",
    "priority_mix", "trace", "ignore_eos", "constraint", "constrained_fraction",
}  # fmt: skip


def workload_from_dict(d: dict[str, Any], base_dir: Path | None = None) -> dict[str, Any]:
    """Validate a workload YAML mapping; returns ``WorkloadSpec`` keyword arguments."""
    unknown = set(d) - _WORKLOAD_KEYS
    if unknown:
        raise ValueError(
            f"unknown workload key(s) {sorted(unknown)}; known: {sorted(_WORKLOAD_KEYS)}"
        )
    out: dict[str, Any] = {}
    if "api" in d:
        try:
            out["api"] = Api(str(d["api"]))
        except ValueError:
            raise ValueError(f"invalid api {d['api']!r}: expected chat or completions") from None
    for k in ("input_len", "output_len"):
        if k in d:
            out[k] = parse_length(d[k])
    for k in ("prefix_groups", "prefix_len"):
        if k in d:
            out[k] = int(d[k])
    if "priority_mix" in d:
        out["priority_mix"] = parse_priority_mix(d["priority_mix"])
    if "trace" in d:
        tp = Path(str(d["trace"]))
        out["trace"] = load_trace(tp if tp.is_absolute() or base_dir is None else base_dir / tp)
    if "ignore_eos" in d:
        out["ignore_eos"] = bool(d["ignore_eos"])
    if "constraint" in d:
        out["constraint"] = parse_constraint(str(d["constraint"]))
    if "constrained_fraction" in d:
        out["constrained_fraction"] = float(d["constrained_fraction"])
    return out


def parse_constraint(text: str) -> Constraint:
    try:
        return Constraint(text)
    except ValueError:
        raise ValueError(f"invalid constraint {text!r}: expected none, json_schema or tools") from None
