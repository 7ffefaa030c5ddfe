"""Settings from flags, ``SLUICE_*`` environment variables and a YAML file: the one
mechanism behind ``sluice serve``, ``sluice generate`` and ``sluice gateway`` (torch-free).

    precedence:  --flag  >  SLUICE_<NAME>  >  --config FILE.yaml  >  the field's default

Every source names settings one by one: an environment variable sets its own
setting and overrides nothing else; a file key likewise.

A setting is an ``Option`` derived from the field that defines it, never written
twice.  The field ``max_num_seqs`` gives the flag ``--max-num-seqs``, the
variable ``SLUICE_MAX_NUM_SEQS`` and the file key ``max_num_seqs``:

    dataclass field   options_from_dataclass(EngineConfig)
                      help, extra flags, choices, parser in ``field(metadata=setting(...))``
    pydantic field    options_from_model(ServerSettings)
                      help in ``Field(description=...)``, extra flags in
                      ``json_schema_extra={"flags": ["-p"]}``

``typer_command`` turns options into a typer command; ``resolve`` layers the
sources; ``Resolved.error`` turns a bad value into a ``ConfigError`` of one
line that names the flag and where the value came from.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sluice.errors import ConfigError

__all__ = [
    "Option",
    "Resolved",
    "setting",
    "make_option",
    "options_from_dataclass",
    "options_from_model",
    "read_env",
    "read_yaml",
    "resolve",
    "typer_command",
    "expand_multi_value_flags",
    "ENV_PREFIX",
]

ENV_PREFIX = "SLUICE_"
T = TypeVar("T")


def setting(
    help: str,
    *,
    flags: Sequence[str] = (),
    envvars: Sequence[str] = (),
    choices: Iterable[str] = (),
    parse: Callable[[Any], Any] | None = None,
    multi_value: bool = False,
) -> dict[str, Any]:
    """Metadata that makes a dataclass field a setting::

        max_num_seqs: int = field(default=64, metadata=setting("Running sequences cap."))

    ``flags`` / ``envvars`` are extra names (``-m``, an old variable) after the
    derived ones; ``parse`` turns a string into the value before validation;
    ``multi_value`` (a list field) also takes several values after one flag.
    """
    return {"help": help, "flags": tuple(flags), "envvars": tuple(envvars),
            "choices": tuple(choices), "parse": parse, "multi_value": multi_value}  # fmt: skip


@dataclass(frozen=True)
class Option:
    """One setting as the command line, the environment and a file see it."""

    name: str  # field name, also the config-file key
    help: str
    kind: type = str  # value type on the command line: str, int, float or bool
    flags: tuple[str, ...] = ()  # the derived --long-name first, then extra ones
    envvars: tuple[str, ...] = ()  # the derived SLUICE_<NAME> first
    multiple: bool = False  # repeatable flag; a comma-separated list in the environment
    choices: tuple[str, ...] = ()
    default: Any = None  # shown in --help
    parse: Callable[[Any], Any] | None = None  # str -> value, before validation
    multi_value: bool = False  # several values after one flag: --lora-modules a=/x b=/y (vLLM's nargs='+')

    @property
    def flag(self) -> str:
        return self.flags[0]

    def help_text(self) -> str:
        notes = []
        if self.choices:
            notes.append(" | ".join(self.choices))
        if self.default not in (None, [], ()):
            value = self.default.value if isinstance(self.default, enum.Enum) else self.default
            notes.append(f"default: {value}")
        if self.envvars:
            notes.append(f"env: {', '.join(self.envvars)}")
        return f"{self.help} ({'; '.join(notes)})" if notes else self.help


def make_option(
    name: str,
    help: str,
    annotation: Any,
    default: Any = None,
    *,
    flags: Sequence[str] = (),
    envvars: Sequence[str] = (),
    choices: Iterable[str] = (),
    parse: Callable[[Any], Any] | None = None,
    multi_value: bool = False,
) -> Option:
    kind, multiple, enum_choices = _kind(annotation)
    return Option(
        name=name,
        help=help,
        kind=str if parse is not None else kind,
        flags=("--" + name.replace("_", "-"), *flags),
        envvars=(ENV_PREFIX + name.upper(), *envvars),
        multiple=multiple,
        choices=tuple(choices) or enum_choices,
        default=default,
        parse=parse,
        multi_value=multi_value and multiple,
    )


def _kind(annotation: Any) -> tuple[type, bool, tuple[str, ...]]:
    """(command-line type, is repeatable, choices) of a field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _kind(inner)
    if typing.get_origin(annotation) in (list, tuple):
        return _kind(args[0])[0], True, ()
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return str, False, tuple(str(m.value) for m in annotation)
    if annotation in (bool, int, float):
        return annotation, False, ()
    return str, False, ()


