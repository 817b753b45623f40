"""C-CLIP: Liu, Zhu, Wei, Tian, "C-CLIP: Multimodal Continual Learning for Vision-Language Model", ICLR 2025
(OpenReview sb7qHFYwBc). Not CLL-CLIP (`cllclip`, new languages): C-CLIP continually trains a CLIP on image-caption
domains, like Mod-X and CTP.

Two parts, both in this one method (`c_clip`):

- **LoRA integration** (Sec. 4.1, Eq. 2): at each task start a fresh LoRA adapter is injected into both towers (the
  `lora` method's machinery) and only it trains; at the task end it is folded into the backbone at a fraction
  alpha of its trained value, theta_t = theta_{t-1} + alpha * theta_LoRA (Eq. 2, alpha = 0.5 in every experiment):
  W <- W + alpha * (lora_alpha / r) * B A. The deployed model is a plain CLIP (`from_pretrained` loads it). The
  saved adapter (method state and PEFT folder) holds alpha * B, so PEFT's `merge_and_unload()` of the folder on the
  previous checkpoint gives this checkpoint. Base parameters that also train (`trainable`,
  `train_outside_encoders`) are folded the same way: p <- p_{t-1} + alpha * (p_trained - p_{t-1}).
- **Contrastive knowledge consolidation** (Sec. 4.2, Eq. 5): a projector h_psi (an MLP) maps the new model's
  features; its normalised outputs for the 2N instances of the batch (N images, then N texts) are contrasted with
  the frozen old model's normalised features of the same 2N instances: instance i's old feature is its positive,
  the other 2N - 1 old features its negatives, in both directions (projected -> old and old -> projected), at the
  temperature tau of the CLIP loss (Eq. 6; the model's `logit_scale`). The old model is the model at task start
  (theta_{t-1}; on the first task the model the run starts from), so CKC trains from the first task on. The
  projector is trained with the task's optimizer, re-initialised at every task start and discarded after the task
  (the authors' code builds a new one per task). Total loss (Sec. 4.2): L = L_CLIP + L_CKC.

Paper vs the authors' code. The official repository (github.com/SmallPigPeppa/C-CLIP) could not be read here; the
authors' research code for the paper's runs (github.com/SmallPigPeppa/clip-lightning, `clip_openai/
model_distill_zeroshot_lora_best_v2.py`, the "distill_lora_v2" runs) could. `variant` picks the defaults:

| setting                   | "paper" (default)                                  | "code"                                   |
|---------------------------|----------------------------------------------------|------------------------------------------|
| ckc_reduction             | "sum": Eq. 5 as printed, -1/(2N) sum over the 2N   | "mean": the two directions averaged      |
|                           | rows of both directions' log-probabilities         | (half of Eq. 5)                          |
| train_outside_encoders    | false: "only the newly added A and B are           | true: everything outside the encoder     |
|                           | trainable" (Sec. 4.1)                              | layers trains (embeddings, final norms,  |
|                           |                                                    | projections, logit_scale) but the patch  |
|                           |                                                    | embedding; Tab. 6's counts agree         |

Read from the code and the paper's Table 6 (the paper leaves them unsaid), the same in both variants: LoRA on every
linear layer of the encoder blocks the code reaches, which in OpenAI's CLIP is the attention output and both MLP
layers (its q, k, v are one fused tensor, not a linear layer): `target_modules: [out_proj, fc1, fc2]`; Tab. 6's
LoRA parameter counts (29.1M - 27.6M for 8 more ranks of ViT-B/16) are exactly these layers'. r = 16, lora_alpha =
2 r = 32, dropout 0.1 (Sec. 5). The projector is Linear(d, 2048) - BatchNorm - ReLU - Linear(2048, d), one for both
modalities, applied to the features before normalisation (Fig. 4 says "MLP projector"). The code also mixes
checkpoints in ratios other than 1:1 for some tasks (`a_mix.sh`); the paper's alpha = 0.5 is used here.

Batch layout (DESIGN.md): Eq. 5 runs over the global batch (every process's rows; the projector runs on the gathered
features, so its batch statistics and the loss do not depend on the number of processes). Positives
(`positives: mask`): an image row's positives are the old features of every copy of that image in the batch, a text
row's those of every copy of that caption (templated captions repeat); with unique pairs this is Eq. 5 exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_gather_no_grad, all_gather_with_grad
from ..losses import soft_cross_entropy, soft_targets
from ..validation import check_range
from .base import TaskContext
from .distillation import check_choice
from .lora import TOWERS, LoRA, LoRAMethodConfig, adapter_name, lora_layers
from .registry import register_method
from .teacher import FrozenTeacher

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {"ckc_reduction": "sum", "train_outside_encoders": False},
    "code": {"ckc_reduction": "mean", "train_outside_encoders": True},
}
CKC_REDUCTIONS = ("sum", "mean")
POSITIVES = ("mask", "diagonal")
#: The patch (or convolutional) embedding of every family's vision tower: frozen by the code variant, as the code does.
PATCH_EMBEDDING = re.compile(r"vision_model\.embeddings\.patch_embedding\.")


@dataclass
class CCLIPConfig(LoRAMethodConfig):
    r: int = field(default=16, metadata={"help": "LoRA rank R (Sec. 5: 16; Tab. 6 compares 8 to 64)."})
    alpha: float = field(default=32.0, metadata={"help": "LoRA alpha, the update scaled by alpha / r (Sec. 5: 2 R)."})
    dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA branch's input (Sec. 5: 0.1)."})
    target_modules: list[str] = field(
        default_factory=lambda: ["out_proj", "fc1", "fc2"],
        metadata={"help": "Linear layers of each encoder layer to adapt: the authors' code reaches the attention output "
                          "and both MLP layers (Tab. 6's parameter counts); add q_proj, k_proj, v_proj for every linear "
                          "layer of HF's CLIP."},
    )
    merge_alpha: float = field(
        default=0.5,
        metadata={"help": "alpha of Eq. 2, in (0, 1]: the fraction of the task's LoRA update (and of any trained base "
                          "parameter's change) folded into the backbone after the task (paper: 0.5)."},
    )
    ckc_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of L_CKC (Eq. 5) beside the CLIP loss (Sec. 4.2: 1); 0 trains LoRA integration "
                          "alone (Tab. 5 '+ LoRA')."},
    )
    projector_hidden_dim: int = field(
        default=2048, metadata={"help": "Hidden width of the projector MLP h_psi (the authors' code: 2048)."}
    )
    temperature: float | None = field(
        default=None,
        metadata={"help": "tau of Eq. 5; None: the CLIP loss's, 1 / exp(logit_scale) of the model being trained "
                          "(Eq. 5 and 6 share tau; the code uses the model's logit_scale)."},
    )
    variant: str = field(
        default="paper",
        metadata={"help": "'paper' or 'code' (the authors' research code): sets the defaults of ckc_reduction and "
                          "train_outside_encoders (module docstring)."},
    )
    ckc_reduction: str | None = field(
        default=None,
        metadata={"help": "'sum': Eq. 5 as printed (both directions summed, averaged over the 2N rows) or 'mean' "
                          "(the code: the two directions averaged, half of it); None: the variant's."},
    )
    train_outside_encoders: bool | None = field(
        default=None,
        metadata={"help": "Also train every parameter outside the encoder layers but the patch embedding (token and "
                          "position embeddings, final norms, projections, logit_scale), as the code does; None: the "
                          "variant's (paper false, code true)."},
    )
    positives: str = field(
        default="mask",
        metadata={"help": "'mask': every copy of an image (a caption) in the batch is a positive of its rows "
                          "(DESIGN.md); 'diagonal': only the instance itself (Eq. 5 read literally)."},
    )
    teacher_cache: bool = field(
        default=False,
        metadata={"help": "Cache the old model's embeddings per image/text hash for the task (exact without "
                          "augmentation)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("variant", self.variant, list(VARIANTS))
        check_choice("positives", self.positives, POSITIVES)
        if self.ckc_reduction is not None:
            check_choice("ckc_reduction", self.ckc_reduction, CKC_REDUCTIONS)
        check_range("merge_alpha", self.merge_alpha, 0, 1, low_open=True)
        check_range("ckc_weight", self.ckc_weight, 0)
        if self.temperature is not None:
            check_range("temperature", self.temperature, 0, low_open=True)
        if self.projector_hidden_dim < 1:
            raise ValueError(f"projector_hidden_dim must be >= 1, got {self.projector_hidden_dim}")

    def resolved(self, name: str) -> Any:
        """The value in use for a variant-dependent setting: the explicit one, else the variant's."""
        value = getattr(self, name)
        return VARIANTS[self.variant][name] if value is None else value


