"""Distillation from a frozen teacher over the in-batch similarity matrix, shared by Mod-X and LwF.

- `TeacherMethod`: the teacher handling both methods share. At the start of task t > 0 it snapshots the model
  (the model after task t-1, Mod-X §4.3 "CLIP_{t-1}") as a `FrozenTeacher`; on task 0 there is no teacher and no
  loss. The teacher is never stepped, never saved: a resumed run re-snapshots it from the checkpoint it resumes
  from, which is exactly the model the teacher was taken from, so `state_dict()` is empty.
- Pure loss functions on similarity matrices (rows are queries, columns the in-batch candidates):
  `similarity_kl` (Mod-X Eq. 4 / LwF's distillation term), `modx_keep_mask` (Mod-X Eq. 3) and
  `directional_kl` (both retrieval directions, as the Mod-X code and LwF do).

Equation numbers refer to Ni et al., "Continual Vision-Language Representation Learning with Off-Diagonal
Information" (Mod-X, ICML 2023); see ../shared/specs/modx.md §2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F

from .base import ContinualMethod, MethodConfig, TaskContext
from .teacher import FrozenTeacher

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder

DIRECTIONS: tuple[str, ...] = ("i2t", "t2i")
REDUCTIONS: tuple[str, ...] = ("sum", "batchmean")


# ----- pure functions ----------------------------------------------------------------------------------------
def oriented(matrix: torch.Tensor, direction: str) -> torch.Tensor:
    """The similarity matrix with the queries of `direction` as rows: images for "i2t", texts for "t2i" (M^T)."""
    if direction == "i2t":
        return matrix
    if direction == "t2i":
        return matrix.t()
    raise ValueError(f"Unknown direction {direction!r}; valid: {list(DIRECTIONS)}")


def row_kl(old_logits: torch.Tensor, new_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-row KL(P_old || P_new) with P = softmax(logits / T) over each row, in float32 ([N]).

    KL_i = sum_j P_old[i,j] (log P_old[i,j] - log P_new[i,j]); the teacher side is detached.
    """
    log_p_old = F.log_softmax(old_logits.detach().float() / temperature, dim=-1)
    log_p_new = F.log_softmax(new_logits.float() / temperature, dim=-1)
    return (log_p_old.exp() * (log_p_old - log_p_new)).sum(dim=-1)


