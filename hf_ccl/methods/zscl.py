"""ZSCL (Zheng et al. 2023, "Preventing Zero-Shot Transfer Degradation in Continual Learning of Vision-Language
Models", ICCV): keep the zero-shot ability of the *initial* model while fine-tuning on a sequence of tasks.

Two parts, both on by default:

1. **Feature-space distillation on a reference set** (§3.2). At every step a batch of reference images x̂ and
   reference texts t̂ (ZSCL: ImageNet images and Conceptual Captions texts, neither from the tasks; here any
   captioned dataset, by default the bundled Flickr8k train split) is embedded by the initial model θ_0 (the
   teacher) and by the current model θ; with p = softmax(exp(t)·f_I(x̂)·f_T(t̂)ᵀ / T) over the reference texts,

       L_ZSCL = T² · CE(p_θ0, p_θ)  (image -> text rows)  +  T² · CE(p_θ0ᵀ, p_θᵀ)  (text -> image rows)

   (official code `mtil/src/models/helpers.py` L64-67 `distillation(t, s, T=2)` = `cross_entropy(s / T,
   softmax(t / T)) * T**2`, `finetune.py` L248-292 with `--image_loss --text_loss`), added to the task loss with
   weight `alpha`. The task loss of ZSCL is the image-to-class-prompt cross-entropy: train with
   `classification_loss: cross_entropy` (`hf_ccl.class_prompts`; ZSCL's `--ls 0.2` label smoothing is not applied).
2. **Weight ensemble during training** (§3.3): the deployed model of each task is the running mean of the weights
   along its training, every `ensemble_every` steps (`hf_ccl.methods.weight_ensemble.WeightEnsemble`).

Paper vs official code (the paper is the default, the code's variant an option):
- `student_texts`: the paper distils the current model's image *and* text features; the code computes the current
  model's logits against the *teacher's* text embeddings (`finetune.py` L266 `ref_out_current @
  ref_embeddings.t()`), so its text tower is never distilled (`student_texts: false`).
- Each model's logits use its own temperature (exp(t) of θ_0 for p_θ0); the code multiplies both by the current
  model's (L266-267), an equal value while the logit scale has not moved.
- `l2`: the code adds Σ‖θ − θ_start‖² (θ_start: the model the task starts from) with weight 1 (`--l2 1` in
  `scripts/ZSCL.sh`, `helpers.py` L47-51); the paper does not; default 0.
- `ensemble_schedule`: see `weight_ensemble` ("paper": after steps I, 2I, ...; "code": after 1, 1+I, ...).

The initial model's weights are method state (saved with each checkpoint), so a resumed run distils from the same
teacher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..data.reference import ReferenceData, load_reference
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .teacher import freeze_copy
from .weight_ensemble import WeightEnsemble, check_same_shapes, cpu_state_dict

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

DIRECTIONS = ("i2t", "t2i")


def zscl_distillation(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 2.0
                      ) -> torch.Tensor:
    """T² · CE(softmax(teacher / T), student / T), the mean over rows (ZSCL code `helpers.py` L64-67)."""
    target = F.softmax(teacher_logits.float() / temperature, dim=1)
    return F.cross_entropy(student_logits.float() / temperature, target) * temperature**2


@dataclass
class ZSCLConfig(MethodConfig):
    alpha: float = field(default=1.0, metadata={"help": "Weight of the reference distillation (ZSCL: 1)."})
    temperature: float = field(default=2.0, metadata={"help": "Distillation temperature T (ZSCL: 2)."})
    directions: list[str] = field(
        default_factory=lambda: ["i2t", "t2i"],
        metadata={"help": "Distil image->text rows (ZSCL --image_loss), text->image rows (--text_loss), or both."},
    )
    student_texts: bool = field(
        default=True,
        metadata={"help": "true: the current model's own text embeddings (the paper); false: the initial model's "
                          "(the official code, which leaves the text tower undistilled)."},
    )
    reference: str = field(
        default="flickr8k",
        metadata={"help": "Reference set: a bundled dataset folder (under data_root), a local folder or a Hub "
                          "dataset id, with captions; images and texts outside the stream (ZSCL: ImageNet + CC)."},
    )
    reference_text_column: str = field(default="en", metadata={"help": "The reference set's caption column."})
    reference_split: str = field(default="train", metadata={"help": "The reference set's split."})
    reference_examples: int | None = field(
        default=2000, metadata={"help": "Rows of the reference split kept (a seeded sample); null: all."})
    reference_batch_size: int = field(
        default=64, metadata={"help": "Reference images and texts per step (each drawn at random every step)."})
    weight_ensemble: bool = field(
        default=True, metadata={"help": "Deploy the running mean of the weights along each task (ZSCL §3.3)."})
    ensemble_every: int = field(default=100, metadata={"help": "Steps between weight averagings (ZSCL: 100)."})
    ensemble_schedule: Literal["paper", "code"] = field(
        default="paper", metadata={"help": "Which steps are averaged: see the weight_ensemble method."})
    l2: float = field(
        default=0.0,
        metadata={"help": "Weight of Σ‖θ − θ_start‖² to the task's starting model (the official code's --l2 1; not "
                          "in the paper)."},
    )

    def __post_init__(self) -> None:
        check_range("alpha", self.alpha, 0)
        check_range("temperature", self.temperature, 0, low_open=True)
        check_range("reference_batch_size", self.reference_batch_size, 2)
        check_range("reference_examples", self.reference_examples, 2, also="or null")
        check_range("ensemble_every", self.ensemble_every, 1)
        check_range("l2", self.l2, 0)
        if not self.directions or any(d not in DIRECTIONS for d in self.directions) or \
                len(set(self.directions)) != len(self.directions):
            raise ConfigError(f"directions must be a non-empty subset of {list(DIRECTIONS)}, got {self.directions}",
                              "directions")
        if not self.reference.strip():
            raise ConfigError("reference must name a dataset", "reference")


@register_method
class ZSCL(ContinualMethod[ZSCLConfig]):
    """ZSCL: reference-set distillation from the initial model plus a weight ensemble (module docstring)."""

    fsdp_refusal = None  # trains sharded as unsharded; the mean is kept as shards (tests/test_fsdp.py)
    name = "zscl"
    test_options = {"reference_examples": 24, "reference_batch_size": 8, "ensemble_every": 1}  # a small reference set, an ensemble step within a few-step task
    test_families = ("metaclip_2",)
    config_class = ZSCLConfig
    roles = {
        "previous_model": "fine-tunes the model the previous task left, distilling the initial model",
        "weight_average": "deploys the mean of the weights along each task's training instead of the trained model",
    }
    conflicts = {"weight_average": "already deploys a mean of the weights along each task's training: use one"}
    runs_before = {
        "weight_interpolation": "replaces the trained model by its weight mean after training, which an "
                                "interpolation of the trained model must then start from (methods [zscl, wise_ft])",
        "parameter_efficient": "deploys its mean into the adapted model before the adapter is merged after training",
    }
    runs_after = {"vocabulary": "distils with the teacher's and the student's tokens, which must be the same"}

    def __init__(self, config: ZSCLConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.initial: dict[str, torch.Tensor] | None = None  # θ_0, the teacher's weights (method state)
        self.teacher: ContinualDualEncoder | None = None
        self._teacher_device: torch.device | None = None
        self.start: list[torch.Tensor] | None = None  # θ_start of the task's trainable parameters (l2 only)
        self.ensemble = WeightEnsemble(self.config.ensemble_every, self.config.ensemble_schedule)
        self._reference: ReferenceData | None = None

    def check_stream(self, stream: Any) -> None:
        if not all(task.kind_spec.has_images for task in stream):
            raise ValueError("zscl trains image-text tasks; a pair stream's tasks have no images and captions")

    def check_task_steps(self, task_index: int, task_name: str, steps: int) -> None:
        if self.config.weight_ensemble:
            self.ensemble.check_steps(steps, f"Task {task_index} ({task_name!r})", "method_args.zscl.ensemble_every")

    # ----- task start: the teacher, the reference set, the ensemble -----------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        if self.initial is None:
            self.initial = cpu_state_dict(model)
        check_same_shapes(self.initial, model, "zscl: the initial model")
        teacher = freeze_copy(model)
        teacher.load_state_dict(self.initial)
        for parameter in teacher.parameters():
            parameter.grad = None  # deepcopy keeps the student's stale gradients
        self.teacher, self._teacher_device = teacher, None
        self.start = ([p.detach().clone() for p in model.parameters() if p.requires_grad]
                      if self.config.l2 > 0 else None)
        if self.config.weight_ensemble:
            self.ensemble.reset()

    def reference_data(self, context: TaskContext) -> ReferenceData:
        if self._reference is None:
            config = self.config
            self._reference = ReferenceData(
                load_reference(config.reference, text_column=config.reference_text_column,
                               split=config.reference_split, examples=config.reference_examples),
                config.reference_batch_size)
        return self._reference

    # ----- the loss ------------------------------------------------------------------------------------------
    def loss_terms(self, model: ContinualDualEncoder, inputs: dict[str, torch.Tensor],
                   outputs: ContinualDualEncoderOutput, context: TaskContext) -> dict[str, torch.Tensor]:
        if self.teacher is None:
            raise RuntimeError("zscl: no teacher (on_task_start was not called)")
        device = model.logit_scale.device
        if self._teacher_device != device:  # follows the student once (the Trainer moves it after task start)
            self.teacher.to(device)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) types PreTrainedModel.to unbound
            self._teacher_device = device
        batch = context.reference_batch(self, device)
        image_inputs: dict[str, Any] = {name: batch[name] for name in model.image_input_names if name in batch}
        with torch.no_grad():
            old_images = self.teacher.embed_images(**image_inputs)
            old_texts = self.teacher.embed_texts(batch["input_ids"], batch["attention_mask"])
            old_logits = self.teacher.logit_scale.exp() * old_images @ old_texts.t()
        new_images = model.embed_images(**image_inputs)
        new_texts = (model.embed_texts(batch["input_ids"], batch["attention_mask"]) if self.config.student_texts
                     else old_texts)
        new_logits = model.logit_scale.exp() * new_images @ new_texts.t()
        terms: dict[str, torch.Tensor] = {}
        distilled = torch.stack([
            zscl_distillation(old_logits if d == "i2t" else old_logits.t(),
                              new_logits if d == "i2t" else new_logits.t(), self.config.temperature)
            for d in self.config.directions]).sum()
        terms["distillation"] = self.config.alpha * distilled
        if self.start is not None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            pull = sum(((p - s) ** 2).sum() for p, s in zip(trainable, self.start, strict=True))
            terms["l2"] = self.config.l2 * cast(torch.Tensor, pull)  # a sum of tensors (the task trains some)
        return terms

    # ----- the weight ensemble -------------------------------------------------------------------------------
    def pre_optimizer_step(self, model: nn.Module, context: TaskContext) -> None:
        if self.config.weight_ensemble:
            self.ensemble.flush(model)

    def post_optimizer_step(self, model: nn.Module, context: TaskContext) -> None:
        if self.config.weight_ensemble:
            self.ensemble.update(model, context.global_step + 1)

    def after_training(self, context: TaskContext) -> None:
        if self.config.weight_ensemble:
            self.ensemble.apply(context.model)
            self.ensemble.reset()

    def on_task_end(self, context: TaskContext) -> None:
        self.teacher, self.start = None, None

    # ----- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """θ_0 (the teacher) and, mid-task, the running weight mean."""
        return {"initial": self.initial, "ensemble": self.ensemble.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        initial = state.get("initial")
        self.initial = None if initial is None else {k: v.detach().to("cpu", copy=True) for k, v in initial.items()}
        self.ensemble.load_state_dict(state.get("ensemble", {}))
