"""The methods' size checks against the model they will change, before anything is built.

A run's model is known from its config without allocating it: a random model from `model.config`, or a local
checkpoint from its `config.json`. `model_skeleton` builds it on the meta device (its modules, shapes and parameter
count; no memory, milliseconds), and `check_method_sizes` hands it to every method's `check_model`, so that an
option the model cannot take (10^5 MoE experts, a LoRA rank above its layers' rank) is refused before the model,
the data or any file is made. A Hub id's config is not downloaded here: its methods check the real model before they
change it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..validation import ConfigError
from .base import ContinualMethod


def model_skeleton(model_section: dict[str, Any]) -> torch.nn.Module | None:
    """The model a run's `model` section describes, on the meta device; None when its config is not local (a Hub id).
    """
    from transformers import AutoConfig

    from ..families import family_class, family_of, tiny_config

    pretrained, family = model_section.get("pretrained"), model_section.get("family")
    if pretrained:
        if not (Path(pretrained) / "config.json").is_file():
            return None
        config = AutoConfig.from_pretrained(pretrained)
        family = family_of(config)
    else:
        family = family or "clip"
        config = tiny_config(family, **(model_section.get("config") or {}))
    with torch.device("meta"):
        return family_class(family)(config)


def check_method_sizes(methods: list[ContinualMethod], skeleton: torch.nn.Module) -> None:
    """Every method's `check_model` on the run's model skeleton (`model_skeleton`)."""
    for method in methods:
        method.check_model(skeleton)


#: Bytes per parameter of training in float32 with Adam: the weight, its gradient and two moments.
TRAINING_BYTES_PER_PARAMETER = 16


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_model_memory(skeleton: torch.nn.Module, where: str = "model.config") -> None:
    """Refuse a model whose float32 Adam training state alone (`TRAINING_BYTES_PER_PARAMETER` per parameter) is more
    than this machine's memory: it could only fail, after the stream was built, with an allocation error."""
    memory = physical_memory_bytes()
    needed = parameter_count(skeleton) * TRAINING_BYTES_PER_PARAMETER
    if memory is not None and needed > memory:
        raise ConfigError(
            f"{where} describes a model of {parameter_count(skeleton):,} parameters: training it in float32 with Adam "
            f"needs at least {needed / 2**30:,.1f} GiB (weights, gradients, two moments), more than this machine's "
            f"{memory / 2**30:,.1f} GiB; choose smaller sizes", where)


def parameter_count(model: torch.nn.Module, skip_prefix: str | None = None) -> int:
    """Parameters of `model` (meta or real), leaving out those whose name starts with `skip_prefix`."""
    return sum(p.numel() for name, p in model.named_parameters()
               if skip_prefix is None or not name.startswith(skip_prefix))
