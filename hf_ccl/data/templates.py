"""Prompt templates: turning a class label into text ("a sketch of a {label}")."""

from __future__ import annotations

import json
from functools import lru_cache

from ..paths import prompt_templates_path

PLACEHOLDERS = ("{label}", "{c}", "{}")


def format_template(template: str, label: str) -> str:
    """Put `label` into `template`; accepts the placeholders `{label}`, `{c}` (CLIP_benchmark) and `{}`."""
    for placeholder in PLACEHOLDERS:
        if placeholder in template:
            return template.replace(placeholder, label)
    raise ValueError(f"Template {template!r} has no placeholder; use one of {', '.join(PLACEHOLDERS)}")


@lru_cache(maxsize=8)
def _all_templates(path: str) -> dict[str, list[str]]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def benchmark_templates(name: str = "cifar10") -> list[str]:
    """Zero-shot templates of one CLIP_benchmark dataset (e.g. `cifar10`, `imagenet1k`), from `shared/prompts`."""
    table = _all_templates(str(prompt_templates_path()))
    if name not in table:
        raise KeyError(f"No prompt templates named {name!r}; available: {', '.join(sorted(table))}")
    return list(table[name])
