"""The interface of a continual method on a modality-pair stream (CMCL's setting), and its registry.

Training touches only the learner heads (`hf_ccl.pairs.heads.LearnerHeads`) on cached frozen-encoder features, so
the hooks see feature tensors, not images or tokens:

| hook                  | when                                                                    |
|-----------------------|-------------------------------------------------------------------------|
| `on_task_start`       | before a task trains (DNS builds its projectors here, Alg. 1 l.4–7)      |
| `loss_terms`          | every training batch: extra named terms, added to the pair loss         |
| `pre_optimizer_step`  | after backward and clipping, before `optimizer.step()` (gradient edits) |
| `post_optimizer_step` | right after `optimizer.step()` (update edits)                           |
| `on_task_end`         | after a task trained, before it is evaluated (covariances, memories)    |
| `metrics`             | diagnostics logged beside the loss                                      |
| `state_dict` / `load_state_dict` | everything a resumed stream needs                            |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...methods.base import MethodConfig

if TYPE_CHECKING:
    from ..heads import LearnerHeads
    from ..objective import PairObjective
    from ..task import PairStream, PairTask


@dataclass
class PairTaskContext:
    """What a pair-method hook knows: the task, its place in the stream, the heads, the task's cached training
    features (`train_a` [n, d] for `task.modality_a`, `train_b` for `task.modality_b`, row i of each is pair i)
    and the loss (`objective(heads, task.modality_a, task.modality_b, xa, xb)`)."""

    task_index: int
    task: PairTask
    stream: PairStream
    heads: LearnerHeads
    train_a: torch.Tensor
    train_b: torch.Tensor
    objective: PairObjective
    seed: int = 0
    global_step: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable_modalities(self) -> tuple[str, str]:
        return self.task.modalities

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters of the current pair's heads (the only ones that move this task), by name."""
        names = set(self.heads.parameter_names(self.task.modalities))
        return {name: p for name, p in self.heads.named_parameters() if name in names}


class PairMethod:
    """Base class of every pair method; all hooks are no-ops."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        if config is None or isinstance(config, dict):
            config = self.config_class.from_dict(config, self.name)
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"Method {self.name!r} expects a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config

    def on_task_start(self, context: PairTaskContext) -> None:
        """Before the task trains."""

    def loss_terms(
        self, heads: LearnerHeads, batch: Mapping[str, torch.Tensor], context: PairTaskContext
    ) -> dict[str, torch.Tensor]:
        """Extra loss terms, already weighted, for a batch {"a": [n, d], "b": [n, d]} of the current task."""
        return {}

    def pre_optimizer_step(self, heads: LearnerHeads, context: PairTaskContext) -> None:
        """Edit `p.grad` (already clipped and, across processes, averaged) before the optimizer steps."""

    def post_optimizer_step(self, heads: LearnerHeads, context: PairTaskContext) -> None:
        """Edit the parameters right after `optimizer.step()`."""

    def on_task_end(self, context: PairTaskContext) -> None:
        """After the task trained, before it is evaluated and checkpointed. Every head is frozen
        (`requires_grad=False`) then: a method that needs gradients (EWC's Fisher) turns them on and restores them."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


PAIR_METHODS: dict[str, type[PairMethod]] = {}


def register_pair_method(cls: type[PairMethod]) -> type[PairMethod]:
    """Class decorator: make a pair method available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name` to be registered")
    if cls.name in PAIR_METHODS and PAIR_METHODS[cls.name] is not cls:
        raise ValueError(f"A pair method named {cls.name!r} is already registered")
    PAIR_METHODS[cls.name] = cls
    return cls


def build_pair_methods(
    names: str | Sequence[str], method_args: Mapping[str, Mapping[str, Any]] | None = None
) -> list[PairMethod]:
    """Instantiate pair methods by name (`vanilla` alone, or any composition); unknown names and options fail
    before training, listing the valid ones."""
    names = [names] if isinstance(names, str) else list(names)
    if len(set(names)) != len(names):
        raise ValueError(f"Method list {names} names a method twice")
    unknown = [n for n in names if n not in PAIR_METHODS]
    if unknown:
        raise ValueError(f"Unknown pair method(s) {unknown}; valid: {', '.join(sorted(PAIR_METHODS))}")
    method_args = dict(method_args or {})
    stray = sorted(set(method_args) - set(names))
    if stray:
        raise ValueError(f"method_args given for {stray}, which are not in the method list {names}")
    return [PAIR_METHODS[n](dict(method_args.get(n, {}))) for n in names if n != "vanilla"]


@register_pair_method
class Vanilla(PairMethod):
    """Sequential fine-tuning of the pair's heads (the paper's Vanilla baseline): no method hooks at all."""

    name = "vanilla"
