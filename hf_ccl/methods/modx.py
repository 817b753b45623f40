"""Mod-X: Ni, Wei, Tang, Zhuang, Tian, "Continual Vision-Language Representation Learning with Off-Diagonal
Information", ICML 2023 (paper 000; ../shared/specs/modx.md).

Loss of task t > 0 (Eq. 5): L = L_InfoNCE + alpha * L_KL, where L_KL distils the old model's in-batch similarity
matrix M_{t-1} (Eq. 1, the frozen teacher CLIP_{t-1} on the current batch) into the student's M_t (Eq. 2) after
dropping the rows the teacher gets wrong (Eq. 3), row-wise KL (Eq. 4). Both matrices span the global batch.

Paper vs official code (`ModX_Training/continue_train_model.py`), `variant` picks the defaults:

| setting          | "paper" (default)                                   | "code"                                      |
|------------------|-----------------------------------------------------|---------------------------------------------|
| directions       | ["i2t", "t2i"], averaged (the issue's and the       | ["i2t", "t2i"], averaged: 0.5 (KL(M) +      |
|                  | spec's reading; Eq. 1-4 write one matrix M, so      | KL(M^T)), Eq. 3 per direction (column       |
|                  | `directions: [i2t]` is Eq. 4 to the letter)         | argmax for t2i)                             |
| selection        | "positives": a row is kept when the teacher's       | "diagonal": argmax == i (`cognition_align`) |
|                  | argmax is one of its positives (same text or image);|                                             |
|                  | with unique pairs this is Eq. 3 exactly             |                                             |
| kd_temperature   | 1.0: Eq. 1 defines M as raw cosines and no          | 1.0 on raw cosines, no logit_scale          |
|                  | temperature is stated (specs/modx.md §10.2)         |                                             |
| reduction        | "sum": Eq. 4's sum over all entries (§10.3)         | "sum" (`F.kl_div(..., reduction='sum')`)    |

Each setting can be overridden on its own (`directions`, `selection`, `kd_temperature`, `reduction`);
`selection: none` is the "Mod-X without Eq. 3" ablation of specs/modx.md §10.23. Also fixed relative to the code
in both variants: the teacher runs under `no_grad` (the code forgets it, which changes no value) and Eq. 3 is a row
mask instead of a Python row loop (same value and gradient, §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .base import TaskContext
from .distillation import (
    REDUCTIONS,
    TeacherConfig,
    TeacherMethod,
    check_choice,
    check_directions,
    directional_kl,
    modx_keep_mask,
    oriented,
    student_similarity,
)
from .registry import register_method

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {"kd_temperature": 1.0, "reduction": "sum", "directions": ["i2t", "t2i"], "selection": "positives"},
    "code": {"kd_temperature": 1.0, "reduction": "sum", "directions": ["i2t", "t2i"], "selection": "diagonal"},
}
SELECTIONS = ("positives", "diagonal", "none")


@dataclass
class ModXConfig(TeacherConfig):
    alpha: float = field(
        default=20.0, metadata={"help": "Weight of the KL term, Eq. 5 (paper Tab. 4 and the code: 20)."}
    )
    variant: str = field(
        default="paper",
        metadata={
            "help": "'paper' (Eq. 1-5, positive-mask selection) or 'code' (the official code: diagonal selection); "
            "sets the defaults of directions, selection, kd_temperature and reduction (see the module docstring)."
        },
    )
    kd_temperature: float | None = field(
        default=None,
        metadata={"help": "Softmax temperature on the raw cosines of Eq. 4; None: the variant's (1.0 for both)."},
    )
    reduction: str | None = field(
        default=None,
        metadata={
            "help": "'sum' over rows and columns (Eq. 4, code) or 'batchmean' (sum / N; multiply alpha by N to "
            "match); None: the variant's ('sum' for both)."
        },
    )
    directions: list[str] | None = field(
        default=None,
        metadata={"help": "Subset of ['i2t', 't2i'], averaged; None: the variant's (both, for both variants)."},
    )
    selection: str | None = field(
        default=None,
        metadata={
            "help": "Eq. 3 row selection: 'positives' (keep a row when the teacher's argmax is one of its positives, "
            "same text or same image; the diagonal when pairs are unique), 'diagonal' (Eq. 3 literally), or 'none' "
            "(no selection: the 'Mod-X without Eq. 3' ablation); None: the variant's (paper 'positives', code "
            "'diagonal')."
        },
    )

    def __post_init__(self) -> None:
        check_choice("variant", self.variant, list(VARIANTS))
        if self.selection is not None:
            check_choice("selection", self.selection, SELECTIONS)
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if self.kd_temperature is not None and self.kd_temperature <= 0:
            raise ValueError(f"kd_temperature must be > 0, got {self.kd_temperature}")
        if self.reduction is not None:
            check_choice("reduction", self.reduction, REDUCTIONS)
        if self.directions is not None:
            self.directions = list(self.directions)
            check_directions(self.directions)

    def resolved(self, name: str) -> Any:
        """The value in use for a variant-dependent setting: the explicit one, else the variant's."""
        value = getattr(self, name)
        return VARIANTS[self.variant][name] if value is None else value


