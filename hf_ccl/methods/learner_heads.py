"""Learner heads on a frozen CLIP, CMCL's setting (Liu et al., "Continual Multimodal Contrastive Learning", NeurIPS
2025; spec cmcl.md §2.1, §2.6), as a model change at task start.

At every pair task's start (a task whose kind trains `ModelPart.LEARNER_HEADS`) the model gets its per-modality heads (`hf_ccl.heads`:
identity-initialised d×d linears after the projections, one per modality of the stream) as
`model.learner_heads`; every CLIP parameter is frozen and only the current pair's two heads train (spec §2.1). The
batches are the task's cached frozen features (`hf_ccl.pair_features`), and the loss is Eq. (2) on the heads'
outputs. Combine with `dns`, `ewc`, `der`, `derpp`, `gem` or `agem` (listed after this method) to keep the old
alignments.

Checkpoints stay plain CLIPs: `save_pretrained` folds the `fold_image_modality` head into `visual_projection`
and the `fold_text_modality` head into `text_projection` (`LearnerHeads.folded_projections`), so a task folder
loads with `CLIPModel`, `CLIPProcessor` and the zero-shot pipeline. Every head, the unfolded projections and
the heads after each task (for the drift diagnostic) are this method's state.

τ of Eq. (2): `temperature`, or by default 1/exp(logit_scale) of the CLIP the run starts from (spec A10; the
official code's τ = 1 is for ImageBind features that carry their own scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.task import ModelPart
from ..heads import SIMILARITIES, LearnerHeads
from .base import ContinualMethod, MethodConfig, TaskContext, pair_modalities
from .registry import register_method


@dataclass
class LearnerHeadsConfig(MethodConfig):
    temperature: float | None = field(
        default=None, metadata={"help": "τ of Eq. 2; None: 1/exp(logit_scale) of the starting CLIP (spec A10)."})
    similarity: str = field(default="dot", metadata={"help": "'dot' (the paper: raw inner products) or 'cosine'."})
    symmetric: bool = field(default=False, metadata={"help": "Both loss directions (the paper: anchor = modality a)."})
    bias: bool = field(default=False, metadata={"help": "Heads with a bias (the official code); cannot be folded: "
                                                       "needs fold_image_modality: null."})
    fold_image_modality: str | None = field(
        default="image", metadata={"help": "Head folded into visual_projection when saving (null: none, the saved "
                                           "CLIP is the frozen prior and the heads are in the method state)."})
    fold_text_modality: str | None = field(
        default="en", metadata={"help": "Head folded into text_projection when saving."})

    def __post_init__(self) -> None:
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"similarity must be one of {list(SIMILARITIES)}, got {self.similarity!r}")
        if self.temperature is not None and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if (self.fold_image_modality is None) != (self.fold_text_modality is None):
            raise ValueError("fold_image_modality and fold_text_modality are set together (both null: no folding)")
        if self.bias and self.fold_image_modality is not None:
            raise ValueError("heads with a bias cannot be folded into CLIP's bias-free projections: set "
                             "fold_image_modality and fold_text_modality to null")

    @property
    def fold(self) -> tuple[str, str] | None:
        if self.fold_image_modality is None or self.fold_text_modality is None:  # both or neither (checked above)
            return None
        return self.fold_image_modality, self.fold_text_modality


@register_method
class LearnerHeadsMethod(ContinualMethod[LearnerHeadsConfig]):
    """Per-modality learner heads on a frozen CLIP for pair streams (see the module docstring)."""

    fsdp_refusal = ("its learner heads are attached to the model, which the plain model the loop gathers after each task "
                    "would not carry")
    name = "learner_heads"
    test_families = ("chinese_clip",)
    config_class = LearnerHeadsConfig
    trains_pair_tasks = True
    attaches = ModelPart.LEARNER_HEADS
    roles = {
        "learner_heads": "trains per-modality heads on the frozen CLIP's cached features",
        "parameter_efficient": "freezes the whole CLIP but for the current pair's learner heads",
    }
    conflicts = {"parameter_efficient": "freezes the whole CLIP: the pair features are cached from the frozen "
                 "towers, so nothing else of it may train"}

    def __init__(self, config: LearnerHeadsConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.heads: LearnerHeads | None = None
        self.base_projections: dict[str, torch.Tensor] = {}  # the frozen prior's, unfolded
        self._saved: dict[str, Any] | None = None  # a restored state, applied at the next task start

    def check_stream(self, stream: Any) -> None:
        """Only pair streams, and the folded modalities must be in them (before anything trains)."""
        others = sorted({task.kind for task in stream if task.kind_spec.trains is not ModelPart.LEARNER_HEADS})
        if others:
            raise ValueError(f"learner_heads trains pair tasks (learner heads on cached features) only; stream "
                             f"{stream.name!r} has {others} tasks")
        missing = [m for m in self.config.fold or () if m not in stream.modalities]
        if missing:
            raise ValueError(f"learner_heads: fold modality(ies) {missing} are not in the stream's modalities "
                             f"{stream.modalities} (method_args.learner_heads.fold_image_modality / "
                             "fold_text_modality)")

    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        heads = self.heads if self.heads is not None else self._build(model, context.stream.modalities)
        visual, text = model.get_parameter("visual_projection.weight"), model.get_parameter("text_projection.weight")
        with torch.no_grad():  # a resumed model holds the folded projections: train on the frozen prior's
            visual.copy_(self.base_projections["visual_projection"])
            text.copy_(self.base_projections["text_projection"])
        for modality in context.stream.modalities:
            heads.ensure(modality)
        heads.to(device=visual.device, dtype=visual.dtype)
        model.learner_heads = heads
        model.requires_grad_(False)
        heads.train_only(pair_modalities(context.task))

    def _build(self, model: Any, modalities: list[str]) -> LearnerHeads:
        saved, self._saved = self._saved, None
        temperature = self.config.temperature
        if saved is not None:
            temperature = float(saved["temperature"])
        elif temperature is None:
            temperature = float(1.0 / model.logit_scale.detach().exp())
        self.heads = LearnerHeads(
            int(model.config.projection_dim), modalities if saved is None else saved["modalities"],
            bias=self.config.bias, temperature=temperature, similarity=self.config.similarity,
            symmetric=self.config.symmetric, fold=self.config.fold,
        )
        if saved is None:
            self.base_projections = {name: getattr(model, name).weight.detach().cpu().clone()
                                     for name in ("visual_projection", "text_projection")}
        else:
            self.heads.load_state_dict(saved["heads"])
            self.heads.snapshots = dict(saved["snapshots"])
            self.base_projections = dict(saved["base_projections"])
        return self.heads

    def on_task_end(self, context: TaskContext) -> None:
        """Keep the heads as the task left them (drift); the pair's heads stay trainable for the task-end hooks of
        the methods after this one (EWC's Fisher covers the parameters that trained)."""
        if self.heads is None:
            raise RuntimeError("learner_heads: on_task_end before on_task_start")
        self.heads.snapshot(context.task.name)

    def state_dict(self) -> dict[str, Any]:
        if self.heads is None:
            return dict(self._saved or {})
        return {
            "modalities": list(self.heads.heads),
            "temperature": self.heads.temperature,
            "heads": {name: p.detach().cpu().clone() for name, p in self.heads.state_dict().items()},
            "snapshots": self.heads.snapshots,
            "base_projections": self.base_projections,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.heads, self._saved = None, (dict(state) if state else None)
