"""A request's output constraint: OpenAI / vLLM request fields -> ``StructuredOutputs``, validated.

Three ways to ask for one, at most one per request (docs/structured_outputs.md):

    response_format   {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs  vLLM's {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older extras

``build_structured`` turns them into the engine's ``StructuredOutputs`` and
``GrammarValidator.validate`` compiles it with llguidance here, in the API process,
so that a bad schema, regex or grammar (or a schema feature llguidance does
not implement) is a 400 naming the parameter and llguidance's reason before
anything reaches the engine.

NOTE(validate-here): llguidance is imported lazily and a validation runs
without a tokenizer (a grammar's own errors do not depend on the vocabulary);
a ``GrammarValidator`` (one per server) remembers the texts it validated in a
small bounded cache, since clients send the same schema over and over.  The
grammar checked is the one the engine compiles (``sluice.engine.structured.grammar_spec``,
which loads no torch); this module adds the request fields, the parameter names,
the cache and NOTE(warnings-are-errors).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sluice.engine.protocol import StructuredOutputs
from sluice.errors import InvalidRequestError

__all__ = ["GrammarValidator", "build_structured", "llguidance_grammar"]

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {msg}", param=param)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object (or as JSON text) -> JSON text of an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(param, f"the schema is not valid JSON: {e}") from None
    if isinstance(value, bool):  # JSON Schema allows true / false; an output needs a shape
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise _bad(param, f"a JSON schema must be an object, got {type(value).__name__}")
    return json.dumps(value)


def _from_response_format(rf: dict[str, Any]) -> tuple[StructuredOutputs | None, str]:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutputs(json_object=True), "response_format"
    if kind != "json_schema":
        raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "json_schema must be an object with 'name' and 'schema'")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise _bad("response_format.json_schema", f"unknown fields {sorted(unknown)}")
    if "schema" not in spec:
        raise _bad("response_format.json_schema.schema", "a schema is required")
    param = "response_format.json_schema.schema"
    return StructuredOutputs(json=_schema_text(spec["schema"], param)), param


def _from_vllm(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(json=_schema_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise _bad(param, "must be true")
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(param, "must be a non-empty list of non-empty strings")
        return StructuredOutputs(choice=list(value))
    if not isinstance(value, str) or not value:
        raise _bad(param, f"must be a non-empty string ({'a regular expression' if kind == 'regex' else 'a grammar'})")
    return StructuredOutputs(regex=value) if kind == "regex" else StructuredOutputs(grammar=value)


def build_structured(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
    validator: GrammarValidator,
) -> tuple[StructuredOutputs | None, str | None]:
    """The request's constraint and the parameter that asked for it (``(None, None)``: none).

    ``guided`` maps each ``guided_*`` field to its value (None: not sent).
    """
    found: list[tuple[StructuredOutputs | None, str]] = []
    if response_format is not None:
        found.append(_from_response_format(response_format))
    if structured_outputs is not None:
        keys = [k for k in structured_outputs if structured_outputs[k] not in (None, False)]
        unknown = [k for k in keys if k not in _SO_KEYS]
        if unknown:
            raise _bad("structured_outputs", f"unknown fields {unknown}; use one of {list(_SO_KEYS)}")
        if len(keys) != 1:
            raise _bad("structured_outputs", f"set exactly one of {list(_SO_KEYS)}, got {keys or 'none'}")
        param = f"structured_outputs.{keys[0]}"
        found.append((_from_vllm(keys[0], structured_outputs[keys[0]], param), param))
    for field, kind in _GUIDED.items():
        if guided.get(field) is not None:
            found.append((_from_vllm(kind, guided[field], field), field))
    asked = [(so, p) for so, p in found if so is not None]
    if len(asked) > 1:
        names = ", ".join(p for _, p in asked)
        raise InvalidRequestError(f"at most one output constraint per request, got {names}", param=asked[1][1])
    if not asked:
        return None, None
    so, param = asked[0]
    validator.validate(so, param)
    return so, param


def llguidance_grammar(so: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint: the engine's own ``grammar_spec`` (torch-free), so what is
    validated here is exactly what the engine compiles."""
    from sluice.engine.structured import constraint_key, grammar_spec

    return str(grammar_spec(*constraint_key(so)))


class GrammarValidator:
    """Compiles constraints with llguidance (no tokenizer) and remembers the verdicts."""

    def __init__(self, cache_size: int = 256):
        self.cache_size = cache_size
        self._verdicts: OrderedDict[tuple[str, str], str] = OrderedDict()  # (kind, text) -> '' (valid) or why not
        self._lock = threading.Lock()  # validations run on worker threads (NOTE(validate-offload) in serving)

    def reason(self, kind: str, text: str, make: Callable[[], str]) -> str:
        """'' when the grammar ``make()`` returns compiles, else llguidance's reason."""
        key = (kind, text)
        with self._lock:
            hit = self._verdicts.get(key)
            if hit is not None:
                self._verdicts.move_to_end(key)
                return hit
        from llguidance import LLMatcher

        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(make())
        except (ValueError, TypeError) as e:  # grammar_from_* raise on text that is not JSON, a bad GBNF, ...
            is_error, messages = True, [str(e)]
        # NOTE(warnings-are-errors): llguidance reports schema features it does not implement
        # as warnings and then ignores them: the output would not be held to the whole
        # schema, so a warning is refused like an error
        verdict = "; ".join(m.strip() for m in messages) if (is_error or messages) else ""
        with self._lock:
            self._verdicts[key] = verdict
            if len(self._verdicts) > self.cache_size:
                self._verdicts.popitem(last=False)
        return verdict

    def validate(self, so: StructuredOutputs, param: str) -> None:
        """Raise a 400 naming ``param`` when llguidance cannot compile ``so``."""
        kind = so.kind()
        text = {"json": so.json, "regex": so.regex, "grammar": so.grammar,
                "choice": json.dumps(so.choice), "json_object": ""}[kind] or ""  # fmt: skip
        verdict = self.reason(kind, text, lambda: llguidance_grammar(so))
        if verdict:
            what = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
                    "choice": "choice list", "grammar": "grammar"}[kind]  # fmt: skip
            raise _bad(param, f"invalid {what}: {verdict}")
