"""CTP: Compatible momentum contrast with Topology Preservation (Zhu, Wei, Liang, Zhang, Zhao, ICCV 2023,
arXiv 2308.07146), the CLIP variant (spec: ../shared/specs/ctp.md; pure functions: `ctp_losses`).

Three models during task t (1-indexed as in the paper; `context.task_index` is t - 1):
- F, the model being trained (theta_t);
- R, the previous-task model theta_{t-1}: a frozen snapshot taken at task start (tasks t >= 2). Nothing is saved
  for it: the snapshot of the checkpointed model is the same model, also after a restart (`FrozenTeacher`);
- M, the compatible momentum model theta_c: a copy of theta_{t-1} re-made at every task start (spec 7.8), updated by
  Eq. 3 once per optimizer step (m = 0.9), or on the first task by a plain EMA of F with m = 0.995 (App. E.1).

Loss (Eq. 10 without the MLM terms: CLIP has no fusion encoder, spec 2.9(a) `clip_only`), all weights 1:
    L = L_ita (the model's contrastive loss) + L^c_ita (Eq. 4) + L_c (Eq. 7) + L_s (Eq. 9);
on the first task there is no R, so L = L_ita + L^c_ita (CTP's task-1 model is not fine-tuning's).

Where Eq. 3 runs: before M's forward of each iteration, on F's current weights, i.e. after F's previous optimizer
step, as in the official code (`_momentum_update_three` at the top of the momentum block). `pre_optimizer_step`
only raises a flag; the update itself runs at the start of the next `loss_terms` call, once per optimizer step
(micro-batches of one accumulated step share one M). Updating inside `pre_optimizer_step` would use F's pre-step
weights: a one-step lag, not Eq. 3 as written.

Batch layout (DESIGN.md): every matrix runs over the global batch, rows and columns (the model's gathered
embeddings, with gradients for this process's rows), so the loss does not depend on the number of processes; the
official code uses local rows against gathered columns, which is the same on one process. The queues hold the
global batch's momentum features, so every process keeps identical queues.

Positives (DESIGN.md, "Positives in a batch"): Eq. 4 assumes column i is row i's only positive and Eq. 8 that the
diagonal is the only self-similarity. With `positives="mask"` (default) L^c_ita uses soft targets over every pair
that shares the text or the image, in the batch and in the queue (hashes are queued next to the features), and
L_s excludes every pair of identical images (resp. texts); with unique pairs this is exactly the paper.
`positives="diagonal"` is the paper's reading whatever the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import all_gather_no_grad
from ..sharding import whole
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .ctp_losses import (
    DIVERGENCES,
    enqueue,
    momentum_contrast_loss,
    momentum_update_,
    queue_positive_mask,
    same_item_mask,
    topology_loss,
)
from .registry import register_method
from .teacher import FrozenTeacher

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

#: theta_{t-1}'s share of (1 - m) in Eq. 3, per `momentum_mode` (Tab. 3: "only theta^t", "only theta^{t-1}").
MOMENTUM_MODES = {"compatible": 0.5, "current": 0.0, "previous": 1.0}
POSITIVES = ("mask", "diagonal")
#: The largest feature queue: 1024x the paper's K (1024), 16x MoCo's largest (65,536). At 2^20 entries of a
#: 1024-wide embedding the two queues already take 8 GiB; 10^9 entries would take terabytes.
MAX_QUEUE_SIZE = 2**20


@dataclass
class CTPConfig(MethodConfig):
    momentum: float = field(
        default=0.9, metadata={"help": "m of the compatible momentum update (Eq. 3) on tasks 2..T (P Sec. 5.1, Tab. 5)."}
    )
    first_task_momentum: float = field(
        default=0.995,
        metadata={"help": "m of the plain EMA of the current model on the first task (P App. E.1: 0.9 fails there)."},
    )
    momentum_mode: str = field(
        default="compatible",
        metadata={"help": "Eq. 3 'compatible'; Tab. 3 ablations: 'current' (EMA of F), 'previous' (M -> theta_{t-1})."},
    )
    queue_size: int = field(
        default=1024,
        metadata={"help": "K, entries per feature queue (P Sec. 5.1: 1024 = 2 global batches); 0: no queue (Tab. 3 "
                  "'w/o Q'). At small scale use 2-8x the global batch (spec Sec. 8: 4x)."},
    )
    temperature: float = field(
        default=0.07, metadata={"help": "tau of the momentum contrast and topology preservation (P Sec. 5.1)."}
    )
    fix_temperature: bool = field(
        default=True,
        metadata={"help": "At task start set the model's logit_scale to ln(1/temperature) and freeze it (P Sec. 5.1: "
                  "tau = 0.07 is fixed). Set False to keep a pretrained CLIP's learned temperature."},
    )
    cmc_weight: float = field(default=1.0, metadata={"help": "Weight of L^c_ita (Eq. 4, 10); 0 disables CMC (Tab. 2)."})
    cross_topology_weight: float = field(
        default=1.0, metadata={"help": "Weight of the cross-modal topology loss L_c (Eq. 7, 10); 0 disables it."}
    )
    same_topology_weight: float = field(
        default=1.0, metadata={"help": "Weight of the same-modal topology loss L_s (Eq. 9, 10); 0 disables it."}
    )
    topology_divergence: str = field(
        default="cross_entropy",
        metadata={"help": "'cross_entropy' H(P_old, P_new) (paper, Eq. 7, 9) or 'kl' KL(P_old || P_new) (official "
                  "code): same gradient, KL is 0 when the models agree."},
    )
    positives: str = field(
        default="mask",
        metadata={"help": "'mask': pairs sharing a text or image are positives in Eq. 4 and excluded like the "
                  "diagonal in Eq. 8 (DESIGN.md); 'diagonal': the paper's reading (only the diagonal)."},
    )
    teacher_cache: bool = field(
        default=False,
        metadata={"help": "Cache the previous-task model's embeddings per example hash (exact without augmentation)."},
    )
    save_momentum_model: bool = field(
        default=True,
        metadata={"help": "Save M's weights in the method state. Task-end checkpoints do not need them (M is "
                  "re-made from theta_{t-1} at every task start); they restore a method mid-task."},
    )

    def __post_init__(self) -> None:
        for name in ("momentum", "first_task_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ctp: {name} must be in [0, 1), got {getattr(self, name)}")
        if self.momentum_mode not in MOMENTUM_MODES:
            raise ValueError(f"ctp: momentum_mode must be one of {sorted(MOMENTUM_MODES)}, got {self.momentum_mode!r}")
        if not 0 <= self.queue_size <= MAX_QUEUE_SIZE:
            raise ConfigError(f"ctp: queue_size must be in [0, {MAX_QUEUE_SIZE}] (1024x the paper's K = 1024; each "
                              f"entry holds an image and a text embedding), got {self.queue_size}", "queue_size")
        if self.temperature <= 0:
            raise ValueError(f"ctp: temperature must be > 0, got {self.temperature}")
        if self.topology_divergence not in DIVERGENCES:
            raise ValueError(f"ctp: topology_divergence must be one of {DIVERGENCES}, got {self.topology_divergence!r}")
        if self.positives not in POSITIVES:
            raise ValueError(f"ctp: positives must be one of {POSITIVES}, got {self.positives!r}")
        for name in ("cmc_weight", "cross_topology_weight", "same_topology_weight"):
            check_range(name, getattr(self, name), 0)


@register_method
class CTP(ContinualMethod[CTPConfig]):
    """CTP for CLIP: momentum contrast against a compatible momentum model and its queues, and topology
    preservation against the previous-task model. Loss terms: `cmc`, `topology_cross`, `topology_same`."""

    fsdp_refusal = None  # M and R kept whole on every process; Eq. 3 gathers F's shards each step
    name = "ctp"
    test_options = {"queue_size": 32}  # a queue that fills on 64-example tasks
    test_families = ("siglip",)
    config_class = CTPConfig
    roles = {"previous_model": "builds its momentum model from the previous task's model and preserves its topology"}
    config: CTPConfig

    def __init__(self, config: CTPConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.reference: FrozenTeacher | None = None  # R: theta_{t-1}, frozen (tasks >= 2)
        self.momentum_model: FrozenTeacher | None = None  # M: theta_c, changed only by Eq. 3
        self.image_queue: torch.Tensor | None = None  # [K, D] momentum image features (Q^I)
        self.text_queue: torch.Tensor | None = None  # [K, D] momentum text features (Q^T)
        self.image_queue_hash: torch.Tensor | None = None  # [K] int64 image hash of each queued pair (0: none)
        self.text_queue_hash: torch.Tensor | None = None  # [K] int64 text hash of each queued pair
        self.queue_pointer = 0
        self.task_index: int | None = None
        self.momentum_update_due = False  # set after each optimizer step; Eq. 3 runs at the next loss_terms

    # ----- hooks ---------------------------------------------------------------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        """Snapshot R = theta_{t-1} (tasks >= 2) and re-make M from it (spec 2.3, 7.8); keep the queues (spec 7.6)."""
        model = context.model
        if self.config.fix_temperature:
            fix_logit_scale_(model, self.config.temperature)
        self.task_index = context.task_index
        self.reference = FrozenTeacher(model, cache=self.config.teacher_cache) if context.task_index > 0 else None
        self.momentum_model = FrozenTeacher(model) if self.config.cmc_weight else None
        self.momentum_update_due = True  # Eq. 3 runs before M's forward in every iteration, the first included
        self._ensure_queues(model.embed_dim, context.seed)
        return None

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """Mark that F is about to step: Eq. 3 runs on the stepped weights at the next `loss_terms` call."""
        self.momentum_update_due = True

    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        """L^c_ita (Eq. 4) and, from the second task on, L_c (Eq. 7) and L_s (Eq. 9), each weighted (Eq. 10)."""
        if self.task_index is None:
            raise RuntimeError("ctp: loss_terms called before on_task_start")
        image, text, _ = outputs.global_batch()
        self._to_device(image.device)
        text_hash, image_hash = self._global_hashes(inputs)
        terms: dict[str, torch.Tensor] = {}
        if self.momentum_model is not None:
            if model.training and self.momentum_update_due:
                self.momentum_step(model)
            momentum_image, momentum_text = self.momentum_model.embed_global(inputs)
            mask = outputs.global_positive_mask if text_hash is not None else None
            terms["cmc"] = self.config.cmc_weight * self._momentum_contrast(
                image, text, momentum_image, momentum_text, mask, text_hash, image_hash
            )
            if model.training:  # after the loss: the queue holds earlier steps only (spec 7.6)
                self._enqueue(momentum_image, momentum_text, text_hash, image_hash)
        if self.reference is not None and (self.config.cross_topology_weight or self.config.same_topology_weight):
            terms.update(self._topology(image, text, *self.reference.embed_global(inputs), text_hash, image_hash))
        return terms

    # ----- Eq. 3 ---------------------------------------------------------------------------------------------
    @property
    def current_momentum(self) -> float:
        """m for this task: `first_task_momentum` on the first task (no theta_{t-1}), else `momentum`."""
        return self.config.first_task_momentum if self.reference is None else self.config.momentum

    @torch.no_grad()
    def momentum_step(self, model: ContinualDualEncoder) -> None:
        """theta_c <- m theta_c + (1-m)/2 theta_{t-1} + (1-m)/2 theta_t (Eq. 3) over F's trainable parameters
        (frozen ones are equal in F, R and M, where Eq. 3 is the identity); first task: EMA of F (App. E.1)."""
        if self.momentum_model is None:
            return
        momentum = dict(self.momentum_model.model.named_parameters())
        previous = dict(self.reference.model.named_parameters()) if self.reference is not None else None
        current = dict(model.named_parameters())
        names = [name for name, param in current.items() if param.requires_grad]
        momentum_update_(
            [momentum[name] for name in names],
            [whole(current[name].detach(), momentum[name]) for name in names],  # FSDP2: gathered each step
            [previous[name] for name in names] if previous is not None else None,
            self.current_momentum,
            MOMENTUM_MODES[self.config.momentum_mode],
        )
        self.momentum_update_due = False

    # ----- Eq. 4 ---------------------------------------------------------------------------------------------
    def _momentum_contrast(
        self,
        image: torch.Tensor,
        text: torch.Tensor,
        momentum_image: torch.Tensor,
        momentum_text: torch.Tensor,
        mask: torch.Tensor | None,
        text_hash: torch.Tensor | None,
        image_hash: torch.Tensor | None,
    ) -> torch.Tensor:
        """L^c_ita = (L^c_i2t + L^c_t2i) / 2 against [this batch's momentum features; queue] (Eq. 4)."""
        queue_mask, queues = None, self._queues()
        if mask is not None and queues is not None and text_hash is not None and image_hash is not None:
            queue_mask = queue_positive_mask(text_hash, image_hash, queues[3], queues[2])
        tau = self.config.temperature
        i2t = momentum_contrast_loss(image, momentum_text, self.text_queue, tau, mask, queue_mask)
        t2i = momentum_contrast_loss(
            text, momentum_image, self.image_queue, tau, None if mask is None else mask.t(), queue_mask
        )
        return (i2t + t2i) / 2

    def _enqueue(
        self,
        momentum_image: torch.Tensor,
        momentum_text: torch.Tensor,
        text_hash: torch.Tensor | None,
        image_hash: torch.Tensor | None,
    ) -> None:
        """Push the global batch's momentum features (and their hashes; 0 when absent) into the FIFO queues."""
        queues = self._queues()
        if queues is None:
            return
        image_queue, text_queue, image_queue_hash, text_queue_hash = queues
        pointer = self.queue_pointer
        self.image_queue, _ = enqueue(image_queue, pointer, momentum_image)
        self.text_queue, _ = enqueue(text_queue, pointer, momentum_text)
        zeros = torch.zeros(momentum_image.shape[0], dtype=torch.int64, device=momentum_image.device)
        self.image_queue_hash, _ = enqueue(image_queue_hash, pointer, zeros if image_hash is None else image_hash)
        self.text_queue_hash, self.queue_pointer = enqueue(
            text_queue_hash, pointer, zeros if text_hash is None else text_hash
        )

    def _queues(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(image queue, text queue, their hashes), made together by `_ensure_queues`; None without a queue."""
        if (self.image_queue is None or self.text_queue is None or self.image_queue_hash is None
                or self.text_queue_hash is None):
            return None
        return self.image_queue, self.text_queue, self.image_queue_hash, self.text_queue_hash

    def _ensure_queues(self, dim: int, seed: int) -> None:
        """Random unit vectors (official code), seeded so that every process starts from the same queues."""
        size = self.config.queue_size
        if self.image_queue is not None:
            if tuple(self.image_queue.shape) != (size, dim):
                raise ValueError(
                    f"ctp: the restored queues are {tuple(self.image_queue.shape)}, the config and model need {(size, dim)}"
                )
            return
        if size == 0:
            return
        generator = torch.Generator().manual_seed(seed)
        self.image_queue = torch.nn.functional.normalize(torch.randn(size, dim, generator=generator), dim=-1)
        self.text_queue = torch.nn.functional.normalize(torch.randn(size, dim, generator=generator), dim=-1)
        self.image_queue_hash = torch.zeros(size, dtype=torch.int64)
        self.text_queue_hash = torch.zeros(size, dtype=torch.int64)
        self.queue_pointer = 0

    # ----- Eq. 6-9 -------------------------------------------------------------------------------------------
    def _topology(
        self,
        image: torch.Tensor,
        text: torch.Tensor,
        ref_image: torch.Tensor,
        ref_text: torch.Tensor,
        text_hash: torch.Tensor | None,
        image_hash: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """L_c (Eq. 7, cross-modal) and L_s (Eq. 9, same-modal with identical items excluded, Eq. 8)."""
        tau, divergence, terms = self.config.temperature, self.config.topology_divergence, {}
        if self.config.cross_topology_weight:
            i2t = topology_loss(image @ text.t(), ref_image @ ref_text.t(), tau, divergence=divergence)
            t2i = topology_loss(text @ image.t(), ref_text @ ref_image.t(), tau, divergence=divergence)
            terms["topology_cross"] = self.config.cross_topology_weight * (i2t + t2i) / 2
        if self.config.same_topology_weight:
            size, device = image.shape[0], image.device
            image_same = same_item_mask(image_hash, size, device)
            text_same = same_item_mask(text_hash, size, device)
            i2i = topology_loss(image @ image.t(), ref_image @ ref_image.t(), tau, image_same, divergence)
            t2t = topology_loss(text @ text.t(), ref_text @ ref_text.t(), tau, text_same, divergence)
            terms["topology_same"] = self.config.same_topology_weight * (i2i + t2t) / 2
        return terms

    # ----- helpers -------------------------------------------------------------------------------------------
    def _global_hashes(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gathered text and image hashes for `positives="mask"`; (None, None) for the diagonal reading."""
        if self.config.positives != "mask" or "text_hash" not in inputs or "image_hash" not in inputs:
            return None, None
        return all_gather_no_grad(inputs["text_hash"]), all_gather_no_grad(inputs["image_hash"])

    def _to_device(self, device: torch.device) -> None:
        for teacher in (self.reference, self.momentum_model):
            if teacher is not None and next(teacher.parameters()).device != device:
                teacher.to(device)
        queues = self._queues()
        if queues is not None and queues[0].device != device:
            self.image_queue, self.text_queue, self.image_queue_hash, self.text_queue_hash = (
                queue.to(device) for queue in queues)

    # ----- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Queues (never reset between tasks, spec 7.6), their pointer, and M's weights; R needs nothing (the
        snapshot at task start of the checkpointed model is theta_{t-1})."""
        state: dict[str, Any] = {
            "task_index": self.task_index,
            "queue_pointer": self.queue_pointer,
            "momentum_update_due": self.momentum_update_due,
        }
        if self.image_queue is not None:
            state["queues"] = {
                "image": self.image_queue, "text": self.text_queue,
                "image_hash": self.image_queue_hash, "text_hash": self.text_queue_hash,
            }
        if self.config.save_momentum_model and self.momentum_model is not None:
            state["momentum_model"] = {
                name: param.detach().clone() for name, param in self.momentum_model.model.named_parameters()
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the queues and pointer; M's weights are copied into M when it exists (a method restored after
        `on_task_start`). A later `on_task_start` re-makes M from theta_{t-1}, as the paper does at every task."""
        self.task_index = state.get("task_index")
        self.queue_pointer = int(state.get("queue_pointer", 0))
        self.momentum_update_due = bool(state.get("momentum_update_due", False))
        queues = state.get("queues")
        if queues is not None:
            self.image_queue, self.text_queue = queues["image"].float(), queues["text"].float()
            self.image_queue_hash, self.text_queue_hash = queues["image_hash"].long(), queues["text_hash"].long()
        else:
            self.image_queue = self.text_queue = self.image_queue_hash = self.text_queue_hash = None
        weights = state.get("momentum_model")
        if weights and self.momentum_model is not None:
            with torch.no_grad():
                for name, param in self.momentum_model.model.named_parameters():
                    param.copy_(weights[name].to(param.device, param.dtype))


def fix_logit_scale_(model: ContinualDualEncoder, temperature: float) -> None:
    """Set the model's logit_scale to ln(1/temperature) and freeze it (P Sec. 5.1: tau fixed at 0.07)."""
    with torch.no_grad():
        model.logit_scale.fill_(math.log(1.0 / temperature))
    model.logit_scale.requires_grad_(False)
