"""WiSE-FT (Wortsman et al. 2022, "Robust fine-tuning of zero-shot models", CVPR), as ZSCL's continual baseline
(Zheng et al. 2023, ICCV; its `WiSE-FT` rows of MTIL).

After each task trains, the deployed model (evaluated and saved) is the weight-space interpolation (Wortsman Eq. 1)

    θ_wise = (1 − α) · θ_zero-shot + α · θ_fine-tuned

over every floating-point tensor of the state dict (`logit_scale` included; integer buffers are the fine-tuned
model's), computed by `hf_ccl.methods.weight_ensemble.interpolate_state_dicts`, the implementation `patching` uses.

Options:
- `alpha`: α, the weight of the fine-tuned model; 0.8 as ZSCL (`--wise_ft_alpha 0.8` in scripts/WiSE_finetune.sh,
  the default in src/args.py L164). α = 0 deploys the reference, α = 1 the fine-tuned model (bit for bit).
- `reference`: θ_zero-shot. "initial" (default): the model before the first task, Eq. 1's zero-shot model.
  "previous": the model this task starts from (with `continue_from="interpolated"` the previous task's deployed
  interpolation, as ZSCL's script: `--wise_ft_model n`).
- `continue_from`: what the next task trains from. "finetuned" (default): the fine-tuned weights, so that θ_fine-tuned
  is the model fine-tuned on tasks 1..t from θ_zero-shot and every deployed model is Eq. 1 itself (the ensemble is
  post hoc, as in the paper: it never feeds back into fine-tuning). "interpolated": the deployed interpolation, as
  ZSCL's code (each task `--load`s the model the previous one saved, which is the merged model).

What ZSCL's code does (github.com/Thunderbeee/ZSCL @ b96e714, `mtil/`):
- src/models/finetune.py L18-22: with `--wise_merge` and `--wise_ft_model` other than "zeroshot", `model_fix` is the
  model `--load`ed at the task's start (the previous task's saved model; CLIP itself at the first task).
- finetune.py L332-340, after training: `wise_ft_model` = CLIP (`--wise_ft_model zeroshot`) or `model_fix` ("n"),
  then `param_q.data = param_q.data * alpha + param_k.data * (1 - alpha)` over `parameters()` (q: fine-tuned,
  k: reference), i.e. Eq. 1 with α on the fine-tuned model.
- finetune.py L344-351: the merged model is saved, and the next task `--load`s it (scripts/WiSE_finetune.sh).
- scripts/WiSE_finetune.sh: `--wise_merge --wise_ft_model n --wise_ft_alpha 0.8`, every task.
(src/main.py L14-18 and L47-52 hold a second, evaluation-only WiSE-FT, `--wise-ft --alpha` (0.5), merging CLIP
with a loaded checkpoint: Eq. 1 with θ_zero-shot = CLIP.)

Where the code differs from the paper, and how to get it here:
- The reference: ZSCL's WiSE-FT script interpolates with the model the task started from (`--wise_ft_model n`),
  not the zero-shot model: `reference="previous"` (`"initial"` is `--wise_ft_model zeroshot`).
- The continuation: the code continues from the interpolation: `continue_from="interpolated"`.
  ZSCL's script is thus `{"alpha": 0.8, "reference": "previous", "continue_from": "interpolated"}`.
- The code interpolates `parameters()` only; here float buffers too (CLIP has none, so the same tensors).

State (for an exact resume, on the CPU, saved as safetensors beside each checkpoint): the reference (for
"previous" only during its task), and with `continue_from="finetuned"` the last task's fine-tuned weights, which the
next task's `on_task_start` loads into the model. List `wise_ft` before methods that snapshot the model at task
start (teachers, anchors) when they should see those fine-tuned weights rather than the deployed interpolation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .weight_ensemble import check_same_shapes, cpu_state_dict, interpolate_state_dicts

logger = logging.getLogger(__name__)


@dataclass
class WiseFTConfig(MethodConfig):
    alpha: float = field(
        default=0.8,
        metadata={"help": "α in θ = (1 − α) θ_reference + α θ_fine-tuned (Wortsman Eq. 1), in [0, 1]; 0.8 as ZSCL "
                          "(--wise_ft_alpha)."},
    )
    reference: Literal["initial", "previous"] = field(
        default="initial",
        metadata={"help": "'initial': the model before the first task (the zero-shot model of Eq. 1); 'previous': "
                          "the model the task starts from (ZSCL's script, --wise_ft_model n)."},
    )
    continue_from: Literal["finetuned", "interpolated"] = field(
        default="finetuned",
        metadata={"help": "What the next task trains from: 'finetuned' (the fine-tuned weights; the interpolation "
                          "is deployed, evaluated and saved only) or 'interpolated' (ZSCL's code)."},
    )

    def __post_init__(self) -> None:
        check_range("alpha", self.alpha, 0.0, 1.0)


@register_method
class WiseFT(ContinualMethod[WiseFTConfig]):
    """WiSE-FT after every task: deploy (1 − α) θ_reference + α θ_fine-tuned (module docstring)."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "wise_ft"
    same_step_as = "finetune"
    config_class = WiseFTConfig
    roles = {
        "previous_model": "interpolates each task's fine-tuned model with the initial or the task-start model",
        "weight_interpolation": "deploys an interpolation of each task's trained model with a reference model",
    }
    conflicts = {
        "parameter_efficient": "interpolates whole state dicts with a snapshot of the model, whose modules a "
                               "parameter-efficient method changes during each task (adapters injected and merged)",
    }
    runs_after = {"vocabulary": "snapshots the model at task start as its reference, which must have the grown "
                                "vocabulary"}

    def __init__(self, config: WiseFTConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.reference: dict[str, torch.Tensor] | None = None  # θ_zero-shot of Eq. 1, on the CPU
        self.finetuned: dict[str, torch.Tensor] | None = None  # the last fine-tuned weights ("finetuned" only)

    def on_task_start(self, context: TaskContext) -> None:
        """Continue from the fine-tuned weights (`continue_from="finetuned"`), then take the reference: the model
        before the first task ("initial", once) or the model this task starts from ("previous")."""
        model = context.model
        if self.finetuned is not None:
            if self.config.continue_from == "finetuned":
                check_same_shapes(self.finetuned, model, "wise_ft (continue_from='finetuned')")
                model.load_state_dict(self.finetuned)
            self.finetuned = None
        if self.config.reference == "previous" or context.task_index == 0 or self.reference is None:
            self.reference = cpu_state_dict(model)
        check_same_shapes(self.reference, model, f"wise_ft (reference={self.config.reference!r})")

    def after_training(self, context: TaskContext) -> None:
        """Deploy (1 − α) θ_reference + α θ_fine-tuned, in place (keeping θ_fine-tuned to continue from)."""
        if self.reference is None:
            raise ValueError("wise_ft: no reference model (on_task_start did not run for this task)")
        model = context.model
        finetuned = model.state_dict()
        if self.config.continue_from == "finetuned":
            self.finetuned = cpu_state_dict(model)
        model.load_state_dict(interpolate_state_dicts(self.reference, finetuned, self.config.alpha))
        if self.config.reference == "previous":
            self.reference = None  # the next task takes its own
        logger.info("WiSE-FT, task %d (%s): deployed (1 - %.3g) * %s + %.3g * fine-tuned", context.task_index,
                    context.task.name, self.config.alpha, self.config.reference, self.config.alpha)

    def state_dict(self) -> dict[str, Any]:
        """The reference (None between tasks with "previous") and the fine-tuned weights to continue from."""
        return {"reference": self.reference, "finetuned": self.finetuned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = _cpu(state.get("reference"))
        self.finetuned = _cpu(state.get("finetuned"))


def _cpu(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {name: t.detach().to("cpu") for name, t in tensors.items()}
