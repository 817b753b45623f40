"""RAIL: Regression-based Analytic Incremental Learning (Xu et al., "Advancing Cross-domain Discriminability in
Continual Learning of Vision-Language Models", NeurIPS 2024, arXiv 2406.18868).

The CLIP model is never trained. After each task, a ridge regression from the frozen image features (unit norm) to
the one-hot labels of every class learned so far is updated in closed form, and evaluation ranks classes by the
training-free fusion of the zero-shot scores and the regression's scores (the maths: `hf_ccl.methods.rail_math`):

- `form: primal` (Fig. 5b, Theorem 1): features through a randomly initialised hidden layer (RHL, `hidden_dim`, ReLU;
  `hidden_dim: 0` regresses the features themselves), the memory M_p = (ΣΦᵀΦ + λI)⁻¹ and the weight W updated by the
  Woodbury recursion: the result equals the joint ridge solution on every task's data (absolute memorization).
- `form: dual` (Fig. 5c, Theorem 2): kernel ridge regression (Gaussian kernel, `gamma`) on every training feature kept
  in memory, α = (K + λI)⁻¹Y; `dual_solve: recursive` grows M_d = (K + λI)⁻¹ by the block inverse, `refit` re-inverts
  K + λI each task as the official `dual_RAIL.py` does (same result, more work).
- Fusion (Fig. 5a): an eval image whose zero-shot top-1 class among the candidates is a learned class scores
  (1 − β) softmax(`zero_shot_scale` x cosine) + β x regression scores; any other keeps the zero-shot softmax, so
  unseen domains keep exactly the zero-shot predictions.

How it runs in the loop: `training_overrides` makes each task's Trainer take no step (`num_train_epochs: 0`), the
fit runs in `after_training` on the task's own training images (every process encodes all of them, so every process
holds the same state), and the scorer (`RAILScorer`, an `hf_ccl.evaluation.scoring.EvaluationScorer`) is a module
attached to the model without parameters or buffers: checkpoints hold the plain model, the method state holds the
regression, and `load_rail_model` loads both (the model card says so).

Classes are keyed by name: a class met again in a later domain (PACS, domains5) is the same column, where the
official code appends every dataset's classes (its benchmarks have no shared class names).

Defaults are the official code's (`configs/analytic_clip.yaml`: hidden_dim 15000, ridge 0.1, fusion_weight 0.8;
`dual_RAIL.py`: ridge 0.001, gamma 0.1); its zero-shot logits are 100 x cosine (CLIP's trained logit scale), and its
features the unit-norm output of `encode_image` (hf_ccl's projected image embeddings).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..modeling import ContinualDualEncoder
from ..validation import ConfigError, check_range
from . import rail_math
from .base import ContinualMethod, MethodConfig, TaskContext
from .loading import CheckpointLoader
from .registry import register_method
from .state import load_checkpoint_method

logger = logging.getLogger(__name__)

NAME = "rail"
#: The attribute of the model the scorer is attached as.
SCORER = "rail_scorer"
#: The official defaults by form (primal_RAIL.py / dual_RAIL.py with configs/analytic_clip.yaml).
DEFAULT_RIDGE = {"primal": 0.1, "dual": 0.001}
DEFAULT_HIDDEN_DIM = 15000
DEFAULT_GAMMA = 0.1


@dataclass
class RAILConfig(MethodConfig):
    form: Literal["primal", "dual"] = field(default="primal", metadata={
        "help": "primal: ridge regression on a random hidden layer's features, recursive (Theorem 1); dual: kernel "
                "ridge regression on every training feature kept in memory (Theorem 2)"})
    ridge: float | None = field(default=None, metadata={
        "help": "The ridge λ (> 0); null: the official value of the form (primal 0.1, dual 0.001)"})
    hidden_dim: int | None = field(default=None, metadata={
        "help": "primal: width of the random hidden layer (RHL; 0: regress the image features themselves, the "
                "official feature_expansion: 0); null: 15000, the official value. Refused with form dual"})
    gamma: float | None = field(default=None, metadata={
        "help": "dual: the Gaussian kernel's γ in exp(-γ‖x - x'‖²) (> 0); null: 0.1, the official value. Refused with "
                "form primal"})
    dual_solve: Literal["recursive", "refit"] | None = field(default=None, metadata={
        "help": "dual: recursive (the paper): grow (K + λI)⁻¹ by the block inverse each task; refit (the official "
                "code): re-invert K + λI from the stored features each task. Same result. null: recursive. Refused "
                "with form primal"})
    fusion_weight: float = field(default=0.8, metadata={
        "help": "β of the fusion: (1 - β) zero-shot softmax + β regression scores, for images whose zero-shot "
                "top-1 class is a learned one (0: zero-shot only; 1: the regression alone on those images)"})
    zero_shot_scale: float = field(default=100.0, metadata={
        "help": "The scale of the cosine similarities before the zero-shot softmax (official: 100, CLIP's trained "
                "logit scale)"})

    def __post_init__(self) -> None:
        check_range("ridge", self.ridge, 0, low_open=True, also="or null")
        check_range("hidden_dim", self.hidden_dim, 0, also="or null")
        check_range("gamma", self.gamma, 0, low_open=True, also="or null")
        check_range("fusion_weight", self.fusion_weight, 0, 1)
        check_range("zero_shot_scale", self.zero_shot_scale, 0, low_open=True)
        other = {"primal": ("gamma", "dual_solve"), "dual": ("hidden_dim",)}[self.form]
        for option in other:
            if getattr(self, option) is not None:
                raise ConfigError(f"{option} applies to the other form of RAIL, not form {self.form!r}: remove it "
                                  "or change form", option)

    @property
    def ridge_value(self) -> float:
        return DEFAULT_RIDGE[self.form] if self.ridge is None else self.ridge

    @property
    def hidden_value(self) -> int:
        return DEFAULT_HIDDEN_DIM if self.hidden_dim is None else self.hidden_dim

    @property
    def gamma_value(self) -> float:
        return DEFAULT_GAMMA if self.gamma is None else self.gamma


class RAILState:
    """The regression RAIL has learned: the class names (columns, in the order learned) and the form's tensors, in
    float64 (the hidden layer in float32, as drawn)."""

    def __init__(self, config: RAILConfig):
        self.config = config
        self.class_names: list[str] = []
        self.hidden: torch.Tensor | None = None  # primal RHL W_e [D, H]
        self.memory: torch.Tensor | None = None  # primal M_p [H', H'] / dual features X [N, D]
        self.weight: torch.Tensor | None = None  # primal W [H', C] / dual α [N, C] (derived)
        self.labels: torch.Tensor | None = None  # dual: class index of each stored feature [N]
        self.inverse: torch.Tensor | None = None  # dual recursive: M_d = (K + λI)⁻¹ [N, N]

    def class_index(self, names: Sequence[str]) -> list[int]:
        """Columns of `names`, new names appended."""
        position = {name: index for index, name in enumerate(self.class_names)}
        for name in names:
            if name not in position:
                position[name] = len(self.class_names)
                self.class_names.append(name)
        return [position[name] for name in names]

    def to(self, device: torch.device | str) -> RAILState:
        """Move the tensors to `device` (the fit and the scores run where the state is)."""
        for key in ("hidden", "memory", "weight", "labels", "inverse"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, value.to(device))
        return self

    @property
    def device(self) -> torch.device:
        return self.memory.device if self.memory is not None else torch.device("cpu")

    def fit(self, features: torch.Tensor, labels: torch.Tensor, seed: int) -> None:
        """Add one task's features [N, D] (any float dtype, normalised here) and global class ids [N]; computed on
        the features' device (the model's: a GPU when there is one), where the state then stays."""
        config = self.config
        self.to(features.device)
        features = nn.functional.normalize(features.double(), dim=-1)
        labels = labels.to(features.device)
        targets = nn.functional.one_hot(labels.long(), len(self.class_names)).double()
        if config.form == "primal":
            if self.memory is None:
                dim = config.hidden_value
                if dim:
                    bound = features.shape[1] ** -0.5  # nn.Linear's default initialisation, as the official RHL
                    generator = torch.Generator().manual_seed(int(seed))
                    hidden = (torch.rand(features.shape[1], dim, generator=generator) * 2 - 1) * bound
                    self.hidden = hidden.to(features.device)
                width = dim or features.shape[1]
                self.memory = torch.eye(width, dtype=torch.float64, device=features.device) / config.ridge_value
                self.weight = features.new_zeros(width, 0)
            assert self.weight is not None
            expanded = rail_math.expand(features, None if self.hidden is None else self.hidden.double())
            self.memory, self.weight = rail_math.primal_update(self.memory, self.weight, expanded, targets)
            return
        old = self.memory if self.memory is not None else features.new_zeros(0, features.shape[1])
        if config.dual_solve != "refit":
            inverse = self.inverse if self.inverse is not None else features.new_zeros(0, 0)
            self.inverse = rail_math.dual_update(inverse, old, features, config.ridge_value, config.gamma_value)
        self.memory = torch.cat([old, features])
        self.labels = labels.long() if self.labels is None else torch.cat([self.labels, labels.long()])
        self.weight = self._alpha()

    def _alpha(self) -> torch.Tensor:
        assert self.memory is not None and self.labels is not None
        targets = nn.functional.one_hot(self.labels, len(self.class_names)).double()
        if self.inverse is not None:
            return self.inverse @ targets
        return rail_math.kernel_ridge_alpha(self.memory, targets, self.config.ridge_value, self.config.gamma_value)

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """The regression's scores [N, C_learned] of unit-norm `features` [N, D] (float64)."""
        assert self.memory is not None and self.weight is not None
        if self.config.form == "primal":
            return rail_math.expand(features, None if self.hidden is None else self.hidden.double()) @ self.weight
        return rail_math.rbf_kernel(features, self.memory, self.config.gamma_value) @ self.weight

    def state_dict(self) -> dict[str, Any]:
        tensors = {"hidden": self.hidden, "memory": self.memory, "weight": self.weight, "labels": self.labels,
                   "inverse": self.inverse}
        return {"class_names": list(self.class_names),
                **{key: value.detach().cpu().clone() for key, value in tensors.items() if value is not None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.class_names = list(state.get("class_names", []))
        for key in ("hidden", "memory", "weight", "labels", "inverse"):
            setattr(self, key, state.get(key))
        if self.config.form == "dual" and self.memory is not None:
            self.weight = self._alpha()  # derived, recomputed as the run that saved it did


class RAILScorer(nn.Module):
    """RAIL's fused class scores for the evaluator (`hf_ccl.evaluation.scoring.EvaluationScorer`); no parameters or
    buffers (its state is the method's, saved beside the checkpoint)."""

    def __init__(self, state: RAILState):
        super().__init__()
        self.state = state

    def class_scores(self, image_embeds: torch.Tensor, class_embeds: torch.Tensor,
                     class_names: Sequence[str]) -> torch.Tensor | None:
        """Fig. 5a on the candidates `class_names`: None before the first task is learned (cosine similarity)."""
        state, config = self.state, self.state.config
        if not state.class_names:
            return None
        device = state.device
        features = nn.functional.normalize(image_embeds.detach().to(device, torch.float64), dim=-1)
        logits = config.zero_shot_scale * features @ class_embeds.detach().to(device, torch.float64).T
        learned = {name: index for index, name in enumerate(state.class_names)}
        columns = torch.tensor([learned.get(name, -1) for name in class_names], dtype=torch.long, device=device)
        known = columns >= 0
        adapter = features.new_zeros(features.shape[0], len(class_names))
        if bool(known.any()):
            adapter[:, known] = state.scores(features)[:, columns[known]]
        fused = rail_math.fuse(logits, adapter, known, config.fusion_weight)
        return fused.to(device=image_embeds.device, dtype=torch.float32)


def rail_scorer(model: nn.Module) -> RAILScorer | None:
    """The model's attached `RAILScorer`, or None."""
    scorer = getattr(model, SCORER, None)
    return scorer if isinstance(scorer, RAILScorer) else None


def attach_scorer(model: nn.Module, state: RAILState) -> RAILScorer:
    """Attach (or re-point) the model's scorer to `state`."""
    scorer = rail_scorer(model)
    if scorer is None:
        scorer = RAILScorer(state)
        model.add_module(SCORER, scorer)
    scorer.state = state
    return scorer


@torch.no_grad()
def task_features(context: TaskContext) -> tuple[torch.Tensor, list[str]]:
    """The frozen model's image embeddings [N, D] (float32, on the model's device) of the task's own training images
    (its train split) and each image's class name; every process computes all of them."""
    if context.collator is None:
        raise ValueError(f"{NAME} fits on the task's training images and needs context.collator (set by "
                         "ContinualLearner)")
    model, task, collator = context.model, context.task, context.collator
    names = list(task.class_names or [])
    batch_size = max(int(context.eval_batch_size or 64), 1)
    dataset = task.train  # map-style (`RAIL.check_stream` refuses streaming splits)
    batches = ([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
               for start in range(0, len(dataset), batch_size))
    device = next(model.parameters()).device
    parts: list[torch.Tensor] = []
    labels: list[str] = []
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            parts.append(model.embed_images(**model.image_inputs(collator(batch), device=device)).float())
            labels.extend(names[int(row["label"])] for row in batch)
    finally:
        model.train(was_training)
    if not parts:
        raise ValueError(f"{NAME}: task {task.name!r} has no training images to fit on")
    return torch.cat(parts), labels


@register_method
class RAIL(ContinualMethod[RAILConfig]):
    """Analytic ridge regression on frozen image features with zero-shot fusion (see the module docstring)."""

    name = NAME
    config_class = RAILConfig
    fsdp_refusal = ("it trains nothing: the model takes no optimizer step and its regression is fitted in closed "
                    "form on every process, so sharding the model saves nothing")
    test_options = {"hidden_dim": 64}  # a small hidden layer for the tiny test models
    trains_model = False
    checkpoint_loader = CheckpointLoader(
        module=__name__, function="load_rail_model",
        keeps="its ridge regression (memory, weights, learned class names) and the fusion that ranks classes",
        plain_model="the frozen zero-shot model, which ranks classes by cosine similarity alone")

    def __init__(self, config: RAILConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.state = RAILState(self.config)

    def check_stream(self, stream: Any) -> None:
        kinds = [task.kind for task in stream if not task.kind_spec.has_classes]
        if kinds:
            raise ConfigError(f"{NAME} learns a regression to class labels: every task must be a classification "
                              f"task, the stream has {sorted(set(kinds))} tasks", "methods")
        from ..data.streaming import is_streaming

        streaming = [task.name for task in stream if is_streaming(task.train)]
        if streaming:  # the loop trains a streaming task for max_steps >= 1, and rail takes no step
            raise ConfigError(f"{NAME} takes no training step, and the loop trains streaming tasks for max_steps "
                              f"steps: tasks {streaming} have streaming train splits; load them as map-style "
                              "datasets (leave out streaming: true)", "methods")

    def on_task_start(self, context: TaskContext) -> None:
        attach_scorer(context.model, self.state)

    def training_overrides(self, context: TaskContext, training: dict[str, Any]) -> dict[str, Any]:
        """No optimizer step: the backbone stays frozen (the fit is `after_training`)."""
        return {"num_train_epochs": 0, "max_steps": -1}

    def after_training(self, context: TaskContext) -> None:
        """Fit the task: its training images' frozen features, labelled with the global class ids."""
        features, names = task_features(context)
        labels = torch.tensor(self.state.class_index(names), dtype=torch.long)
        self.state.class_index(list(context.task.class_names or []))  # every class of the task is learned
        self.state.fit(features, labels, seed=context.seed)
        attach_scorer(context.model, self.state)
        logger.info("%s, task %d: %s form fitted on %d images, %d classes learned", NAME, context.task_index,
                    self.config.form, len(names), len(self.state.class_names))

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


def load_rail_model(name_or_path: str | Path, revision: str | None = None) -> ContinualDualEncoder:
    """A task checkpoint's model with its RAIL scorer attached (from the method state beside it), in eval mode: what
    the run evaluated. `name_or_path`: a task folder (`output_dir/task-<k>/`) or a Hub repository id with its
    `revision` (`task-<k>`). The checkpoint's weights alone are the frozen zero-shot model."""
    method, model = load_checkpoint_method(RAIL, name_or_path, revision)
    attach_scorer(model, method.state)
    return model.eval()
