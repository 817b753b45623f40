"""Which base parameters train: freezing for parameter-efficient methods (LoRA, prompt learning).

A parameter-efficient method freezes the model it adapts for the length of a task, keeps trainable only its own
parameters and the base parameters the user names (`trainable` patterns, e.g. the token embedding that CLL-CLIP
trains beside an adapter), and gives the model back with every `requires_grad` flag as it found it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from torch import nn


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether a parameter name matches any `fnmatch` pattern (`"*"` matches every parameter)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def requires_grad_flags(model: nn.Module) -> dict[str, bool]:
    """Every parameter's `requires_grad` flag, by name."""
    return {name: param.requires_grad for name, param in model.named_parameters()}


def freeze_base(
    model: nn.Module, trainable: Sequence[str] = (), is_own: Callable[[str], bool] = lambda name: False
) -> list[str]:
    """Freeze every parameter of `model` except the method's own (`is_own(name)`) and those matching `trainable`.

    Returns the names of the parameters left trainable. A pattern that matches no parameter is an error (a typo
    would otherwise silently train nothing of what was meant).
    """
    unused = [p for p in trainable if not any(fnmatch.fnmatchcase(n, p) for n, _ in model.named_parameters())]
    if unused:
        raise ValueError(f"trainable pattern(s) {unused} match no parameter of the model (names look like "
                         "'text_model.embeddings.token_embedding.weight')")
    kept = []
    for name, param in model.named_parameters():
        keep = is_own(name) or matches(name, trainable)
        param.requires_grad_(keep)
        if keep:
            kept.append(name)
    return kept


def restore_flags(model: nn.Module, flags: dict[str, bool]) -> None:
    """Set `requires_grad` back to `flags` for the parameters it names (others are left as they are)."""
    for name, param in model.named_parameters():
        if name in flags:
            param.requires_grad_(flags[name])
