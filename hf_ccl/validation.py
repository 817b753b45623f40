"""Checks of user-given values before anything is built, trained or written: types against annotations, ranges.

`check_value("training.learning_rate", "abc", float)` raises `ConfigError("training.learning_rate must be a
number, got 'abc'")`. A value is converted only where nothing can be lost: a number that YAML 1.1 read as a string
(`1e-3`), an integral float for an integer field. The same checks serve `RunConfig`, `ContinualArguments`, the
`training` section (TrainingArguments' annotations) and every method's config dataclass.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

#: What a Hugging Face token looks like (`hf_` and a long run of letters and digits): never printed.
_TOKEN = re.compile(r"hf_[A-Za-z0-9]{10,}")
_SEQUENCES = (list, tuple, set, frozenset)
_PLURALS = {float: "numbers", int: "integers", str: "strings", bool: "true/false values"}


class ConfigError(ValueError):
    """A value a user gave is wrong; the message names the key and what to give instead (tokens redacted).
    `key` is the dotted key of the value, when one value is at fault."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(redact_secrets(message))
        self.key = key


def redact_secrets(text: str) -> str:
    """`text` with anything that looks like a Hugging Face token replaced by `hf_***`."""
    return _TOKEN.sub("hf_***", text)


#: A value that is a Hugging Face token (`hf_` and 30 or more letters and digits; real ones have 34): refused in a
#: config, where it would be written to run_config.yaml, the checkpoints and the cards.
_TOKEN_VALUE = re.compile(r"hf_[A-Za-z0-9]{30,}")


def check_no_tokens(values: Any, key: str = "") -> None:
    """Refuse (`ConfigError` naming the key, never the value) a string anywhere in `values` (nested mappings,
    sequences and dataclasses; keys too) that looks like a Hugging Face token: a config is saved with the run."""
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        values = {item.name: getattr(values, item.name) for item in dataclasses.fields(values)}
    if isinstance(values, str):
        if _TOKEN_VALUE.search(values):
            where = key or "a config value"
            raise ConfigError(
                f"{where} holds what looks like a Hugging Face token: a token in the config would be written to "
                "run_config.yaml, the checkpoints and the model cards. Remove it; give the token through HF_TOKEN or "
                "`hf auth login`", key or None)
    elif isinstance(values, Mapping):
        for name, value in values.items():
            child = f"{key}.{name}" if key else str(name)
            check_no_tokens(str(name), key or "a config key")
            check_no_tokens(value, child)
    elif isinstance(values, _SEQUENCES):
        for index, value in enumerate(values):
            check_no_tokens(value, f"{key}[{index}]")


# ----- types ---------------------------------------------------------------------------------------------------
def describe(annotation: Any) -> str:
    """A short English description of what `annotation` accepts, for error messages."""
    if annotation is Any:
        return "any value"
    if annotation is type(None) or annotation is None:
        return "null"
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"one of {[member.value for member in annotation]}"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args) and str in args:
            args = tuple(a for a in args if a is not str)  # `Enum | str`: a string naming a member
        return " or ".join(dict.fromkeys(describe(a) for a in args))
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if origin in _SEQUENCES or _is_abc(origin, "Sequence", "Iterable", "Collection"):
        item = args[0] if args else Any
        return f"a list of {_PLURALS[item]}" if item in _PLURALS else "a list"
    if annotation in (dict, typing.Mapping) or origin is dict or _is_abc(origin, "Mapping"):
        return "a mapping"
    if isinstance(annotation, type):
        return f"a {annotation.__name__}"
    return str(annotation)


def _is_abc(origin: Any, *names: str) -> bool:
    return getattr(origin, "__module__", "") == "collections.abc" and getattr(origin, "__name__", "") in names


