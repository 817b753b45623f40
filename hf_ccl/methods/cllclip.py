"""CLL-CLIP (Yang et al., "Embracing Language Inclusivity and Diversity in CLIP through Continual Language Learning",
AAAI 2024; specs/cllclip.md §2): CLIP learns new languages one task at a time by training its token embeddings only,
distilled from the frozen original CLIP.

The model (spec §2.1, Eq. 1):
- r^I = g(x^I; Ω_ve): the teacher's image features;
- r^E = g(x^E; Ω_te, Ω_emb): the teacher's text features of the English caption, with the original tokenizer;
- r^F = g(x^F; Ω_te, θ_t): the student's text features of the task-language caption, with the current tokenizer.
The teacher is the frozen *initial* CLIP (both towers), snapshotted at the first task start and kept for the whole
stream; the student differs from it only in its token-embedding table θ_t (and vocabulary), the only tensor that
trains (`on_task_start` freezes everything else).

The loss (Eqs. 2–4), the methods' terms alone (`replaces_contrastive_loss`: the model's own contrastive loss is off):

    L = γ1 · L_cm + γ2 · L_cl,   γ1 = 0.01, γ2 = 1                                     (Eq. 4)
    L_cl = mean over the K×D elements of (r^F − r^E)²                                   (Eq. 3, code's nn.MSELoss)
    L_cm = ½ (L^{I→F} + L^{F→I}),  L^{Y→Z} = −(1/K) Σ_k Σ_l P_kl log softmax_l(⟨r^Y_k, r^Z_l⟩ / τ)   (Eq. 2)

with ⟨·,·⟩ the cosine similarity, P_kl = 1[image_k = image_l] / Σ_l' 1[image_k = image_l'] (the captions of one
image in a batch are all positives, the official code's multi-positive targets; Eq. 2's diagonal when images are
unique), and τ a learnable scalar initialised at 0.07 and clamped to [0.001, 0.5] before each use (logits = cos/τ).
`cl_reduction="paper"` uses Eq. 3 as printed, (1/2K) Σ_k ‖r^E_k − r^F_k‖², instead (spec §9 A1). r^F and r^E
are unnormalised; L_cm normalises inside. L_cm runs over the global batch (all processes), L_cl per process.

Data: each task's rows need the English captions of the image in `parallel_text_column` (default `texts_en`);
`collator_options` asks `CLIPCollator` to tokenize one of them with the original tokenizer (see `CLIPCollator` for
how it is paired with the task-language caption). A task without that column is taken as English (x^E = x^F, its
own captions; an error with `require_parallel=True`). Teacher features are cached per task by image hash and English
caption hash (the teacher never changes, so each is computed once per task).

Method order: put `cllclip` first in the method list, before vocabulary growth (`grow_vocab`) and any method that
adds modules, so that its first-task snapshot is the original CLIP with the original tokenizer; put `teir` last.

Resuming: `state_dict` holds τ, the original tokenizer's files (bytes) and the teacher: its config, a digest of
every tensor, and only what differs from the model being trained at save time: the rows of the token embedding
that training changed (or the whole tensor when more than half its rows differ). Everything else is bit-identical
to the model's (it never trains), so `load_state_dict` and the next use rebuild the teacher exactly from the
restored model, and refuse (naming the tensor) if any rebuilt tensor does not match its digest.
`save_full_teacher=True` stores every teacher tensor instead.

Deviations from the paper and its code (spec §9): teacher features are computed by a cached forward pass during the
first epoch instead of offline; τ is trained by the task's optimizer in its own group without weight decay but is
not included in gradient clipping; the student's text features are computed by a second text forward (the model's
outputs carry normalised embeddings only).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.collate import PARALLEL_PAIRINGS
from ..data.streaming import column_names
from ..distributed import all_gather_no_grad, all_gather_with_grad
from ..losses import clip_contrastive_loss
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .regularization import token_embedding_name
from .teacher import FrozenTeacher

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

logger = logging.getLogger(__name__)

CL_REDUCTIONS = ("mean", "paper")


# ----- pure loss functions ----------------------------------------------------------------------------------------
def cross_lingual_loss(student: torch.Tensor, teacher: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """L_cl (Eq. 3) between unnormalised features [K, D]: "mean" = (1/(K·D)) Σ_k ‖r^E_k − r^F_k‖² (the official
    code's `nn.MSELoss`), "paper" = (1/2K) Σ_k ‖r^E_k − r^F_k‖² (Eq. 3 as printed)."""
    diff = student.float() - teacher.detach().float()
    if reduction == "mean":
        return diff.pow(2).mean()
    if reduction == "paper":
        return diff.pow(2).sum() / (2.0 * diff.shape[0])
    raise ValueError(f"cl_reduction must be one of {list(CL_REDUCTIONS)}, got {reduction!r}")


def cross_modal_loss(
    texts: torch.Tensor, images: torch.Tensor, image_ids: torch.Tensor, temperature: torch.Tensor | float
) -> torch.Tensor:
    """L_cm (Eq. 2): the symmetric multi-positive InfoNCE between student text features and teacher image features
    ([K, D] each, normalised here), logits = cos / τ, positives = pairs of the same image (`image_ids`, [K])."""
    texts = F.normalize(texts.float(), dim=-1)
    images = F.normalize(images.detach().float(), dim=-1)
    logits = images @ texts.t() / temperature  # image rows, text columns
    positives = image_ids[:, None] == image_ids[None, :]
    return clip_contrastive_loss(logits, positives)


# ----- configuration ----------------------------------------------------------------------------------------------
@dataclass
class CLLCLIPConfig(MethodConfig):
    cross_modal_weight: float = field(
        default=0.01, metadata={"help": "γ1, the weight of the cross-modal loss L_cm (Eq. 4); the paper: 0.01."}
    )
    cross_lingual_weight: float = field(
        default=1.0, metadata={"help": "γ2, the weight of the cross-lingual loss L_cl (Eq. 4); the paper: 1."}
    )
    temperature: float = field(default=0.07, metadata={"help": "Initial τ of L_cm (OpenCLIP's 0.07)."})
    learnable_temperature: bool = field(
        default=True, metadata={"help": "Train τ (the official code); False keeps it fixed at `temperature`."}
    )
    temperature_min: float = field(default=0.001, metadata={"help": "τ is clamped to [min, max] before each use."})
    temperature_max: float = field(default=0.5, metadata={"help": "τ is clamped to [min, max] before each use."})
    cl_reduction: str = field(
        default="mean",
        metadata={
            "help": "L_cl scale: 'mean' = elementwise mean over K×D (the code; keeps γ1=0.01, γ2=1 meaningful), "
            "'paper' = (1/2K) Σ ‖r^E − r^F‖² (Eq. 3 as printed)."
        },
    )
    parallel_text_column: str = field(
        default="texts_en", metadata={"help": "Column with the image's English captions (the teacher's x^E)."}
    )
    parallel_pairing: str = field(
        default="auto",
        metadata={
            "help": "How x^E is paired with the chosen x^F (CLIPCollator): 'index' (sentence-parallel lists), "
            "'random' (a seeded English caption of the same image), 'auto' (index when the lists have equal length)."
        },
    )
    require_parallel: bool = field(
        default=False,
        metadata={
            "help": "A task without `parallel_text_column` is an error; False: it is taken as an English task and the "
            "teacher reads its own captions (x^E = x^F, the paper's English task), with a warning."
        },
    )
    teacher_cache: bool = field(
        default=True,
        metadata={"help": "Cache the teacher's features per image and English caption for the task (exact)."},
    )
    save_full_teacher: bool = field(
        default=False,
        metadata={
            "help": "Store every teacher tensor in the method state; False: only those that differ from the model "
            "(the token embedding) plus digests of the rest, rebuilt exactly on resume."
        },
    )

    def __post_init__(self) -> None:
        if self.cl_reduction not in CL_REDUCTIONS:
            raise ValueError(f"cl_reduction must be one of {list(CL_REDUCTIONS)}, got {self.cl_reduction!r}")
        if self.parallel_pairing not in PARALLEL_PAIRINGS:
            raise ValueError(f"parallel_pairing must be one of {list(PARALLEL_PAIRINGS)}, got {self.parallel_pairing!r}")
        if not 0 < self.temperature_min <= self.temperature <= self.temperature_max:
            raise ValueError("need 0 < temperature_min <= temperature <= temperature_max")
        if self.cross_modal_weight < 0 or self.cross_lingual_weight < 0:
            raise ValueError("loss weights must be >= 0")


# ----- the teacher ------------------------------------------------------------------------------------------------
class CLLTeacher:
    """The frozen original CLIP: unnormalised image features r^I and English text features r^E, cached per task by
    image hash and English-caption hash (the features depend only on the image or the caption string)."""

    def __init__(self, model: ContinualDualEncoder, cache: bool = True):
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        self.cache = cache
        self._image_cache: dict[int, torch.Tensor] = {}
        self._text_cache: dict[int, torch.Tensor] = {}
        self.encoded_images = 0
        self.encoded_texts = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> CLLTeacher:
        if self.device != torch.device(device):
            self.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) types PreTrainedModel.to unbound
            self.clear_cache()
        return self

    def clear_cache(self) -> None:
        self._image_cache.clear()
        self._text_cache.clear()

    @torch.no_grad()
    def features(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """r^I [B, D] of `pixel_values` and r^E [B, D] of `parallel_input_ids`, unnormalised, without gradients."""
        device = self.device
        ids, mask = inputs["parallel_input_ids"], inputs.get("parallel_attention_mask")
        if self.cache and "image_hash" in inputs and "parallel_text_hash" in inputs:
            images = FrozenTeacher._cached(
                inputs["image_hash"], self._image_cache,
                lambda rows: self._images(self.model.image_inputs(inputs, rows, self.device))
            )
            texts = FrozenTeacher._cached(
                inputs["parallel_text_hash"], self._text_cache,
                lambda rows: self._texts(ids[rows.to(ids.device)], None if mask is None else mask[rows.to(mask.device)]),
            )
            return images.to(device), texts.to(device)
        return self._images(self.model.image_inputs(inputs, device=self.device)), self._texts(ids, mask)

    def _images(self, image_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.encoded_images += image_inputs["pixel_values"].shape[0]
        return self.model.embed_images(**image_inputs, normalize=False)

    def _texts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        self.encoded_texts += input_ids.shape[0]
        mask = None if attention_mask is None else attention_mask.to(self.device)
        return self.model.embed_texts(input_ids.to(self.device), mask, normalize=False)

    def parameters(self):  # noqa: ANN201 - mirrors nn.Module for tests
        return self.model.parameters()


def tensor_digest(tensor: torch.Tensor) -> str:
    """A blake2b digest of a tensor's dtype, shape and bytes (equal iff bit-identical, up to hash collisions)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.blake2b(f"{flat.dtype}|{tuple(tensor.shape)}|".encode(), digest_size=16)
    digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def plain_clip_copy(
    state: dict[str, torch.Tensor], config: dict[str, Any], model_class: type[ContinualDualEncoder] | None = None
) -> ContinualDualEncoder:
    """A model of `model_class` (default `ContinualCLIPModel`; any family) built from `config` holding exactly
    `state` (cloned, dtypes and devices kept)."""
    from ..modeling import ContinualCLIPModel

    model_class = model_class or ContinualCLIPModel
    config_class = model_class.config_class
    if config_class is None:
        raise TypeError(f"{model_class.__name__} names no config_class")
    copy = model_class(config_class.from_dict(dict(config)))
    expected = set(copy.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            "cllclip: the teacher must be a plain CLIP, but the model's tensors do not match one (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}). Put cllclip first in the method list, before methods that "
            "add modules."
        )
    copy.load_state_dict({name: value.detach().clone() for name, value in state.items()}, assign=True)
    devices = {value.device for value in state.values()}
    if len(devices) == 1:
        # the buffers that the state does not hold (position_ids) follow the weights
        copy.to(devices.pop())  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) types PreTrainedModel.to unbound
    return copy


# ----- the method -------------------------------------------------------------------------------------------------
@register_method
class CLLCLIP(ContinualMethod[CLLCLIPConfig]):
    """CLL-CLIP: token embeddings only, distilled from the frozen initial CLIP (module docstring, Eqs. 2–4)."""

    fsdp_refusal = ("it trains parameters of its own beside the model's (optimizer_parameters), which accelerate cannot "
                    "map to sharded ones, and masks the token embedding's gradient, which FSDP2 holds as a shard")
    name = "cllclip"
    test_families = ("siglip2",)
    config_class = CLLCLIPConfig
    roles = {"previous_model": "trains the token embeddings of the CLIP it starts from, distilled from it"}
    runs_before = {
        "vocabulary": "snapshots the original CLIP and tokenizer as its teacher at the first task start",
        "parameter_efficient": "freezes everything but the token embedding at task start, which would freeze the "
        "parameters of a parameter-efficient method placed before it",
    }
    config: CLLCLIPConfig
    replaces_contrastive_loss = True

    def __init__(self, config: CLLCLIPConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.temperature = nn.Parameter(
            torch.tensor(float(self.config.temperature)), requires_grad=self.config.learnable_temperature
        )
        self.teacher: CLLTeacher | None = None
        self.tokenizer: Any = None  # the original tokenizer (the teacher's)
        self._teacher_config: dict[str, Any] | None = None
        self._teacher_digests: dict[str, str] = {}
        self._pending: dict[str, Any] | None = None  # a loaded teacher state, rebuilt at its next use
        #: The original tokenizer's files, captured once (at the snapshot, or as loaded): saving never re-serialises
        #: the live tokenizer, whose saved config changes as it is used (a processor saved with it).
        self._tokenizer_files: dict[str, torch.Tensor] | None = None
        self._context: TaskContext | None = None
        self._column = self.config.parallel_text_column  # this task's English column

    # ----- task hooks -------------------------------------------------------------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        self._context = context
        model = context.model
        if self.teacher is None and self._pending is None:
            self._snapshot(context)
        self._ensure_teacher(model)
        column = self.config.parallel_text_column
        columns = column_names(context.task.train)
        self._column = column
        if columns and column not in columns:
            if self.config.require_parallel:
                raise ValueError(
                    f"cllclip: task {context.task_index} ({context.task.name!r}) has no {column!r} column (the "
                    f"English captions the teacher reads); it has {columns}"
                )
            logger.warning(
                "cllclip: task %d (%r) has no %r column: treated as an English task, the teacher reads the task's "
                "own captions (x^E = x^F)", context.task_index, context.task.name, column,
            )
            self._column = "texts"
        freeze_all_but_token_embedding(model)
        return None

    def collator_options(self, context: TaskContext) -> dict[str, Any]:
        """The English captions, tokenized with the original tokenizer, for the teacher's r^E."""
        if self.tokenizer is None:
            raise RuntimeError("cllclip: no original tokenizer (on_task_start was not called)")
        return {
            "parallel_text_column": self._column,
            "parallel_tokenizer": self.tokenizer,
            "parallel_pairing": self.config.parallel_pairing,
        }

    def optimizer_parameters(self) -> list[nn.Parameter]:
        return [self.temperature] if self.config.learnable_temperature else []

    def on_task_end(self, context: TaskContext) -> None:
        self._context = context
        if self.teacher is not None:
            self.teacher.clear_cache()

    # ----- loss -------------------------------------------------------------------------------------------------
    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        """`cross_modal` = γ1·L_cm (Eq. 2) and `cross_lingual` = γ2·L_cl (Eq. 3), already weighted (Eq. 4)."""
        if "parallel_input_ids" not in inputs:
            raise ValueError("cllclip needs parallel_input_ids in the batch (CLIPCollator with parallel_text_column)")
        teacher = self._ensure_teacher(model)
        device = inputs["input_ids"].device
        teacher.to(device)
        student = outputs.text_features  # r^F: the model's projected text features, before normalisation
        if student is None:
            raise ValueError("cllclip needs the model's text features in its output (a ContinualCLIPModel)")
        images, english = teacher.features(inputs)  # r^I, r^E
        tau = self.current_temperature(device)
        cl = cross_lingual_loss(student, english, self.config.cl_reduction)
        cm = cross_modal_loss(
            all_gather_with_grad(student.float()),
            all_gather_no_grad(images.float()),
            all_gather_no_grad(inputs["image_hash"].to(device)),
            tau,
        )
        return {"cross_modal": self.config.cross_modal_weight * cm, "cross_lingual": self.config.cross_lingual_weight * cl}

    def current_temperature(self, device: torch.device | None = None) -> torch.Tensor:
        """τ, clamped in place to [temperature_min, temperature_max] (spec §9 A3), on `device`."""
        with torch.no_grad():
            self.temperature.clamp_(self.config.temperature_min, self.config.temperature_max)
        if device is not None and self.temperature.device != device:
            if self.config.learnable_temperature:
                self.temperature.data = self.temperature.data.to(device)
            else:
                return self.temperature.to(device)
        return self.temperature

    def metrics(self) -> dict[str, torch.Tensor]:
        """The learned temperature, as a device tensor (no host sync per step)."""
        return {"temperature": self.temperature.detach()}

    # ----- the teacher ------------------------------------------------------------------------------------------
    def _snapshot(self, context: TaskContext) -> None:
        """Freeze a copy of the initial model and keep the tokenizer it reads (first task start of a run)."""
        if context.new_token_ids:
            raise ValueError(
                "cllclip must come before vocabulary growth in the method list: at the first task start it keeps the "
                "original CLIP and tokenizer as the teacher, but the vocabulary has already grown"
            )
        tokenizer = context.tokenizer
        if tokenizer is None:
            raise ValueError("cllclip needs context.tokenizer (the original tokenizer) at the first task")
        model = context.model
        self._teacher_config = model.config.to_dict()
        teacher_model = plain_clip_copy(model.state_dict(), self._teacher_config, type(model))
        self._teacher_digests = {name: tensor_digest(value) for name, value in teacher_model.state_dict().items()}
        self.teacher = CLLTeacher(teacher_model, cache=self.config.teacher_cache)
        self.tokenizer = tokenizer
        self._tokenizer_files = tokenizer_files(tokenizer)

    def _ensure_teacher(self, model: ContinualDualEncoder) -> CLLTeacher:
        """The teacher, rebuilt from a loaded state (and `model`'s tensors, digest-checked) if needed."""
        if self._pending is not None:
            self._rebuild(model, self._pending)
            self._pending = None
        if self.teacher is None:
            raise RuntimeError("cllclip: no teacher (on_task_start was not called)")
        return self.teacher

    def _rebuild(self, model: ContinualDualEncoder, state: dict[str, Any]) -> None:
        config, digests = dict(state["config"]), dict(state.get("digests", {}))
        stored, rows = dict(state.get("tensors", {})), dict(state.get("rows", {}))
        live = model.state_dict()
        device = next(model.parameters()).device
        tensors: dict[str, torch.Tensor] = {}
        for name, digest in digests.items():
            value = stored.get(name)
            if value is None:
                value = live.get(name)
                if value is not None and name in rows:  # the live rows, with the teacher's where they differ
                    value = value[: int(rows[name]["num_rows"])].clone()
                    index = torch.as_tensor(rows[name]["index"]).to(value.device)
                    value[index] = torch.as_tensor(rows[name]["values"]).to(value)
                if value is None or tensor_digest(value) != digest:
                    raise ValueError(
                        f"cllclip: cannot rebuild the teacher: the model's {name!r} is not the teacher's (missing or "
                        "changed since the state was saved). Resume from the checkpoint the state belongs to, or "
                        "save with save_full_teacher=True."
                    )
            tensors[name] = value.to(device)
        teacher_model = plain_clip_copy(tensors, config, type(model))
        self._teacher_config, self._teacher_digests = config, digests
        self.teacher = CLLTeacher(teacher_model, cache=self.config.teacher_cache)

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """τ, the original tokenizer's files and the teacher (see the module docstring, "Resuming")."""
        state: dict[str, Any] = {"temperature": self.temperature.detach().clone()}
        if self._pending is not None:
            state.update(teacher=self._pending, tokenizer=self._tokenizer_files)
            return state
        if self.teacher is None:
            return state
        state["tokenizer"] = self._tokenizer_files
        live = {} if self._context is None or self.config.save_full_teacher else self._context.model.state_dict()
        stored, rows = {}, {}
        for name, value in self.teacher.model.state_dict().items():
            other = live.get(name)
            if (
                other is not None and other.shape == value.shape and other.dtype == value.dtype
                and torch.equal(other.to(value.device), value)
            ):
                continue  # rebuilt from the model (digest-checked)
            delta = _row_delta(value, other)
            if delta is None:
                stored[name] = value
            else:  # changed rows, or a grown tensor
                rows[name] = delta
        state["teacher"] = {
            "config": self._teacher_config, "tensors": stored, "rows": rows, "digests": dict(self._teacher_digests)
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():  # in place: the optimizer (and its resumed state) holds this very tensor
            self.temperature.copy_(torch.as_tensor(state["temperature"]).to(self.temperature))
        teacher = state.get("teacher")
        if teacher is None:
            return
        self._pending = teacher
        self._tokenizer_files = state["tokenizer"]
        self.tokenizer = tokenizer_from_files(state["tokenizer"])
        self.teacher = None


def _row_delta(teacher: torch.Tensor, live: torch.Tensor | None) -> dict[str, Any] | None:
    """How `teacher` differs from the first rows of `live` (same dtype and trailing shape, at least as many rows):
    `{"num_rows", "index", "values"}` with the differing rows (none when equal), or None when they are not
    comparable or more than half the rows differ (the teacher's tensor is then stored whole)."""
    if (
        live is None or live.dtype != teacher.dtype or live.dim() != teacher.dim() or teacher.dim() == 0
        or live.shape[1:] != teacher.shape[1:] or live.shape[0] < teacher.shape[0]
    ):
        return None
    head = live[: teacher.shape[0]].to(teacher.device)
    differs = (head != teacher).reshape(teacher.shape[0], -1).any(dim=1)
    index = differs.nonzero().squeeze(1)
    if len(index) * 2 > teacher.shape[0]:
        return None
    return {"num_rows": int(teacher.shape[0]), "index": index.cpu(), "values": teacher[index].detach().cpu()}


def freeze_all_but_token_embedding(model: ContinualDualEncoder) -> None:
    """`requires_grad=False` on every parameter except the text token embedding θ_t (spec §2.1)."""
    name = token_embedding_name(model)
    if name is None:
        raise ValueError("cllclip: the model has no token embedding to train")
    model.requires_grad_(False)
    model.get_input_embeddings().weight.requires_grad_(True)


def tokenizer_files(tokenizer: Any) -> dict[str, torch.Tensor]:
    """The files of `tokenizer.save_pretrained`, each as a uint8 tensor (saved with the method state)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {
            path.name: torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).clone()
            for path in sorted(Path(folder).iterdir())
            if path.is_file() and path.stat().st_size > 0
        }


def tokenizer_from_files(files: dict[str, Any]) -> Any:
    """The tokenizer saved by `tokenizer_files` (`AutoTokenizer.from_pretrained` on the written files)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(torch.as_tensor(data, dtype=torch.uint8).numpy().tobytes())
        return AutoTokenizer.from_pretrained(folder)
