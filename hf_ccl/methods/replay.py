"""Replay methods: ER, DER and DER++ for CLIP, over a reservoir buffer of references (`hf_ccl.data.buffer`).

Mixing rule (all three): the buffer's rows are **concatenated** with the task's training data and the Trainer
shuffles the union, as CTP's ER and CTP+ER do (specs/ctp.md App. B.2 and item 16: "concatenate the buffer into the
task dataset and shuffle uniformly", a ~1-5% replay fraction per batch, not 50/50). Every other loss term (Mod-X, LwF,
CTP, ...) therefore also sees the replayed rows. After a task has trained (`on_task_end`), the reservoir sees every
example of the task's own train split once, in a seeded random order (CTP's [C]: "updates the buffer once after each
task by iterating over the task's items"). CLL-CLIP's per-step reservoir and 128 + 128 batches (specs/cllclip.md
A15) are not reproduced: they need a sampler, not a dataset transform.

DER on CLIP (Buzzega et al. 2020, "Dark Experience for General Continual Learning: a Strong, Simple Baseline",
NeurIPS, §3: DER adds alpha E_M ||z - h(x)||^2 on stored logits z; DER++ also beta E_M l(y, f(x)) on buffer examples
with their stored labels; official code aimagelab/mammoth `models/der.py`, `F.mse_loss`). The "logits" of a buffered
example are its L2-normalised image and text embeddings (v*, t*), recorded when the example enters the buffer: at the
end of the task that put it there, with the trained model in eval mode under `torch.no_grad()`, for the changed
slots only (Buzzega et al. record them at the training step that inserts the example; with a task-end reservoir the
task-end model is the model of insertion time). CLL-CLIP's DER likewise stores the student's own features at
insertion time (specs/cllclip.md §6, A15); normalised here, because CLIP's loss depends on nothing else. For the B_m
buffer rows of the global batch, with current embeddings (v, t):

    L_DER   = alpha * 1/2 [ mean_{b,d} (v_bd - v*_bd)^2 + mean_{b,d} (t_bd - t*_bd)^2 ]            (DER)
    L_DER++ = L_DER + beta * L_clip(S_mm, P_mm)                                                       (DER++)

where S_mm and P_mm are the global logit matrix and positive mask restricted to buffer rows and columns: the CLIP
task loss on the buffer examples alone, with their stored caption as the "stored label". (The buffer rows are also
in the batch's own contrastive loss, as in CLL-CLIP's [C], where L_cm covers the whole batch.) A buffered example
keeps the one caption (seeded pick among its `texts`) its embedding was recorded with, so target and input match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from datasets import Dataset, concatenate_datasets

from ..data.buffer import ReservoirBuffer
from ..distributed import all_gather_no_grad
from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method

if TYPE_CHECKING:
    from ..modeling import ContinualCLIPModel, ContinualCLIPOutput

SLOT_COLUMN = "buffer_slot"
_MASKED_LOGIT = -1.0e4  # far below any CLIP logit (|logit| <= logit_scale <= 100): exp() underflows to exactly 0


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ERConfig(MethodConfig):
    buffer_size: int = field(
        default=10_000,
        metadata={"help": "Reservoir budget in training examples (image-text pairs); CTP: 10,000 (~1% of P9D)."},
    )
    seed: int = field(default=0, metadata={"help": "Buffer seed, combined with the run's per-task seed."})

    def __post_init__(self) -> None:
        check_range("buffer_size", self.buffer_size, 0)


@dataclass
class DERConfig(ERConfig):
    buffer_size: int = field(
        default=8_000,
        metadata={"help": "Reservoir budget in training examples (image-text pairs); CLL-CLIP's ER/DER: 8,000."},
    )
    alpha: float = field(
        default=1.0, metadata={"help": "Weight of the MSE to the stored embeddings (DER); CLL-CLIP's DER: 1."}
    )
    embed_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size to record new slots' embeddings at task end; None: the training batch size."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("alpha", self.alpha, 0)
        check_range("embed_batch_size", self.embed_batch_size, 1, also="or null")


@dataclass
class DERPPConfig(DERConfig):
    beta: float = field(
        default=0.5,
        metadata={"help": "Weight of the contrastive loss on the buffer rows alone (DER++); mammoth's derpp.yaml: 0.5."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("beta", self.beta, 0)


# ----------------------------------------------------------------------------------------------------------------
# ER
# ----------------------------------------------------------------------------------------------------------------
@register_method
class ExperienceReplay(ContinualMethod):
    """ER (Chaudhry et al. 2019): train each task on its data concatenated with the reservoir buffer."""

    name = "er"
    config_class = ERConfig
    roles = {"training_data": "mixes a buffer of past examples into each task's data"}
    conflicts = {"training_data": "already mixes a buffer of past examples into each task's data: use one of them"}

    def __init__(self, config: ERConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.buffer = ReservoirBuffer(self.config.buffer_size, seed=self.config.seed)

    def replay_dataset(self, context: TaskContext) -> Dataset:
        """The buffer's rows (references into `context.stream`'s train splits), as a canonical dataset."""
        return self.buffer.dataset(context.stream)

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        if len(self.buffer) == 0:
            return dataset
        return concatenate_datasets([dataset, self.replay_dataset(context)])

    def on_task_end(self, context: TaskContext) -> None:
        self.update_buffer(context)

    def update_buffer(self, context: TaskContext) -> list[int]:
        """Reservoir update with every example of the task's train split; returns the changed slots."""
        return self.buffer.add_task(context.task_index, len(context.task.train), seed=context.seed)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])


