"""Which ``FLYWHEEL_*`` environment variables name a setting: pydantic-settings ignores the others silently.

A variable is a path through the settings model, its parts joined with ``__`` (case does not
matter): ``FLYWHEEL_AUTH__ADMIN_KEY`` is ``auth.admin_key``; a table of named entries takes any
name at its level (``FLYWHEEL_ENGINES__UP__BASE_URL``). Anything else is reported with the
closest valid name, so ``FLYWHEEL_ADMIN_KEY`` for ``FLYWHEEL_AUTH__ADMIN_KEY`` is caught.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

_NAME = "<NAME>"  # stands for any entry name of a table in the suggestions


def unknown_variables(model: type[BaseModel], prefix: str, environ: Mapping[str, str],
                      also_known: frozenset[str] = frozenset()) -> list[str]:
    """One message per variable with ``prefix`` that names no field of ``model``, with a suggestion."""
    known = sorted(prefix + "__".join(path).upper() for path in _paths(model))
    out = []
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith(prefix) or upper in also_known:
            continue
        parts = upper.removeprefix(prefix).lower().split("__")
        if not _accepts(model, parts):
            out.append(f"{variable} is not a setting{_suggestion(upper, [*known, *also_known])}")
    return out


def _suggestion(variable: str, known: list[str]) -> str:
    close = difflib.get_close_matches(variable, known, n=1, cutoff=0.6)
    if not close:  # the same last part under another table (FLYWHEEL_ADMIN_KEY -> ..._AUTH__ADMIN_KEY)
        tail = variable.rsplit("__", 1)[-1].split("_", 1)[-1]
        close = [name for name in known if name.endswith("_" + tail)][:1]
    return f" (did you mean {close[0]}?)" if close else ""


def _accepts(annotation: Any, parts: list[str]) -> bool:
    """Whether ``parts`` is a path into a value of type ``annotation`` (an empty path: the value itself)."""
    if not parts:
        return True
    if not all(parts):
        return False  # a doubled delimiter or a trailing one
    annotation = _unwrap(annotation)
    if annotation is Any:
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(parts[0])
        return field is not None and _accepts(field.annotation, parts[1:])
    if get_origin(annotation) is dict:
        return _accepts(get_args(annotation)[1], parts[1:])
    if _is_union(annotation):
        return any(_accepts(arg, parts) for arg in get_args(annotation))
    return False  # a scalar or a list: nothing below it


def _paths(annotation: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every leaf path of ``annotation`` (table entries as ``<NAME>``), for suggestions."""
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            yield from _paths(field.annotation, (*prefix, name))
    elif get_origin(annotation) is dict and get_args(annotation)[1] is not Any:
        yield from _paths(get_args(annotation)[1], (*prefix, _NAME))
    elif _is_union(annotation) and any(_is_model(arg) for arg in get_args(annotation)):
        seen: set[tuple[str, ...]] = set()
        for arg in get_args(annotation):
            for path in _paths(arg, prefix):
                if path not in seen:
                    seen.add(path)
                    yield path
    elif prefix:
        yield prefix


def _unwrap(annotation: Any) -> Any:
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _is_model(annotation: Any) -> bool:
    annotation = _unwrap(annotation)
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