def options_from_dataclass(cls: type) -> list[Option]:
    """The settings of a dataclass: its fields with ``setting(...)`` metadata."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(make_option(f.name, meta["help"], hints[f.name], default, flags=meta["flags"],
                               envvars=meta["envvars"], choices=meta["choices"], parse=meta["parse"],
                               multi_value=meta.get("multi_value", False)))  # fmt: skip
    return out


def options_from_model(model: Any, exclude: Iterable[str] = ()) -> list[Option]:
    """The settings of a pydantic model: its fields with a ``description``."""
    out = []
    skip = set(exclude)
    for name, f in model.model_fields.items():
        if name in skip or not f.description:
            continue
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        default = None if f.default_factory is not None else f.default
        out.append(make_option(name, f.description, f.annotation, default,
                               flags=extra.get("flags", ()), envvars=extra.get("envvars", ())))  # fmt: skip
    return out


def read_env(options: Iterable[Option], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{name: raw value}`` of the options whose variable is set (and not empty)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for o in options:
        for var in o.envvars:
            raw = env.get(var)
            if raw:
                values[o.name] = [s.strip() for s in raw.split(",") if s.strip()] if o.multiple else raw
                break
    return values


def read_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The top-level mapping of a YAML file; ``ConfigError`` for anything else."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {p}: expected a mapping of setting: value at the top level")
    return raw


@dataclass
class Resolved:
    """Layered values and where each came from (for error messages)."""

    values: dict[str, Any] = field(default_factory=dict)  # name -> value
    origin: dict[str, str] = field(default_factory=dict)  # name -> "", "SLUICE_X", "'x' in f.yaml"
    options: dict[str, Option] = field(default_factory=dict)  # name -> option

    def error(self, name: str | None, reason: str) -> ConfigError:
        """One line naming the flag of ``name`` and the source of its value."""
        o = self.options.get(name or "")
        if o is None:
            return ConfigError(f"{name}: {reason}" if name else reason, setting=name)
        origin = self.origin.get(o.name, "")
        where = f" (from {origin})" if origin else ""
        return ConfigError(f"{o.flag}{where}: {reason}", setting=o.name)

    def from_validation(self, e: Any) -> ConfigError:
        """A pydantic ``ValidationError`` as one line (the first problem)."""
        errors = e.errors(include_url=False)
        first = errors[0]
        loc = [str(p) for p in first.get("loc", ())]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        reason = str(first["msg"]).removeprefix("Value error, ") + more
        if first.get("type") in ("extra_forbidden", "unexpected_keyword_argument"):
            return ConfigError(f"unknown setting {'.'.join(loc)!r}{self._where(loc[0])}{more}", setting=loc[-1])
        name = next((p for p in reversed(loc) if p in self.options), None)  # engine.max_num_seqs -> max_num_seqs
        if name is not None:
            return self.error(name, reason)
        where = ".".join(loc)
        return ConfigError(f"{where}{self._where(loc[0])}: {reason}" if where else reason, setting=where or None)

    def build(self, make: Callable[[dict[str, Any]], T]) -> T:
        """``make(values)``, with a ``ValidationError`` or ``ConfigError`` turned
        into one line naming the flag."""
        from pydantic import ValidationError

        try:
            return make(self.values)
        except ValidationError as e:
            raise self.from_validation(e) from None
        except ConfigError as e:
            reason = e.message.removeprefix(f"{e.setting}: ") if e.setting else e.message
            raise self.error(e.setting, reason) from None

    def _where(self, name: str | None) -> str:
        origin = self.origin.get(name or "", "")
        return f" (from {origin})" if origin else ""


def resolve(
    options: Sequence[Option],
    flags: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_name: str = "",
) -> Resolved:
    """Layer file < environment < flags (``None`` flags are not given); parse strings.

    Keys of ``file_values`` that are no option are kept (the caller's model
    decides whether they are allowed).
    """
    by_name = {o.name: o for o in options}
    r = Resolved(options=by_name)
    for key, value in (file_values or {}).items():
        r.values[key] = value
        r.origin[key] = f"{key!r} in {file_name}" if file_name else key
    env = read_env(options, environ)
    for name, value in env.items():
        r.values[name] = value
        var = next(v for v in by_name[name].envvars if (environ if environ is not None else os.environ).get(v))
        r.origin[name] = var
    for name, value in flags.items():
        if value is None or value == [] or value == ():
            continue
        r.values[name] = value
        r.origin[name] = ""
    for name, value in r.values.items():
        o = by_name.get(name)
        if o is None or o.parse is None or value is None:
            continue
        try:
            r.values[name] = o.parse(value)
        except ConfigError as e:
            raise r.error(name, e.message) from None
    return r


def expand_multi_value_flags(args: Sequence[str], options: Iterable[Option]) -> list[str]:
    """``--lora-modules a=/x b=/y --port 1`` -> ``--lora-modules a=/x --lora-modules b=/y --port 1``.

    Click options take one value per flag; a ``multi_value`` option also takes
    the words after it up to the next one that starts with ``-``.
    """
    flags = {f for o in options if o.multi_value for f in o.flags}
    out: list[str] = []
    current: str | None = None  # the multi-value flag whose values are being read
    taken = 0
    for a in args:
        if a == "--":
            current = None
        elif a.startswith("-"):
            name = a.split("=", 1)[0]
            current = name if name in flags else None
            taken = int(a != name)  # --flag=value already holds one value
        elif current is not None:
            if taken:
                out.append(current)
            taken += 1
        out.append(a)
    return out


def multi_value_command_class(options: Sequence[Option]) -> type:
    """A typer command class whose ``multi_value`` flags take several values (``expand_multi_value_flags``)."""
    import typer.core

    class MultiValueCommand(typer.core.TyperCommand):
        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            return super().parse_args(ctx, expand_multi_value_flags(args, options))

    return MultiValueCommand


def typer_command(
    run: Callable[[dict[str, Any]], None],
    options: Sequence[Option],
    *,
    doc: str,
    params: Sequence[inspect.Parameter] = (),
) -> Callable[..., None]:
    """A function that typer makes a command of: ``params`` first, then one flag
    per option.  It calls ``run`` with what the command line gave (name -> value;
    options not given are left out, so the environment and the file can fill them).
    """
    import typer

    sig = list(params)
    for o in options:
        decls = [f"{o.flag}/--no-{o.flag[2:]}", *o.flags[1:]] if o.kind is bool else list(o.flags)
        ann: Any = list[o.kind] if o.multiple else o.kind  # type: ignore[name-defined]
        opt = typer.Option(None, *decls, help=o.help_text(), show_default=False,
                           metavar=f"<{o.kind.__name__}>" if o.multiple else None)  # fmt: skip
        sig.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann | None))
    names = {o.name for o in options}

    def command(*args: Any, **given: Any) -> None:
        run({k: v for k, v in given.items() if k not in names or (v is not None and v != [])})

    command.__signature__ = inspect.Signature(sig)  # type: ignore[attr-defined]
    command.__doc__ = doc
    return command