# ----- Eq. 5 ------------------------------------------------------------------------------------------------------
def ckc_loss(
    projected: torch.Tensor,
    old: torch.Tensor,
    logit_scale: torch.Tensor | float,
    positive_mask: torch.Tensor | None = None,
    reduction: str = "sum",
) -> torch.Tensor:
    """L_CKC of Eq. 5 on the 2N instances of a batch (rows: N images then N texts).

    `projected` holds h_psi of the new model's features, `old` the old model's features of the same instances (no
    gradient); both are normalised here. With s = `logit_scale` (1 / tau) and S = s * norm(projected) norm(old)^T:

        "sum"  (Eq. 5):  L = CE(S) + CE(S^T),        "mean" (code):  L = (CE(S) + CE(S^T)) / 2,

    CE the mean over rows of the cross-entropy against row i's positives (the diagonal without `positive_mask`;
    uniform over its positives with one).
    """
    if projected.shape != old.shape or projected.dim() != 2:
        raise ValueError(f"expected two [2N, D] matrices, got {tuple(projected.shape)} and {tuple(old.shape)}")
    check_choice("reduction", reduction, CKC_REDUCTIONS)
    logits = logit_scale * F.normalize(projected.float(), dim=-1) @ F.normalize(old.detach().float(), dim=-1).t()
    if positive_mask is None:
        positive_mask = torch.eye(logits.shape[0], dtype=torch.bool, device=logits.device)
    forward = soft_cross_entropy(logits, soft_targets(positive_mask))
    backward = soft_cross_entropy(logits.t(), soft_targets(positive_mask.t()))
    total = forward + backward
    return total if reduction == "sum" else total / 2.0


