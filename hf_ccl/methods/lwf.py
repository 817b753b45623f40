"""LwF: Li & Hoiem, "Learning without Forgetting" (TPAMI 2017), in the contrastive form CLIP papers use.

Mod-X (§5.2, "CLIP_LWF") reproduces LwF "using contrastive loss replaced their cross-entropy loss" and gives no
further detail; CTP's LwF baseline (specs/ctp.md §4) distils the old model's outputs on the new data. Here, as
recommended in specs/modx.md §5: the old model's outputs are its in-batch contrastive logits on the current batch,
s_old * M_{t-1} (s = exp(logit_scale), M the cosine matrix of the global batch), and the new model's are
s * M_t; the loss is

    L_LwF = alpha * mean_{d in directions} (1/N) sum_i KL(softmax(old_d[i] / T) || softmax(new_d[i] / T)),

over every row (no Mod-X row selection), image rows (i2t) and text rows (t2i) averaged. T = 2 and weight 1 are
LwF's own (Li & Hoiem: T = 2, lambda_o = 1); the KL has the gradient of LwF's modified cross-entropy. No T^2 factor
(LwF has none). With `logits: cosine` this is Mod-X without Eq. 3 at temperature T.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .base import TaskContext
from .distillation import (
    DIRECTIONS,
    REDUCTIONS,
    TeacherConfig,
    TeacherMethod,
    check_choice,
    check_directions,
    directional_kl,
    student_similarity,
)
from .registry import register_method

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

LOGITS = ("scaled", "cosine")


@dataclass
class LwFConfig(TeacherConfig):
    alpha: float = field(default=1.0, metadata={"help": "Weight of the distillation term (LwF's lambda_o = 1)."})
    temperature: float = field(
        default=2.0, metadata={"help": "Distillation temperature T on both sides (LwF: 2; specs/modx.md §5)."}
    )
    logits: str = field(
        default="scaled",
        metadata={
            "help": "'scaled': each model's contrastive logits exp(logit_scale) * cosine (its own scale); "
            "'cosine': raw cosines, as Mod-X."
        },
    )
    reduction: str = field(
        default="batchmean", metadata={"help": "'batchmean' (mean over rows, standard) or 'sum' (rows and columns)."}
    )
    directions: list[str] = field(
        default_factory=lambda: list(DIRECTIONS),
        metadata={"help": "Subset of ['i2t', 't2i'] (image rows, text rows), averaged."},
    )

    def __post_init__(self) -> None:
        check_choice("logits", self.logits, LOGITS)
        check_choice("reduction", self.reduction, REDUCTIONS)
        self.directions = list(self.directions)
        check_directions(self.directions)
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


def lwf_kl(
    old_logits: torch.Tensor,
    new_logits: torch.Tensor,
    directions: list[str],
    temperature: float = 2.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """The LwF distillation loss (unweighted): row-wise KL(old || new) at `temperature` over every row of each
    direction's matrix (image rows for i2t, text rows for t2i), averaged over directions."""
    return directional_kl(old_logits, new_logits, directions, temperature, reduction)


@register_method
class LwF(TeacherMethod[LwFConfig]):
    """Learning without Forgetting on the in-batch similarity matrix (see the module docstring).

    Loss term `kl` = alpha * L_LwF on tasks t > 0; no teacher and no term on task 0.
    """

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "lwf"
    same_step_as = "modx"
    config_class = LwFConfig

    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        if self.teacher is None or self.config.alpha == 0:
            return {}
        old = self.teacher_similarity(model, inputs)
        if self.config.logits == "scaled":  # each model's own contrastive logits
            old = self.teacher.model.logit_scale.detach().float().exp() * old
            logits = outputs.global_logits_per_image  # exp(logit_scale) * M_t, with grad to the scale
            if logits is None:
                raise ValueError("lwf: the model output holds no global logits (a features_only forward's)")
            new = logits.float()
        else:
            new = student_similarity(outputs)
        loss = lwf_kl(old, new, self.config.directions, self.config.temperature, self.config.reduction)
        return {"kl": self.config.alpha * loss}
