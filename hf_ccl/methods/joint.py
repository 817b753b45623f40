"""Joint training: at task t, train on the union of the train splits of tasks 1..t (the usual upper bound)."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset, concatenate_datasets

from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method


@dataclass
class JointConfig(MethodConfig):
    max_examples: int | None = field(
        default=None,
        metadata={"help": "Cap on the size of the union (seeded random subsample); None keeps every example."},
    )

    def __post_init__(self) -> None:
        check_range("max_examples", self.max_examples, 1, also="or null")


@register_method
class Joint(ContinualMethod[JointConfig]):
    """Train each task on every task's data seen so far. Other methods' transforms apply after this one."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "joint"
    same_step_as = "finetune"
    config_class = JointConfig
    trains_on_past_tasks = True
    roles = {"training_data": "trains each task on the data of every task so far"}
    conflicts = {"training_data": "already trains each task on the data of every task so far: use one of them"}

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        earlier = [task.train for task in context.stream.tasks[: context.task_index]]
        union = concatenate_datasets([*earlier, dataset]) if earlier else dataset
        cap = self.config.max_examples
        if cap is not None and len(union) > cap:
            union = union.shuffle(seed=context.seed).select(range(cap))
        return union
