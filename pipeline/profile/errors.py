"""A bad profile as one line: `ProfileError` (its message is the line the operator sees) and pydantic's errors
rendered as that line, naming the file, the dotted key, what was expected and the offending value. Its own
module: it reads the models (field types, union members, list items) without being part of them, and the
loader only raises what it renders.
"""
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ValidationError

from pipeline.profile.schema import DataSource, Profile


class ProfileError(ValueError):
    """A bad profile: the message is the one line the operator sees."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "{" + ", ".join(tp.model_fields) + "} tables" if tp is DataSource else "a table"
    return getattr(tp, "__name__", str(tp))


def _field_at(loc: tuple, data: dict) -> tuple[str, Any, Any]:
    """The dotted key of an error location (list items as [i], union member tags skipped), the declared
    type there, and the value there in the raw data (None where it has none)."""
    tp: Any = Profile
    value: Any = data
    key = ""
    for n, part in enumerate(loc):
        if isinstance(part, int):
            if typing.get_origin(tp) is not list:
                break
            key, tp = f"{key}[{part}]", typing.get_args(tp)[0]
            value = value[part] if isinstance(value, list) and part < len(value) else None
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            members = {_tag(a): a for a in typing.get_args(tp)}
            if part in members:
                if n == len(loc) - 1:  # the value fits no member: name the union
                    break
                tp = members[part]
                continue
        if not (isinstance(tp, type) and issubclass(tp, BaseModel)):
            break
        key = f"{key}.{part}" if key else part
        value = value.get(part) if isinstance(value, dict) else None
        field = tp.model_fields.get(part)
        if field is None:
            break
        tp = field.annotation
    return key, tp, value


def _tag(tp: Any) -> str:
    """pydantic's name of a union member in an error location (str, list[DataSource], …)."""
    if typing.get_origin(tp) is list:
        return f"list[{_tag(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _first(errors: list[dict]) -> dict:
    """The error to show: the first, unless a union field also failed deeper inside one of its members
    (an unknown key in a source table says more than "expected a string")."""
    first = errors[0]
    deeper = [e for e in errors if len(e["loc"]) > len(first["loc"]) and e["loc"][:2] == first["loc"][:2]]
    return min(deeper, key=lambda e: e["type"] != "extra_forbidden", default=first)


def one_line(exc: ValidationError, data: dict, source: Path) -> str:
    """pydantic's first error as the operator's one line: file, dotted key, what was expected, the value."""
    err = _first([dict(e) for e in exc.errors()])
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "profile_rule":
        return f"{source}: key '{ctx['key']}': {ctx['why']}, got {ctx['value']!r}"
    if kind == "profile_missing":
        return f"{source}: missing required key '{ctx['key']}' ({ctx['because']})"
    dotted, tp, value = _field_at(err["loc"], data)
    if kind == "extra_forbidden":
        return f"{source}: unknown key '{dotted}' (value {err['input']!r})"
    if kind == "missing":
        return f"{source}: missing required key '{dotted}'"
    bounds = {"greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
              "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}"}
    if kind in bounds:
        why = "must be a TCP port (1-65535)" if dotted == "server.port" else bounds[kind].format(**ctx)
    else:
        why = "expected " + ("a table" if kind in ("model_type", "dict_type") else _type_name(tp))
    return f"{source}: key '{dotted}': {why}, got {value!r}"
