"""`PairTrainer`: a `transformers.Trainer` that trains the learner heads of one modality-pair task.

Like the official CMCL code (spec cmcl.md §2.4), one Trainer (fresh AdamW and LR schedule) trains one step of the
stream, and the methods' gradient hooks run from a callback: `pre_optimizer_step` after backward and grad-norm
clipping (and, with several processes, after the gradient all-reduce), `post_optimizer_step` right after
`optimizer.step()`. The loss is the pair objective (Eq. 2) on this process's batch plus the methods' terms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..trainer import NonFiniteLossError
from .methods.base import PairMethod, PairTaskContext

PAIR_TERM = "pair"


class PairMethodHooks(TrainerCallback):
    """Runs each method's optimizer-step hooks on the unwrapped heads."""

    def __init__(self, trainer: PairTrainer):
        self.trainer = trainer

    def _heads(self) -> torch.nn.Module:
        return self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        """`context.global_step` = the optimizer steps done so far, for the loss terms of this step."""
        self.trainer.context.global_step = state.global_step
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self.trainer.context.global_step = state.global_step
        for method in self.trainer.methods:
            method.pre_optimizer_step(self._heads(), self.trainer.context)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        for method in self.trainer.methods:
            method.post_optimizer_step(self._heads(), self.trainer.context)
        return control


class PairTrainer(Trainer):
    """Trainer for one pair task: `compute_loss` = pair loss + Σ method terms (each logged as `loss/<name>`); a
    non-finite loss stops training with `NonFiniteLossError`."""

    def __init__(
        self, *args: Any, methods: Sequence[PairMethod] = (), context: PairTaskContext, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.methods = list(methods)
        self.context = context
        self.model_accepts_loss_kwargs = False
        self._term_sums: dict[str, torch.Tensor | float] = {}
        self._term_count = 0
        self.add_callback(PairMethodHooks(self))

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        heads = self.accelerator.unwrap_model(model)
        task = self.context.task
        # the pair loss runs through `model`: DDP-wrapped with several processes, so its gradients are averaged
        terms = {
            PAIR_TERM: self.context.objective(
                model, task.modality_a, task.modality_b, inputs["a"], inputs["b"]
            )
        }
        for method in self.methods:
            for name, value in method.loss_terms(heads, inputs, self.context).items():
                terms[f"{method.name}/{name}"] = value
        loss = torch.stack([term.float() for term in terms.values()]).sum()
        if not torch.isfinite(loss):
            values = ", ".join(f"{name}={float(value.detach()):.4g}" for name, value in terms.items())
            raise NonFiniteLossError(
                f"Non-finite loss at task {self.context.task_index} ({task.name!r}), step "
                f"{self.state.global_step + 1}. Loss terms: {values}"
            )
        if model.training:
            for name, value in terms.items():
                self._term_sums[name] = (
                    self._term_sums.get(name, 0.0) + value.detach().float()
                )  # no host sync
            for method in self.methods:
                for name, value in method.metrics().items():
                    key = f"{method.name}/{name}"
                    self._term_sums[key] = self._term_sums.get(key, 0.0) + float(value)
            self._term_count += 1
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._term_count and "loss" in logs:
            for name, total in self._term_sums.items():
                mean = float(total) / self._term_count
                logs[name if "/" in name else f"loss/{name}"] = (
                    round(mean, 6) if math.isfinite(mean) else mean
                )
            self._term_sums.clear()
            self._term_count = 0
        super().log(logs, start_time)