def modx_kl(
    old_sim: torch.Tensor,
    new_sim: torch.Tensor,
    positive_mask: torch.Tensor | None,
    directions: list[str],
    temperature: float,
    reduction: str,
    selection: str = "positives",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L_KL of Eq. 3-4 over `directions` (averaged) and the per-direction keep masks.

    `old_sim` / `new_sim` are M_{t-1} / M_t (image rows, raw cosines). Per direction the matrices are oriented (M^T
    for t2i), Eq. 3 keeps the rows whose teacher argmax is a positive (`selection`), and Eq. 4 is the row-wise KL
    at `temperature` with `reduction`. `positive_mask` is only read with selection "positives"; None there means
    unique pairs (the diagonal).
    """
    check_choice("selection", selection, SELECTIONS)
    keep: dict[str, torch.Tensor] = {}
    for direction in directions:
        rows = oriented(old_sim, direction)
        if selection == "none":
            keep[direction] = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        else:
            mask = oriented(positive_mask, direction) if selection == "positives" and positive_mask is not None else None
            keep[direction] = modx_keep_mask(rows, mask)
    loss = directional_kl(old_sim, new_sim, directions, temperature, reduction, keep)
    return loss, keep


@register_method
class ModX(TeacherMethod[ModXConfig]):
    """Mod-X (Eq. 1-5): selective KL distillation of the previous task's in-batch similarity matrix.

    Loss term `kl` = alpha * L_KL (task t > 0 only). `metrics()` gives the fraction of rows Eq. 3 kept at the
    last training step, overall and per direction (the trainer averages it over each logging window).
    """

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "modx"
    test_families = ("siglip",)
    config_class = ModXConfig

    def __init__(self, config: ModXConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self._last_kept: dict[str, torch.Tensor] = {}

    def on_task_start(self, context: TaskContext) -> None:
        self._last_kept = {}
        return super().on_task_start(context)

    @property
    def directions(self) -> list[str]:
        return list(self.config.resolved("directions"))

    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        if self.teacher is None or self.config.alpha == 0:
            return {}
        old_sim = self.teacher_similarity(model, inputs)  # Eq. 1
        new_sim = student_similarity(outputs)  # Eq. 2
        loss, keep = modx_kl(
            old_sim,
            new_sim,
            outputs.global_positive_mask,
            self.directions,
            self.config.resolved("kd_temperature"),
            self.config.resolved("reduction"),
            self.config.resolved("selection"),
        )
        if model.training:
            self._last_kept = {d: mask.float().mean().detach() for d, mask in keep.items()}
        return {"kl": self.config.alpha * loss}  # Eq. 5

    @property
    def last_kept_fraction(self) -> float | None:
        """Fraction of rows Eq. 3 kept at the last training step, averaged over directions (None before any)."""
        if not self._last_kept:
            return None
        return float(torch.stack(list(self._last_kept.values())).mean())

    def metrics(self) -> dict[str, torch.Tensor]:
        """`kept_fraction` (mean over directions) and `kept_fraction/<direction>` of the last training step, as
        device tensors (no host sync per step)."""
        if not self._last_kept:
            return {}
        values = {f"kept_fraction/{d}": v for d, v in self._last_kept.items()}
        values["kept_fraction"] = torch.stack(list(self._last_kept.values())).mean()
        return values