def similarity_kl(
    old_logits: torch.Tensor,
    new_logits: torch.Tensor,
    keep: torch.Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "sum",
) -> torch.Tensor:
    """Mod-X Eq. 4, L_KL(M_t, M_{t-1}) = -sum M_{t-1} ln(M_t / M_{t-1}), read row-wise as distributions:

        L = reduce_i keep_i * KL(softmax(M_{t-1}[i] / T) || softmax(M_t[i] / T))

    `keep` ([N] bool, Eq. 3) zeroes the rows the teacher gets wrong. Replacing such a row of M_{t-1} by M_t's row
    (Eq. 3 as written, and the official code) gives KL(p || p) = 0 with gradient exactly 0, so masking is identical
    in value and gradient (specs/modx.md §2.2); masked rows get an exact 0 and no gradient here.
    `reduction`: "sum" over all rows and columns (Eq. 4's sum and the code's `reduction='sum'`) or "batchmean"
    (the sum divided by the number of rows N, masked rows included, like `F.kl_div(..., 'batchmean')`).
    """
    if old_logits.shape != new_logits.shape or old_logits.dim() != 2:
        raise ValueError(f"expected two [N, M] matrices, got {tuple(old_logits.shape)} and {tuple(new_logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    per_row = row_kl(old_logits, new_logits, temperature)
    if keep is not None:
        per_row = torch.where(keep.to(per_row.device), per_row, torch.zeros_like(per_row))
    if reduction == "sum":
        return per_row.sum()
    if reduction == "batchmean":
        return per_row.sum() / per_row.shape[0]
    raise ValueError(f"Unknown reduction {reduction!r}; valid: {list(REDUCTIONS)}")


def modx_keep_mask(old_sim: torch.Tensor, positive_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mod-X Eq. 3 as a row mask: keep row i when the teacher retrieves right, i.e. argmax_j M_{t-1}[i, j] is a
    positive of row i ([N] bool).

    With `positive_mask=None` the only positive is the diagonal: keep iff argmax_j M_{t-1}[i, j] == i, exactly
    Eq. 3 and the code's `cognition_align` (ties go to the first maximal column, as `torch.max` does). With a
    positive mask (same text or same image, DESIGN.md "Positives in a batch"), a row whose argmax is a duplicate of
    its own text also counts as right; with unique pairs the mask is the identity and both readings agree.
    """
    if old_sim.dim() != 2:
        raise ValueError(f"expected an [N, M] similarity matrix, got shape {tuple(old_sim.shape)}")
    best = old_sim.argmax(dim=1)
    if positive_mask is None:
        return best == torch.arange(old_sim.shape[0], device=old_sim.device)
    if positive_mask.shape != old_sim.shape:
        raise ValueError(f"positive mask {tuple(positive_mask.shape)} does not match {tuple(old_sim.shape)}")
    return positive_mask.to(device=old_sim.device, dtype=torch.bool).gather(1, best.unsqueeze(1)).squeeze(1)


def directional_kl(
    old_logits: torch.Tensor,
    new_logits: torch.Tensor,
    directions: Sequence[str] = DIRECTIONS,
    temperature: float = 1.0,
    reduction: str = "sum",
    keep: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The mean over `directions` of `similarity_kl` on the oriented matrices (image rows for "i2t", text rows
    for "t2i"), with the per-direction row masks in `keep`. With both directions this is the code's
    0.5 * (KL_I2T + KL_T2I) (specs/modx.md §2.2)."""
    if not directions:
        raise ValueError("at least one direction is needed")
    terms = [
        similarity_kl(
            oriented(old_logits, d), oriented(new_logits, d), (keep or {}).get(d), temperature, reduction
        )
        for d in directions
    ]
    return torch.stack(terms).mean()


def check_directions(directions: Sequence[str]) -> None:
    """Reject an empty, repeated or unknown direction list."""
    unknown = sorted(set(directions) - set(DIRECTIONS))
    if not directions or unknown or len(set(directions)) != len(directions):
        raise ValueError(f"directions must be a non-empty subset of {list(DIRECTIONS)} without repeats, got {directions}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# ----- the shared teacher ------------------------------------------------------------------------------------
@dataclass
class TeacherConfig(MethodConfig):
    """Options every teacher-based method has."""

    teacher_cache: bool = field(
        default=False,
        metadata={
            "help": "Cache the teacher's embeddings per image/text hash for the task (FrozenTeacher(cache=True)): "
            "each example is encoded once per task instead of once per epoch. Exact only without random "
            "augmentation (true for CLIPCollator)."
        },
    )


#: The config of a subclass (`TeacherMethod[ItsConfig]`).
TeacherConfigT = TypeVar("TeacherConfigT", bound=TeacherConfig)


class TeacherMethod(ContinualMethod[TeacherConfigT]):
    """Base of distillation methods: a frozen snapshot of the model as it was when the current task started.

    - `on_task_start`: task 0 has no teacher; task t > 0 snapshots `context.model` (CLIP_{t-1}). Methods that
      change the model at task start (vocabulary growth) must come before this one in the method list, so the
      teacher reads the same inputs as the student.
    - `teacher_embeddings`: the teacher's normalised global-batch embeddings, on the student's device.
    - `teacher_similarity`: the teacher's cosine matrix over the global batch (Mod-X Eq. 1).
    - `on_task_end`: the teacher is released (the next task takes a fresh snapshot).
    - `state_dict`: empty. The teacher is re-snapshotted at every task start from the model being trained, which on
      resume is the checkpoint of the previous task, i.e. the very model it was taken from.
    """

    config_class = TeacherConfig
    roles = {
        "previous_model": "distils the previous task's model",
        "similarity_distillation": "distils the previous model's in-batch similarity matrix",
    }
    conflicts = {"similarity_distillation": "also distils the previous model's in-batch similarity matrix (Mod-X is "
                 "LwF with row selection): use one of them"}
    runs_after = {"vocabulary": "snapshots the model at task start as its teacher, which must read the same tokens "
                  "as the student"}

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.teacher: FrozenTeacher | None = None
        self._teacher_device: torch.device | None = None

    def on_task_start(self, context: TaskContext) -> None:
        self.release_teacher()
        if context.task_index > 0:
            self.teacher = FrozenTeacher(context.model, cache=self.config.teacher_cache)
            for parameter in self.teacher.parameters():
                parameter.grad = None  # deepcopy keeps stale student gradients; a teacher never needs them
            self._place_teacher(_device_of(context.model))
        return None

    def on_task_end(self, context: TaskContext) -> None:
        self.release_teacher()

    def release_teacher(self) -> None:
        self.teacher = None
        self._teacher_device = None

    def teacher_embeddings(
        self, model: ContinualDualEncoder, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised teacher image and text embeddings of the global batch ([N, D] each, no grad), on the
        student's device (the teacher follows the student if the Trainer moved it after the snapshot)."""
        if self.teacher is None:
            raise RuntimeError(f"{self.name}: no teacher (task 0, or on_task_start was not called)")
        self._place_teacher(_device_of(model))
        return self.teacher.embed_global(inputs)

    def teacher_similarity(self, model: ContinualDualEncoder, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's cosine matrix over the global batch, M_{t-1} (Mod-X Eq. 1): images as rows, float32."""
        old_images, old_texts = self.teacher_embeddings(model, inputs)
        return old_images.float() @ old_texts.float().t()

    def _place_teacher(self, device: torch.device) -> None:
        if self.teacher is not None and self._teacher_device != device:
            self.teacher.to(device)
            self._teacher_device = device

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save: the teacher is rebuilt at task start (see the class docstring)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore; the teacher is taken afresh by the next `on_task_start`."""


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def student_similarity(outputs: Any) -> torch.Tensor:
    """M_t (Mod-X Eq. 2): cosine similarities of the student's global batch, image rows ([N, N], with grad)."""
    if outputs.all_image_embeds is None or outputs.all_text_embeds is None:
        raise ValueError("the model output carries no global embeddings; use a ContinualDualEncoder (hf_ccl.families)")
    return outputs.all_image_embeds.float() @ outputs.all_text_embeds.float().t()