# ----------------------------------------------------------------------------------------------------------------
# DER and DER++
# ----------------------------------------------------------------------------------------------------------------
@register_method
class DarkExperienceReplay(ExperienceReplay):
    """DER: ER plus `alpha` x MSE between buffer rows' current and stored embeddings (see the module docstring)."""

    name = "der"
    config_class = DERConfig

    def __init__(self, config: DERConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.captions: list[int] = []  # per slot: the index in `texts` of the caption it was recorded with
        self.image_targets: torch.Tensor | None = None  # [len(buffer), D], normalised
        self.text_targets: torch.Tensor | None = None
        self._on_device: tuple[torch.Tensor, torch.Tensor] | None = None

    # ----- data -------------------------------------------------------------------------------------------------
    def replay_dataset(self, context: TaskContext) -> Dataset:
        """Buffer rows with their slot in `buffer_slot` and only their recorded caption."""
        return self.buffer.dataset(context.stream, slot_column=SLOT_COLUMN, caption_index=self.captions)

    def on_task_end(self, context: TaskContext) -> None:
        changed = self.update_buffer(context)
        if not changed:
            return
        self._choose_captions(context, changed)
        images, texts = self.record_embeddings(context, changed)
        self._store(changed, images, texts)

    def _choose_captions(self, context: TaskContext, slots: list[int]) -> None:
        """A seeded caption per new slot, among its row's `texts`."""
        refs = self.buffer.refs
        rows = [refs[s][1] for s in slots]
        counts = [len(texts) for texts in context.task.train.select(rows)["texts"]]
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index, 1])
        picks = rng.integers(0, counts).tolist()
        self.captions.extend([0] * (len(self.buffer) - len(self.captions)))
        for slot, pick in zip(slots, picks, strict=True):
            self.captions[slot] = int(pick)

    @torch.no_grad()
    def record_embeddings(self, context: TaskContext, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised image and text embeddings [len(slots), D] of `slots` under `context.model` (eval mode,
        no grad), preprocessed by the task-end collator `context.collator`."""
        collator = context.collator
        if collator is None:
            raise ValueError(f"{self.name} needs context.collator at task end (set by ContinualLearner)")
        batch_size = self.config.embed_batch_size or context.per_device_batch_size or 64
        rows = self.buffer.dataset(context.stream, slots=slots, caption_index=self.captions)
        model = context.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        images, texts = [], []
        try:
            for start in range(0, len(rows), batch_size):
                batch = collator(_row_dicts(rows[start : start + batch_size]))
                images.append(model.embed_images(batch["pixel_values"].to(device)).float().cpu())
                texts.append(
                    model.embed_texts(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
                )
        finally:
            model.train(was_training)
        return torch.cat(images), torch.cat(texts)

    def _store(self, slots: list[int], images: torch.Tensor, texts: torch.Tensor) -> None:
        self.image_targets = _grow(self.image_targets, len(self.buffer), images.shape[1])
        self.text_targets = _grow(self.text_targets, len(self.buffer), texts.shape[1])
        index = torch.tensor(slots, dtype=torch.int64)
        self.image_targets[index] = images
        self.text_targets[index] = texts
        self._on_device = None

    # ----- loss -------------------------------------------------------------------------------------------------
    def loss_terms(
        self,
        model: ContinualCLIPModel,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualCLIPOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        slots = self._global_slots(inputs, outputs)
        if slots is None:
            zero = outputs.image_embeds.new_zeros((), dtype=torch.float32)
            return {name: zero for name in self.term_names()}
        return self.replay_terms(outputs, slots)

    def term_names(self) -> tuple[str, ...]:
        return ("mse",)

    def replay_terms(self, outputs: ContinualCLIPOutput, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weighted terms for a global batch whose rows have buffer `slots` (-1: new data)."""
        image_targets, text_targets = self._targets_on(slots.device)
        mse = der_mse(_global(outputs, "image"), _global(outputs, "text"), image_targets, text_targets, slots)
        return {"mse": self.config.alpha * mse}

    def _global_slots(self, inputs: dict[str, torch.Tensor], outputs: ContinualCLIPOutput) -> torch.Tensor | None:
        """`buffer_slot` of every row of the global batch, or None when no row can be a buffer row."""
        slots = inputs.get(SLOT_COLUMN)
        if slots is None or self.image_targets is None:
            return None
        return all_gather_no_grad(slots.to(outputs.image_embeds.device))

    def _targets_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored embeddings on `device`, copied once per task (not per step)."""
        if self._on_device is None or self._on_device[0].device != device:
            assert self.image_targets is not None and self.text_targets is not None
            self._on_device = (self.image_targets.to(device), self.text_targets.to(device))
        return self._on_device

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["captions"] = torch.tensor(self.captions, dtype=torch.int64)
        if self.image_targets is not None and self.text_targets is not None:
            state["image_targets"], state["text_targets"] = self.image_targets, self.text_targets
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.captions = [int(c) for c in torch.as_tensor(state.get("captions", [])).tolist()]
        images, texts = state.get("image_targets"), state.get("text_targets")
        self.image_targets = None if images is None else torch.as_tensor(images).float().clone()
        self.text_targets = None if texts is None else torch.as_tensor(texts).float().clone()
        self._on_device = None
        stored = 0 if self.image_targets is None else len(self.image_targets)
        if len(self.captions) != len(self.buffer) or stored != len(self.buffer):
            raise ValueError(
                f"{self.name} state holds {len(self.buffer)} buffer slots but {len(self.captions)} captions and "
                f"{stored} stored embeddings"
            )


@register_method
class DarkExperienceReplayPlusPlus(DarkExperienceReplay):
    """DER++: DER plus `beta` x the contrastive loss on the buffer rows of the batch alone (module docstring)."""

    name = "derpp"
    config_class = DERPPConfig

    def term_names(self) -> tuple[str, ...]:
        return ("mse", "replay_contrastive")

    def replay_terms(self, outputs: ContinualCLIPOutput, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = super().replay_terms(outputs, slots)
        logits = outputs.global_logits_per_image
        if logits is None:
            logits = outputs.logits_per_image
        terms["replay_contrastive"] = self.config.beta * subset_contrastive_loss(
            logits, outputs.global_positive_mask, slots >= 0
        )
        return terms


# ----------------------------------------------------------------------------------------------------------------
# Loss functions (no host synchronisation: the buffer rows are selected by weights, not by boolean indexing)
# ----------------------------------------------------------------------------------------------------------------
def der_mse(
    images: torch.Tensor,
    texts: torch.Tensor,
    image_targets: torch.Tensor,
    text_targets: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """1/2 [mean (v - v*)^2 + mean (t - t*)^2] over the rows with `slots >= 0` and every dimension (DER, with
    the elementwise mean of Buzzega et al.'s code, `F.mse_loss`); 0 when no row is a buffer row."""
    keep = (slots >= 0).float()
    index = slots.clamp(min=0)
    per_row = (images.float() - image_targets[index]).pow(2).mean(-1) + (texts.float() - text_targets[index]).pow(2).mean(-1)
    return (keep * per_row).sum() / (2.0 * keep.sum().clamp(min=1.0))


def subset_contrastive_loss(
    logits_per_image: torch.Tensor, positives: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor:
    """`losses.clip_contrastive_loss` on the sub-matrix of `rows` (bool [N]) and its positive mask, computed on
    the full matrix with the other columns masked out; 0 when no row is selected."""
    logits = logits_per_image.float()
    if positives is None:
        positives = torch.eye(logits.shape[0], dtype=torch.bool, device=logits.device)
    pair = rows[:, None] & rows[None, :]
    weight = rows.float()
    count = weight.sum().clamp(min=1.0)
    total = logits.new_zeros(())
    for matrix, mask in ((logits, positives & pair), (logits.t(), (positives & pair).t())):
        masked = matrix.masked_fill(~rows[None, :], _MASKED_LOGIT)
        targets = mask.float() / mask.float().sum(-1, keepdim=True).clamp(min=1.0)
        per_row = -(targets * masked.log_softmax(-1)).sum(-1)
        total = total + (weight * per_row).sum() / count
    return total / 2.0


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def _global(outputs: ContinualCLIPOutput, modality: str) -> torch.Tensor:
    """Global-batch embeddings (gathered with gradients), or the local ones when the output has none."""
    gathered = getattr(outputs, f"all_{modality}_embeds")
    return gathered if gathered is not None else getattr(outputs, f"{modality}_embeds")


def _grow(tensor: torch.Tensor | None, rows: int, dim: int) -> torch.Tensor:
    """`tensor` extended with zero rows to `rows` rows (a new [rows, dim] tensor when None)."""
    if tensor is None:
        return torch.zeros(rows, dim)
    if len(tensor) >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - len(tensor), dim)])


def _row_dicts(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """A slice of a dataset (a dict of columns) as a list of row dicts, for a collator."""
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