def instance_positive_mask(image_hash: torch.Tensor, text_hash: torch.Tensor) -> torch.Tensor:
    """[2N, 2N] positives of Eq. 5 with repeated items: image i and image j (texts alike) are positives when they
    are the same item; an image and a text never are. With unique items it is the identity."""
    images = image_hash[:, None] == image_hash[None, :]
    texts = text_hash[:, None] == text_hash[None, :]
    return torch.block_diag(images, texts)


class Projector(nn.Module):
    """h_psi: Linear(d, hidden) - BatchNorm - ReLU - Linear(hidden, d) (the authors' code)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.project(features)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The forward as plain functions of the parameters, without module hooks: the loss calls it on the feature
        leaves of exact gradient accumulation, which module-level backward hooks (the step's FLOP counter) refuse."""
        first, norm, _, last = self.net
        assert isinstance(first, nn.Linear) and isinstance(norm, nn.BatchNorm1d) and isinstance(last, nn.Linear)
        if self.training and norm.num_batches_tracked is not None:
            norm.num_batches_tracked.add_(1)
        hidden = F.batch_norm(F.linear(features, first.weight, first.bias), norm.running_mean, norm.running_var,
                              norm.weight, norm.bias, self.training, norm.momentum or 0.0, norm.eps)
        return F.linear(F.relu(hidden), last.weight, last.bias)

    def reset(self) -> None:
        """Fresh weights and batch statistics, in place (the optimizer keeps referring to the same tensors)."""
        for module in self.net:
            if isinstance(module, (nn.Linear, nn.BatchNorm1d)):
                module.reset_parameters()


