"""A command's argparse flags generated from its request model, and the request built back.

The request model (BringUpRequest, StartRequest, SweepRequest, EvalArguments) declares each
argument once: type, default, limits, description. `add_flags` makes one flag per field: the
name is the field's with dashes (`--max-model-len`), the type and choices come from the
annotation (int, float, str, a Literal's values; a bool is a switch), the default and the help
from the field. What only the command line needs is a small declared table per command (`Door`):
`Flag` renames a field's flag or adds a short alias (-tp), makes it positional, inverts a
true-by-default switch (--no-patch), repeats it (action="append") and parses the texts given
into the field's value (NAME=VALUE pairs into a dict); `Nested` spreads a sub-model's fields over
flags of their own (the sweep's --search-start, --prefix-len); `Composed` names flags the
command declares itself and a function that builds the field from them (the sweep's targets);
`cli_only` lists the flags that are presentation (--json) and `mcp_only` the fields without a
flag, each with why. tests/test_front_door_params.py checks that every field is reachable and
every flag belongs to a field or to `cli_only`.

`build` makes the request; a refusal names the flag, not the field (exit code 2, what to do).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tools.errors import InvalidInputError

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Flag:
    """How one field shows on the command line where the rule (--field-name) does not fit.

    `names`: the flags (a name without dashes: a positional); `invert`: a bool defaulting to
    true whose flag stores false; `repeat`: action="append", the texts given go through `parse`;
    `parse`: the flag's value(s) -> the field's value; `spread`: a positional list (nargs)
    filling these fields in order (eval's URL_A [URL_B] -> a, b)."""

    names: tuple[str, ...] = ()
    help: str | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    invert: bool = False
    repeat: bool = False
    parse: Callable[[Any], Any] | None = None
    nargs: str | None = None
    spread: tuple[str, ...] = ()


@dataclass(frozen=True)
class Nested:
    """A field holding a model (the sweep's search, workload): one flag per sub-field, named
    `prefix` + its name unless `flags` says otherwise. The field's value is a dict of the
    sub-fields given, or None when none is."""

    model: type[BaseModel]
    prefix: str = ""
    flags: Mapping[str, Flag] = field(default_factory=dict)


@dataclass(frozen=True)
class Composed:
    """A field the command builds from flags it declares itself (`flags`), with `build(args)`."""

    flags: tuple[str, ...]
    build: Callable[[argparse.Namespace], Any]


Presentation = Flag | Nested | Composed


@dataclass(frozen=True)
class Door:
    """One command's CLI face of a request model: the per-field table, the flags that are only
    presentation (flag -> why) and the fields with no flag (field -> why)."""

    model: type[BaseModel]
    flags: Mapping[str, Presentation] = field(default_factory=dict)
    cli_only: Mapping[str, str] = field(default_factory=dict)
    mcp_only: Mapping[str, str] = field(default_factory=dict)

    def spread_of(self, name: str) -> tuple[str, Flag] | None:
        """(the field whose Flag spreads over `name`, that Flag), if one does."""
        for owner, shown in self.flags.items():
            if isinstance(shown, Flag) and name in shown.spread:
                return owner, shown
        return None


# --- the annotation --------------------------------------------------------------------------


def _plain(annotation: Any) -> Any:
    """`X | None` -> X (a flag not given is the field's default, None or not)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return None if info.default is PydanticUndefined else info.default


def _help(info: FieldInfo, shown: Flag) -> str | None:
    text = shown.help if shown.help is not None else info.description
    default = _default(info)
    if text is not None:
        text = text.replace("%", "%%")
    shown_default = default is not None and not isinstance(default, bool | list | dict)
    if shown.help is None and shown_default and "default" not in (text or ""):
        text = f"{text} (default {default})" if text else f"default {default}"
    return text


def flag_names(name: str, shown: Flag) -> tuple[str, ...]:
    return shown.names or ("--" + name.replace("_", "-"),)


def _add(
    parser: argparse.ArgumentParser,
    name: str,
    dest: str,
    info: FieldInfo,
    shown: Flag,
    default: Any,
) -> None:
    """One flag for one field; TypeError for an annotation the rule cannot show."""
    kind = _plain(info.annotation)
    names = flag_names(name, shown)
    positional = not names[0].startswith("-")
    kw: dict[str, Any] = {"help": _help(info, shown)}
    if not positional:
        kw["dest"] = dest
    if shown.metavar:
        kw["metavar"] = shown.metavar
    elif not positional and typing.get_origin(kind) is not Literal:
        # argparse's own metavar, from the flag (--timeout: TIMEOUT), not from the dest
        long = next((n for n in names if n.startswith("--")), names[0])
        kw["metavar"] = long.lstrip("-").replace("-", "_").upper()
    if kind is bool:
        if default is True and not shown.invert:
            raise TypeError(f"{name}: a switch that is on by default needs Flag(names, invert)")
        kw["action"] = "store_false" if shown.invert else "store_true"
        kw.pop("metavar", None)
        parser.add_argument(*names, **kw)
        return
    if shown.repeat:
        kw.update(action="append", default=[])
    elif shown.nargs:
        kw.update(nargs=shown.nargs)
    else:
        kw["default"] = default
    if shown.type is not None:
        kw["type"] = shown.type
    elif typing.get_origin(kind) is Literal:
        kw["choices"] = list(typing.get_args(kind))
    elif kind in (int, float):
        kw["type"] = kind
    elif kind is not str and shown.parse is None:
        raise TypeError(f"{name}: {kind} needs a Flag with a type or a parse")
    parser.add_argument(*names, **kw)


def add_flags(parser: argparse.ArgumentParser, door: Door) -> None:
    """The flags of every field of the door's model that has one (see the module docstring)."""
    for name, info in door.model.model_fields.items():
        shown = door.flags.get(name, Flag())
        if isinstance(shown, Flag) and shown.spread:
            _add(parser, name, name, info, shown, None)  # the one positional of all its fields
            continue
        if name in door.mcp_only or isinstance(shown, Composed) or door.spread_of(name):
            continue  # no flag, the command's own flags, or another field's positional
        if isinstance(shown, Nested):
            for sub, sub_info in shown.model.model_fields.items():
                sub_shown = shown.flags.get(sub) or Flag(
                    names=("--" + (shown.prefix + sub).replace("_", "-"),)
                )
                _add(parser, sub, f"{name}.{sub}", sub_info, sub_shown, None)
            continue
        _add(parser, name, name, info, shown, _default(info))


# --- the request back ------------------------------------------------------------------------


def values(door: Door, args: argparse.Namespace) -> dict[str, Any]:
    """The field values the command line gives (its defaults are the fields' own)."""
    out: dict[str, Any] = {}
    for name in door.model.model_fields:
        shown = door.flags.get(name, Flag())
        if name in door.mcp_only:
            continue
        if isinstance(shown, Composed):
            out[name] = shown.build(args)
        elif isinstance(shown, Nested):
            given = {
                sub: getattr(args, f"{name}.{sub}")
                for sub in shown.model.model_fields
                if getattr(args, f"{name}.{sub}") is not None
            }
            out[name] = given or None
        elif shown.spread:
            texts = list(getattr(args, flag_names(name, shown)[0]) or [])
            if len(texts) > len(shown.spread):
                label = shown.metavar or flag_names(name, shown)[0]
                raise InvalidInputError(
                    f"{len(texts)} {label} given", f"give at most {len(shown.spread)}"
                )
            out.update(dict(zip(shown.spread, texts, strict=False)))
        elif door.spread_of(name) is None:
            value = getattr(args, name)
            out[name] = shown.parse(value) if shown.parse else value
    return out


def flag_for(door: Door, loc: tuple[Any, ...]) -> str:
    """The flag a validation error's location points at: --port, --search-max, URL."""
    if not loc:
        return "arguments"
    name = str(loc[0])
    shown = door.flags.get(name, Flag())
    spread = door.spread_of(name)
    if spread:
        return spread[1].metavar or flag_names(*spread)[0]
    if isinstance(shown, Composed):
        return " / ".join(shown.flags)
    if isinstance(shown, Nested) and len(loc) > 1:
        sub = str(loc[1])
        sub_shown = shown.flags.get(sub)
        return sub_shown.names[0] if sub_shown else "--" + (shown.prefix + sub).replace("_", "-")
    if isinstance(shown, Flag) and shown.spread:
        return shown.metavar or name
    return flag_names(name, shown)[0] if isinstance(shown, Flag) else name


def build(door: Door, args: argparse.Namespace, model: type[M] | None = None) -> M:
    """The request from the command line; a refusal as InvalidInputError naming the flag."""
    cls = model or door.model
    try:
        return cls(**values(door, args))  # type: ignore[return-value]
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        flag = flag_for(door, tuple(first["loc"]))
        message = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidInputError(f"{flag}: {message}", remedy="fix that flag") from None


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag and positional name a parser accepts, but -h/--help."""
    out: set[str] = set()
    for action in parser._actions:  # argparse has no public list of its arguments
        if isinstance(action, argparse._HelpAction):
            continue
        out.update(action.option_strings or [action.dest])
    return out


def door_flags(door: Door) -> dict[str, set[str]]:
    """field -> the flags that set it (tests compare this with the parser's)."""
    out: dict[str, set[str]] = {}
    for name in door.model.model_fields:
        shown = door.flags.get(name, Flag())
        spread = door.spread_of(name)
        if name in door.mcp_only:
            continue
        if spread:
            out[name] = {flag_names(*spread)[0]}
        elif isinstance(shown, Composed):
            out[name] = set(shown.flags)
        elif isinstance(shown, Nested):
            out[name] = {
                (shown.flags[sub].names[0] if sub in shown.flags else None)
                or "--" + (shown.prefix + sub).replace("_", "-")
                for sub in shown.model.model_fields
            }
        else:
            out[name] = set(flag_names(name, shown))
    return out
