"""The `training` section's defaults (TrainingArguments fields every task uses unless given): import-light, read by
`hf_ccl.arguments` and `hf_ccl.training_options`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Schedules that take no warmup.
NO_WARMUP_SCHEDULES: tuple[str, ...] = ("constant", "reduce_lr_on_plateau", "greedy")


def default_training() -> dict[str, Any]:
    """The training defaults of every run, from Python, YAML or the command line (a given `training` section extends
    them, `with_training_defaults`): settings that train the tiny default CLIP, where TrainingArguments' own (batch 8,
    lr 5e-5, linear, no warmup, no weight decay) train it poorly."""
    return {
        "num_train_epochs": 8,
        "per_device_train_batch_size": 64,
        "learning_rate": 1e-3,
        "weight_decay": 0.1,
        "warmup_steps": 0.1,
        "lr_scheduler_type": "cosine",
        "logging_steps": 10,
    }


def with_training_defaults(training: Mapping[str, Any]) -> dict[str, Any]:
    """`training` over `default_training()`. The default warmup is left out when the given schedule takes none
    (`NO_WARMUP_SCHEDULES`): a default never makes a given value refused."""
    merged = {**default_training(), **training}
    if "warmup_steps" not in training and merged.get("lr_scheduler_type") in NO_WARMUP_SCHEDULES:
        merged.pop("warmup_steps")
    return merged