def show(value: Any) -> str:
    """A value as an error message shows it (a long one shortened)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_value(key: str, value: Any, annotation: Any) -> Any:
    """`value`, converted where lossless, if it matches `annotation`; else a `ConfigError` naming `key`."""
    for convert in (False, True):  # an exact match first: `str | float` keeps "1e-3" a string
        ok, result = _match(key, value, annotation, convert)
        if ok:
            return result
    raise ConfigError(f"{key} must be {describe(annotation)}, got {show(value)}", key)


def _match(key: str, value: Any, annotation: Any, convert: bool) -> tuple[bool, Any]:
    if annotation is Any or isinstance(annotation, typing.TypeVar):
        return True, value
    if annotation is type(None) or annotation is None:
        return value is None, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return _as_int(value, convert)
    if annotation is float:
        return _as_float(value, convert)
    if annotation is str:
        return isinstance(value, str), value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        if isinstance(value, annotation):
            return True, value
        return value in [member.value for member in annotation], value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums and str in args and isinstance(value, str):  # `SchedulerType | str`: the string must name a member
            return any(_match(key, value, e, convert)[0] for e in enums), value
        for member in args:
            ok, result = _match(key, value, member, convert)
            if ok:
                return True, result
        return False, value
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args), value
    if origin in _SEQUENCES or _is_abc(origin, "Sequence", "Iterable", "Collection"):
        if not isinstance(value, (list, tuple, set, frozenset)):
            return False, value
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = args[:1]
        elif origin is tuple and args:
            if len(args) != len(value):
                return False, value
            return True, tuple(check_value(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
        item = args[0] if args else Any
        checked = [check_value(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        return True, origin(checked) if origin in (set, frozenset) else checked
    if annotation in (dict, typing.Mapping) or origin is dict or _is_abc(origin, "Mapping"):
        if not isinstance(value, Mapping):
            return False, value
        key_type, value_type = args if len(args) == 2 else (Any, Any)
        return True, {
            check_value(f"{key} key", k, key_type): check_value(f"{key}.{k}", v, value_type) for k, v in value.items()
        }
    if origin is not None and isinstance(origin, type):  # another generic (type[X], ...): its class decides
        return isinstance(value, origin), value
    if _is_abc(origin, "Callable") or annotation is Callable:
        return callable(value), value
    if isinstance(annotation, type):
        return isinstance(value, annotation), value
    return True, value  # an annotation this module does not read: accepted, the consumer checks it


def _as_float(value: Any, convert: bool) -> tuple[bool, Any]:
    if isinstance(value, bool):
        return False, value
    if isinstance(value, (int, float)):
        return not (isinstance(value, float) and math.isnan(value)), value
    if convert and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return False, value
        return not math.isnan(number), number
    return False, value


def _as_int(value: Any, convert: bool) -> tuple[bool, Any]:
    if isinstance(value, bool):
        return False, value
    if isinstance(value, int):
        return True, value
    if not convert:
        return False, value
    ok, number = _as_float(value, convert=True)
    if ok and math.isfinite(number) and float(number).is_integer():
        return True, int(number)
    return False, value


def type_hints(owner: Any) -> dict[str, Any]:
    """The resolved annotations of a class or function; one that cannot be resolved (a name imported for type
    checking only) reads as `Any`."""
    try:
        return typing.get_type_hints(owner)
    except (NameError, TypeError):
        pass
    namespace = vars(sys.modules[owner.__module__]) if owner.__module__ in sys.modules else {}
    hints: dict[str, Any] = {}
    for klass in reversed(getattr(owner, "__mro__", [owner])):
        for name, annotation in getattr(klass, "__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, dict(namespace)) if isinstance(annotation, str) else annotation
            except Exception:  # an unresolvable annotation is not checked
                hints[name] = Any
    return hints


def check_mapping(values: Mapping[str, Any], hints: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every value of `values` checked against `hints[key]` (a key without a hint passes as it is); returns the
    checked, converted values. Keys are named `<prefix><key>` in errors."""
    return {key: check_value(f"{prefix}{key}", value, hints[key]) if key in hints else value
            for key, value in values.items()}


def check_dataclass(instance: Any, prefix: str = "", names: Collection[str] | None = None) -> None:
    """Check every init field of a dataclass instance (those in `names`, when given) against its annotation, storing
    converted values back."""
    hints = type_hints(type(instance))
    for item in dataclasses.fields(instance):
        if item.init and item.name in hints and (names is None or item.name in names):
            value = getattr(instance, item.name)
            checked = check_value(f"{prefix}{item.name}", value, hints[item.name])
            if checked is not value:
                setattr(instance, item.name, checked)


# ----- ranges --------------------------------------------------------------------------------------------------
def check_range(
    key: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    also: str = "",
) -> None:
    """`ConfigError` unless `low <= value <= high` (`<` with `low_open` / `high_open`); None passes (an unset
    option). `also` is appended to the requirement, e.g. "or null"."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high or math.isnan(value)):
        return
    if low is not None and high is not None:
        requirement = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        requirement = f"{'>' if low_open else '>='} {low}"
    else:
        requirement = f"{'<' if high_open else '<='} {high}"
    raise ConfigError(f"{key} must be {requirement}{' ' + also if also else ''}, got {show(value)}", key)


def check_choice(key: str, value: Any, choices: Any) -> None:
    """`ConfigError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {show(value)}", key)


def check_count_or_fraction(key: str, value: Any, unit: str = "steps", whole: str = "the task's steps") -> None:
    """A count that may also be a fraction below 1 (transformers' rule for warmup, logging and save steps): >= 0,
    and a whole number from 1 on (`int()` would otherwise cut it silently)."""
    check_range(key, value, 0)
    if isinstance(value, float) and value >= 1 and not value.is_integer():
        raise ConfigError(
            f"{key} must be a whole number of {unit}, or a fraction below 1 of {whole}, got {show(value)}", key
        )


def known_keys(given: Mapping[str, Any], valid: Any, what: str, where: str = "", listing: str = "valid") -> None:
    """`ConfigError` naming the unknown keys of `given` (never their values) and listing the valid ones in their
    own order: "Unknown <what> [...]< in where>; <listing>: a, b"."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        place = f" in {where}" if where else ""
        raise ConfigError(f"Unknown {what} {unknown}{place}; {listing}: {', '.join(valid)}")
