"""The method registry: a method is added in one place, with `@register_method`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import ContinualMethod

METHODS: dict[str, type[ContinualMethod]] = {}


def register_method(cls: type[ContinualMethod]) -> type[ContinualMethod]:
    """Class decorator: make a method available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name` to be registered")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"A method named {cls.name!r} is already registered ({METHODS[cls.name].__name__})")
    METHODS[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    return sorted(METHODS)


def get_method_class(name: str) -> type[ContinualMethod]:
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}; valid methods: {', '.join(available_methods())}")
    return METHODS[name]


def build_methods(
    names: str | Sequence[str], method_args: Mapping[str, Mapping[str, Any]] | None = None
) -> list[ContinualMethod]:
    """Instantiate methods by name, with per-method options from `method_args` (`{name: {option: value}}`).

    Every name and option is checked before anything is built, so a typo fails before training starts.
    """
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError(f"No method given; valid methods: {', '.join(available_methods())}")
    if len(set(names)) != len(names):
        raise ValueError(f"Method list {names} names a method twice")
    method_args = dict(method_args or {})
    stray = sorted(set(method_args) - set(names))
    if stray:
        raise ValueError(f"method_args given for {stray}, which are not in the method list {names}")
    classes = [get_method_class(name) for name in names]
    return [cls(dict(method_args.get(cls.name, {}))) for cls in classes]
