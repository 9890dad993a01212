"""Reading JSON data back into dataclasses by their type hints, so that a receipt edited by hand (a number written as a
string, a field renamed or missing) is refused naming the field, instead of failing later inside an attach."""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any, Sequence


class FieldError(ValueError):
    """A JSON value that does not fit its field: `where` is the field's path (`sites[0].shapes[1].speedup`)."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"field '{where}' {problem}")
        self.where = where


def read(hint: Any, value: Any, where: str) -> Any:
    """`value` (as `json.loads` gives it) as the type `hint` names: tuples from lists, enums from their values,
    dataclasses from objects (`fields`); a value of another type raises FieldError naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` unions occur in records
        return read(inner, value, where)
    if hint in (bool, int, float, str):
        return _scalar(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            raise FieldError(where, f"is {_shown(value)}; expected one of {', '.join(repr(m.value) for m in hint)}")
    if dataclasses.is_dataclass(hint):
        return hint(**fields(hint, value, where))
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise FieldError(where, f"is {_shown(value)}; expected a list")
        if origin is tuple and args[-1] is not Ellipsis and len(value) != len(args):
            raise FieldError(where, f"has {len(value)} items; expected {len(args)}")
        kinds = [args[0]] * len(value) if args[-1] is Ellipsis or origin is list else list(args)
        items = [read(k, v, f"{where}[{i}]") for i, (k, v) in enumerate(zip(kinds, value))]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(where, f"is {_shown(value)}; expected an object")
        return {k: read(args[1], v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"json_fields.read has no rule for {hint!r} (at {where})")


def fields(cls: type, data: Any, where: str = "", derived: Sequence[str] = ()) -> dict[str, Any]:
    """The keyword arguments of dataclass `cls` from the JSON object `data`: every field read by its hint; a field
    without a default must be present; a key that is no field (nor one of `derived`, written for readers) is refused."""
    if not isinstance(data, dict):
        raise FieldError(where or "(top)", f"is {_shown(data)}; expected an object")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known and key not in derived:
            raise FieldError(_join(where, key), f"is unknown; expected only {', '.join(known)}")
    out: dict[str, Any] = {}
    for name, f in known.items():
        if name in data:
            out[name] = read(hints[name], data[name], _join(where, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FieldError(_join(where, name), "is missing")
    return out


def _scalar(kind: type, value: Any, where: str) -> Any:
    """bool, int, float or str, as given; a bool is no number, an int serves as a float."""
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, kind) and not isinstance(value, bool) if kind is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, str))
    if not ok:
        expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise FieldError(where, f"is {_shown(value)}; expected {expected}")
    return value


def _shown(value: Any) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