def outside_encoder_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters the code variant trains: all but the encoder layers' and the patch embedding's."""
    layers = re.compile("|".join(TOWERS.values()))
    return [name for name, _ in model.named_parameters()
            if not layers.match(name) and not PATCH_EMBEDDING.match(name) and ".lora_" not in name]


# ----- the method -------------------------------------------------------------------------------------------------
@register_method
class CCLIP(LoRA):
    """C-CLIP: LoRA per task folded in at alpha (Eq. 2) and contrastive knowledge consolidation (Eq. 5) through a
    per-task projector. Loss term `ckc` (weighted)."""

    fsdp_refusal = ("its PEFT adapters wrap the model, and the plain model the loop gathers after each task would not "
                    "carry them; its projector trains beside the model (optimizer_parameters), which accelerate cannot "
                    "map to sharded parameters")
    name = "c_clip"
    #: Small adapter and projector; no LoRA dropout (its masks are drawn per micro-batch, and the matrix compares
    #: a 64-row step with two 32-row ones).
    test_options = {"r": 4, "alpha": 8.0, "dropout": 0.0, "projector_hidden_dim": 16}
    config_class = CCLIPConfig
    config: CCLIPConfig
    roles = {
        "previous_model": "adapts the previous task's model and consolidates its features",
        "parameter_efficient": "freezes the model but for its adapter (and `trainable`) during each task",
    }
    runs_after = {"vocabulary": "snapshots the model at task start as its old model, which must read the same tokens "
                  "as the student"}

    def __init__(self, config: CCLIPConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.teacher: FrozenTeacher | None = None  # theta_{t-1}: the model at task start
        self.projector: Projector | None = None  # h_psi, created once, re-initialised at every task start
        self.in_task = False  # between task start and the fold-in: the projector is live and saved
        self._pending_projector: dict[str, torch.Tensor] | None = None
        self._extra_trainable: list[str] = []  # the code variant's parameters outside the encoder layers
        self._trained_base: list[str] = []  # base parameters this task trains (beside the adapter)
        self._device: torch.device | None = None  # where the teacher and the projector are

    # ----- task hooks -------------------------------------------------------------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        self.teacher = None
        self._trained_base = []
        outside = outside_encoder_parameters(model) if self.config.resolved("train_outside_encoders") else []
        self._extra_trainable = outside
        if self.config.ckc_weight or outside or self.config.trainable:
            self.teacher = FrozenTeacher(model, cache=self.config.teacher_cache)  # before the adapter: theta_{t-1}
            for parameter in self.teacher.parameters():
                parameter.grad = None  # deepcopy keeps stale student gradients
        super().on_task_start(context)  # inject the task's adapter, freeze the rest
        self._trained_base = [name for name, p in model.named_parameters() if p.requires_grad and ".lora_" not in name]
        self._device = None
        if self.config.ckc_weight:
            self._ensure_projector(model.embed_dim, next(model.parameters()).device)
            assert self.projector is not None
            self.projector.reset()  # under the task's seed (the loop seeds task-start hooks)
            if self._pending_projector is not None:
                self._restore_projector(self._pending_projector)
        self.in_task = True

    def trainable_patterns(self, model: nn.Module) -> list[str]:
        return [*self.config.trainable, *self._extra_trainable]

    def optimizer_parameters(self) -> list[nn.Parameter]:
        return list(self.projector.parameters()) if self.projector is not None and self.config.ckc_weight else []

    def after_training(self, context: TaskContext) -> None:
        """Fold the task in at alpha (Eq. 2): move trained base parameters back towards their task-start values,
        scale B by alpha, merge; the projector then leaves the method state (it served this task only)."""
        model = context.model
        alpha = self.config.merge_alpha
        name = adapter_name(context.task_index)
        with torch.no_grad():
            if self._trained_base:  # p <- p_{t-1} + alpha (p - p_{t-1}), before the adapter is merged into them
                if self.teacher is None:
                    raise RuntimeError("c_clip: no task-start snapshot to fold the trained base parameters towards")
                old = dict(self.teacher.model.named_parameters())
                trained = set(self._trained_base)
                for key, parameter in model.named_parameters():
                    if key in trained:
                        start = old[key.replace(".base_layer.", ".")]
                        parameter.lerp_(start.to(parameter.device, parameter.dtype), 1.0 - alpha)
            for layer in lora_layers(model).values():  # Eq. 2: the merge adds alpha (lora_alpha / r) B A
                cast(Any, layer).lora_B[name].weight.mul_(alpha)
        super().after_training(context)
        self.in_task = False
        self._pending_projector = None

    def on_task_end(self, context: TaskContext) -> None:
        self.teacher = None  # the next task snapshots its own

    # ----- Eq. 5 ------------------------------------------------------------------------------------------------
    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        if not self.config.ckc_weight or self.teacher is None or self.projector is None:
            return {}
        if outputs.image_features is None or outputs.text_features is None:
            raise ValueError("c_clip needs the model's features before normalisation (a ContinualDualEncoder output)")
        images = all_gather_with_grad(outputs.image_features)
        texts = all_gather_with_grad(outputs.text_features)
        if images.shape[0] < 2 and model.training:
            raise ValueError("c_clip: the projector's batch norm needs at least 2 examples per global batch: set "
                             "training.per_device_train_batch_size >= 2 and training.dataloader_drop_last=true")
        self._place(images.device)
        self.projector.train(model.training)
        projected = torch.cat([self.projector.project(images.float()), self.projector.project(texts.float())])
        old_images, old_texts = self.teacher.embed_global(inputs)
        mask = None
        if self.config.positives == "mask" and "image_hash" in inputs and "text_hash" in inputs:
            mask = instance_positive_mask(all_gather_no_grad(inputs["image_hash"]),
                                          all_gather_no_grad(inputs["text_hash"]))
        loss = ckc_loss(projected, torch.cat([old_images, old_texts]), self.logit_scale(model), mask,
                        self.config.resolved("ckc_reduction"))
        return {"ckc": self.config.ckc_weight * loss}

    def logit_scale(self, model: ContinualDualEncoder) -> torch.Tensor | float:
        """1 / tau: the fixed `temperature`'s, or the model's own exp(logit_scale) (with its gradient, as in Eq. 6)."""
        if self.config.temperature is not None:
            return 1.0 / self.config.temperature
        return model.logit_scale.float().exp().reshape(())

    def _place(self, device: torch.device) -> None:
        """The teacher and the projector follow the student (the Trainer moves it after the task start)."""
        if self._device != device:
            for module in (self.teacher, self.projector):
                if module is not None:
                    module.to(device)
            self._device = device

    # ----- state ------------------------------------------------------------------------------------------------
    def _ensure_projector(self, dim: int, device: torch.device) -> None:
        if self.projector is None:
            with torch.random.fork_rng(devices=[]):  # its values come from `reset` at each task start, not from here
                self.projector = Projector(dim, self.config.projector_hidden_dim).to(device)

    def _restore_projector(self, state: dict[str, torch.Tensor]) -> None:
        assert self.projector is not None
        own = self.projector.state_dict()
        if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
            raise ValueError("c_clip: the saved projector does not match this model's (embedding size or "
                             "projector_hidden_dim changed)")
        with torch.no_grad():
            for key, value in own.items():
                value.copy_(state[key])  # in place: the optimizer refers to these tensors
        self._pending_projector = None

    def state_dict(self) -> dict[str, Any]:
        """LoRA's adapters; while a task trains (mid-task checkpoints) also the projector's weights and statistics."""
        state = super().state_dict()
        if self.in_task and self.projector is not None:
            state["projector"] = {k: v.detach().to("cpu", copy=True) for k, v in self.projector.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        projector = state.get("projector")
        if not projector:
            return
        if self.projector is not None and self.in_task:
            self._restore_projector(dict(projector))
        else:
            self._pending_projector = dict(projector)
