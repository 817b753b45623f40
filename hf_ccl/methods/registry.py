"""The method registry: a method is added in one place, with `@register_method`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ..validation import ConfigError
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
        raise ConfigError(f"Unknown method {name!r}; valid methods: {', '.join(available_methods())}")
    return METHODS[name]


def check_combination(classes: Sequence[type[ContinualMethod]]) -> None:
    """Refuse methods that make no sense together or in this order, from what each declares (`roles`,
    `conflicts`, `runs_after`, `runs_before`), with the reason. A method that never trains the model
    (`trains_model=False`) runs alone."""
    frozen = [cls.name for cls in classes if not cls.trains_model]
    if frozen and len(classes) > 1:
        others = [cls.name for cls in classes if cls.name != frozen[0]]
        raise ConfigError(f"Method {frozen[0]!r} cannot be combined with {others}: it never trains the model (its "
                          "fit is closed-form on the frozen model's features), which they would train: use it alone")
    for first, second in itertools.combinations(classes, 2):
        for this, other in ((first, second), (second, first)):
            for role, why in this.conflicts.items():
                if role in other.roles:
                    raise ConfigError(
                        f"Methods {this.name!r} and {other.name!r} cannot be combined: {other.name} "
                        f"{other.roles[role]}, and {this.name} {why}"
                    )
    for index, method in enumerate(classes):
        earlier, later = classes[:index], classes[index + 1:]
        for role, why in method.runs_after.items():
            for other in later:
                if role in other.roles:
                    raise ConfigError(f"Put {method.name!r} after {other.name!r} in the method list: {method.name} "
                                      f"{why}, and {other.name} {other.roles[role]}")
        for role, why in method.runs_before.items():
            for other in earlier:
                if role in other.roles:
                    raise ConfigError(f"Put {method.name!r} before {other.name!r} in the method list: {method.name} "
                                      f"{why}, and {other.name} {other.roles[role]}")


def check_methods(methods: Sequence[ContinualMethod], samples_per_task: int | None = None) -> None:
    """Methods already built (however they were made), checked as a run uses them: their combination and order,
    and a compute budget for the methods that need one."""
    check_combination([type(method) for method in methods])
    budget = [method.name for method in methods if method.needs_compute_budget]
    if budget and samples_per_task is None:
        raise ConfigError(f"Method(s) {budget} need a compute budget: set samples_per_task (training examples per "
                          "task; it sets every task's max_steps)")


def build_methods(
    names: str | Sequence[str], method_args: Mapping[str, Mapping[str, Any]] | None = None
) -> list[ContinualMethod]:
    """Instantiate methods by name, with per-method options from `method_args` (`{name: {option: value}}`).

    Every name, option value and combination is checked before anything is built, so a typo or a combination
    that makes no sense fails before training starts.
    """
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError(f"No method given; valid methods: {', '.join(available_methods())}")
    if len(set(names)) != len(names):
        raise ConfigError(f"Method list {names} names a method twice")
    method_args = dict(method_args or {})
    stray = sorted(set(method_args) - set(names))
    if stray:
        raise ConfigError(f"method_args given for {stray}, which are not in the method list {names}")
    for name, options in method_args.items():
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"method_args.{name} must be a mapping of option: value, got {type(options).__name__}")
    classes = [get_method_class(name) for name in names]
    check_combination(classes)
    return [cls(dict(method_args.get(cls.name) or {})) for cls in classes]
