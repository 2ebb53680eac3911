"""Typed validation of plain dicts (from YAML) into dataclasses.

Every error is one line naming the source file, the dotted field and what would have been valid,
so a typo in a recipe is fixed without reading code.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints


class RecipeError(ValueError):
    """A recipe (or an override of it) that cannot be run; the message names file and field."""

    def __init__(self, source: str, field: str, problem: str):
        self.source, self.field, self.problem = source, field, problem
        message = f"{source}: {field}: {problem}" if field else f"{source}: {problem}"
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))  # always one line


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The valid range of a number field, written `Annotated[int, Bounds(low=1)]` in a spec."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False  # `low` itself is not valid (a learning rate of 0)
    open_high: bool = False  # `high` itself is not valid (an Adam beta of 1)

    def problem(self, value: float) -> str | None:
        """Why `value` is out of range (None when it is in range)."""
        too_low = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        if not (too_low or too_high):
            return None
        low = None if self.low is None else f"{'greater than' if self.open_low else 'at least'} {self.low:g}"
        high = None if self.high is None else f"{'less than' if self.open_high else 'at most'} {self.high:g}"
        return f"must be {' and '.join(filter(None, (low, high)))}, got {value!r}"


AT_LEAST_1 = Bounds(low=1)
NOT_NEGATIVE = Bounds(low=0)
POSITIVE = Bounds(low=0, open_low=True)
FRACTION = Bounds(low=0, high=1, open_high=True)  # momentum, betas, dropout


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, source: str, field: str) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extras = get_args(tp)
        value = _coerce(value, base, source, field)
        for bounds in (e for e in extras if isinstance(e, Bounds)):
            problem = None if value is None else bounds.problem(value)
            if problem:
                raise RecipeError(source, field, problem)
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, source, field)
            except RecipeError as error:
                errors.append(error.problem)
        raise RecipeError(source, field, " or ".join(errors))
    if origin is Literal:
        if value not in get_args(tp):
            raise RecipeError(source, field, f"got {value!r}; valid choices: {', '.join(map(str, get_args(tp)))}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, source, field)
    if origin in (dict, typing.Dict) or tp is dict:
        if not isinstance(value, dict):
            raise RecipeError(source, field, f"expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin in (list, typing.List) or tp is list:
        if not isinstance(value, list):
            raise RecipeError(source, field, f"expected a list, got {type(value).__name__} {value!r}")
        (item_type,) = get_args(tp) or (Any,)
        return [_coerce(v, item_type, source, f"{field}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(source, field, f"must be a finite number, got {value!r}")
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise RecipeError(source, field, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


T = typing.TypeVar("T")


def build(cls: type[T], data: Any, source: str, prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise RecipeError(source, prefix, f"expected a mapping, got {type(data).__name__} {data!r}")
    hints = get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys need not be strings
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise RecipeError(source, where, f"unknown field; valid fields: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{prefix}.{name}" if prefix else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], source, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(source, where, "missing required field")
    return cls(**kwargs)


def as_dict(obj: Any) -> Any:
    """The plain-data form of a built dataclass tree (for YAML, JSON and fingerprints)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_dict(v) for v in obj]
    return obj
