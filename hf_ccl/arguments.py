"""The arguments of a continual run, by concern: the loop's own (`ContinualArguments`) and one section per built-in
part that reads options (`EvaluationArguments`, `HubArguments`, `CardArguments`, `DiagnosticsArguments`,
`PairArguments`).

In YAML a section is a mapping (`hub: {model_id: me/run, timeout: 30}`), on the command line a dotted override
(`hub.model_id=me/run`); from Python a section dataclass or a plain dict (`hub={"model_id": "me/run"}`). Each
dataclass checks its own values (type, range, consistency) in `__post_init__`; what needs the stream, the methods or
the model is checked once, in `hf_ccl.checks`. This module imports no torch, transformers or datasets: `hf-ccl train
--help` lists every field from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from .training_defaults import NO_WARMUP_SCHEDULES, default_training, with_training_defaults  # noqa: F401 (re-exported)
from .validation import ConfigError, check_choice, check_dataclass, check_no_tokens, check_range

WARMUP_RULES = ("every_task", "first_task")
CLASSIFICATION_LOSSES = ("contrastive", "cross_entropy")
CLASS_SCOPES = ("task", "seen", "all")


# ----- sections ------------------------------------------------------------------------------------------------
@dataclass
class EvaluationArguments:
    """How the stream is evaluated (the results matrix; `hf_ccl.evaluation.schedule`)."""

    SECTION: ClassVar[str] = "evaluation"

    batch_size: int = field(default=256, metadata={"help": "Batch size for embedding eval images and texts."})
    initial: bool = field(default=True, metadata={"help": "Evaluate the model before the first task."})
    every: int = field(
        default=1,
        metadata={"help": "Evaluate after every k-th task (tasks k, 2k, ...) and always after the last one; the rows "
                  "in between are marked not evaluated in the results and the derived metrics that need them are "
                  "null. 1: after every task."},
    )
    max_examples: int | None = field(
        default=None,
        metadata={"help": "Score each task on a fixed seeded subsample of at most this many rows of its eval split "
                  "(the same rows in every row of the matrix; recorded in results.json and results.md); None: all "
                  "rows."},
    )
    cache: bool = field(
        default=True,
        metadata={"help": "Reuse a task's eval embeddings while nothing that produced them changed (a frozen tower, "
                  "the same tokenizer, processor and rows; checked by identity and weight contents, "
                  "hf_ccl.evaluation.cache); false: recompute them at every evaluation."},
    )

    def __post_init__(self) -> None:
        check_dataclass(self, "evaluation.")
        check_range("evaluation.batch_size", self.batch_size, 1)
        check_range("evaluation.every", self.every, 1)
        check_range("evaluation.max_examples", self.max_examples, 1, also="or null")


@dataclass
class HubArguments:
    """Where and how every task checkpoint is pushed to the Hub (`hf_ccl.hub.HubPushCallback`)."""

    SECTION: ClassVar[str] = "hub"

    model_id: str | None = field(
        default=None, metadata={"help": "Hub repository to push every task to (main + branch task-<k>); None: no push."}
    )
    private: bool = field(default=False, metadata={"help": "Create the Hub repository as private."})
    timeout: float = field(default=60.0, metadata={"help": "Seconds before any Hub request is abandoned."})
    retries: int = field(default=3, metadata={"help": "Retries (exponential backoff) of a failing Hub request."})
    backoff: float = field(default=1.0, metadata={"help": "First backoff delay in seconds (doubles)."})

    def __post_init__(self) -> None:
        check_dataclass(self, "hub.")
        check_range("hub.timeout", self.timeout, 0, low_open=True)
        check_range("hub.retries", self.retries, 0)
        check_range("hub.backoff", self.backoff, 0)
        if self.model_id is not None:
            from huggingface_hub.errors import HFValidationError
            from huggingface_hub.utils import validate_repo_id

            try:
                validate_repo_id(self.model_id)
            except HFValidationError as error:
                raise ConfigError(f"hub.model_id {self.model_id!r} is not a Hub repository id: {error}",
                                  "hub.model_id") from error


@dataclass
class CardArguments:
    """What the model card of every checkpoint says beyond the run itself (`hf_ccl.cards.ModelCardCallback`)."""

    SECTION: ClassVar[str] = "card"

    license: str | None = field(
        default=None,
        metadata={"help": "License of the trained model for its card's front matter (a Hub license id such as "
                  "apache-2.0, or 'other'); None: 'other', with the base model's and datasets' terms named."},
    )

    def __post_init__(self) -> None:
        check_dataclass(self, "card.")
        if self.license is not None and not self.license.strip():
            raise ConfigError("card.license must be a license id (e.g. apache-2.0, mit, other) or null", "card.license")


@dataclass
class DiagnosticsArguments:
    """Diagnostics measured during the run (`hf_ccl.evaluation.spatial_disorder.SpatialDisorderCallback`)."""

    SECTION: ClassVar[str] = "diagnostics"

    spatial_disorder_task: int | None = field(
        default=None,
        metadata={
            "help": "Mod-X's spatial-disorder diagnostics (paper 000, Sec. 3) after every task, against the initial "
            "model, on this task's eval split (e.g. 0, the old domain); None: off. Written to spatial_disorder.json "
            "(and .png with matplotlib) in the run folder and each checkpoint."
        },
    )

    def __post_init__(self) -> None:
        check_dataclass(self, "diagnostics.")
        check_range("diagnostics.spatial_disorder_task", self.spatial_disorder_task, 0, also="(a task index) or null")


@dataclass
class PairArguments:
    """How pair tasks (CMCL's setting) read their modalities (`hf_ccl.pair_features`)."""

    SECTION: ClassVar[str] = "pairs"

    image_modalities: list[str] = field(
        default_factory=lambda: ["image"],
        metadata={"help": "Pair streams: the modalities CLIP's vision tower encodes; every other modality is read by "
                  "its text tower, unless listed in precomputed_modalities."},
    )
    precomputed_modalities: list[str] = field(
        default_factory=list,
        metadata={"help": "Pair streams: modalities whose column already holds feature vectors (projection_dim "
                  "floats per row, e.g. audio embeddings computed offline)."},
    )

    def __post_init__(self) -> None:
        check_dataclass(self, "pairs.")
        for key in ("image_modalities", "precomputed_modalities"):
            if any(not name or "." in name for name in getattr(self, key)):
                raise ConfigError(f"pairs.{key} holds modality names (non-empty, no '.')", f"pairs.{key}")
        both = sorted(set(self.image_modalities) & set(self.precomputed_modalities))
        if both:
            raise ConfigError(f"modality(ies) {both} are in pairs.image_modalities and pairs.precomputed_modalities: "
                              "a modality is read by one encoder", "pairs.precomputed_modalities")


#: The sections of `ContinualArguments`, by field name.
SECTIONS: dict[str, type] = {cls.SECTION: cls for cls in (
    EvaluationArguments, HubArguments, CardArguments, DiagnosticsArguments, PairArguments)}

#: Keys of earlier versions, now in a section: refused with the new key (`check_renamed_keys`).
RENAMED_KEYS: dict[str, str] = {
    "eval_batch_size": "evaluation.batch_size",
    "evaluate_initial": "evaluation.initial",
    "eval_every": "evaluation.every",
    "eval_max_examples": "evaluation.max_examples",
    "eval_cache": "evaluation.cache",
    "hub_model_id": "hub.model_id",
    "hub_private_repo": "hub.private",
    "hub_timeout": "hub.timeout",
    "hub_retries": "hub.retries",
    "hub_retry_backoff": "hub.backoff",
    "card_license": "card.license",
    "spatial_disorder_task": "diagnostics.spatial_disorder_task",
    "image_modalities": "pairs.image_modalities",
    "precomputed_modalities": "pairs.precomputed_modalities",
}


def check_renamed_keys(keys: Any) -> None:
    """`ConfigError` for the first key of `keys` that an earlier version had at the top level: "hub_model_id is now
    hub.model_id"."""
    for key in keys:
        if key in RENAMED_KEYS:
            raise ConfigError(f"{key} is now {RENAMED_KEYS[key]}", key)


Section = TypeVar("Section")


def as_section(cls: type[Section], value: Any) -> Section:
    """A section from its dataclass, a mapping of its fields (`None`: the defaults), else a `ConfigError`."""
    name: str = cls.SECTION  # type: ignore[attr-defined]
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a mapping of {', '.join(section_fields(cls))}, got {value!r}", name)
    check_no_tokens(value, name)
    unknown = sorted(set(value) - set(section_fields(cls)))
    if unknown:
        raise ConfigError(f"Unknown {name} option(s) {unknown}; valid: {', '.join(section_fields(cls))}",
                          f"{name}.{unknown[0]}")
    return cls(**value)


def section_fields(cls: type) -> list[str]:
    """The init fields of a section dataclass."""
    return [item.name for item in dataclasses.fields(cls) if item.init]


# ----- the loop's own ------------------------------------------------------------------------------------------
@dataclass
class ContinualArguments:
    """How the stream is run; `training` holds `transformers.TrainingArguments` fields used for every task; the
    sections (`evaluation`, `hub`, `card`, `diagnostics`, `pairs`) the options of the parts that read them."""

    output_dir: str = field(metadata={"help": "Run folder; each task's checkpoint goes to <output_dir>/task-<k>/."})
    training: dict[str, Any] = field(
        default_factory=default_training,
        metadata={"help": "TrainingArguments fields for every task (epochs, batch size, lr, ...); what is given extends "
                  "hf_ccl's defaults (8 epochs, batch 64, lr 1e-3, weight decay 0.1, warmup 0.1 of the steps, cosine "
                  "schedule), the same from Python, YAML and the command line."},
    )
    first_task_epochs: float | None = field(
        default=None, metadata={"help": "Epochs for the first task (e.g. pretraining a random CLIP); None: as others."}
    )
    max_length: int | None = field(
        default=None, metadata={"help": "Token limit; None: the model's max_position_embeddings."}
    )
    seed: int = field(default=0, metadata={"help": "Base seed; task k trains with seed + k."})
    classification_loss: str = field(
        default="contrastive",
        metadata={"help": "How classification tasks train: 'contrastive': CLIP's loss on each image and one of its "
                  "label's training prompts; 'cross_entropy': each image's cross-entropy over the prompts of its "
                  "candidate classes (ZSCL Eq. 1, the ZSCL / MoE-Adapters fine-tuning loss; hf_ccl.class_prompts)."},
    )
    class_scope: str = field(
        default="task",
        metadata={"help": "The classes a classification task is scored among: 'task': its own (task-aware, MTIL); "
                  "'seen': every class of the tasks trained so far (task-agnostic, the class-incremental protocol; "
                  "the headline metric is then seen_accuracy, and the cross_entropy loss scores among them too); "
                  "'all': every class of every task of the stream, trained or not (X-TAIL, RAIL / LADA: no domain "
                  "identity; the headline metric is all_accuracy, the cross_entropy loss scores as in 'seen')."},
    )
    save_checkpoints: bool = field(default=True, metadata={"help": "Write output_dir/task-<k>/ after every task."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars for the stream and each task."})
    samples_per_task: int | None = field(
        default=None,
        metadata={
            "help": "Compute budget C: training examples seen per task (optimizer steps x global batch), the same for "
            "every task and strategy (TiC-CLIP); sets max_steps. None: epochs decide."
        },
    )
    warmup: str = field(
        default="every_task",
        metadata={
            "help": "'every_task': training.warmup_steps on every task; 'first_task': only on the first task (TiC-CLIP: "
            "warm-started tasks use none; from-scratch strategies keep it)."
        },
    )
    resume_from_checkpoint: bool | str | None = field(
        default=None,
        metadata={
            "help": "True: continue from the newest complete task checkpoint in output_dir, else from the newest "
            "task-<k> branch of hub.model_id (an error when there is none); 'auto': the same, but start afresh when "
            "there is none; a path: that task checkpoint folder (or run folder)."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a new run in an output_dir that holds another run: its task checkpoints, Trainer "
                  "checkpoints, results and compute files are removed first. Without it such a folder is refused."},
    )
    keep_trainer_checkpoints: bool = field(
        default=False,
        metadata={"help": "Keep output_dir/trainer/task-<k>/ (the mid-task Trainer checkpoints) after task k's "
                  "checkpoint is written; by default they are removed then."},
    )
    image_cache: bool | str = field(
        default=False,
        metadata={"help": "Decode, resize and crop every training image once and train from the stored uint8 pixels "
                  "(the same pixel values, far less CPU per step; hf_ccl.data.image_cache): true: in the datasets "
                  "cache (HF_DATASETS_CACHE/hf_ccl-image-cache), reused by later runs on the same data and "
                  "processor; a path: that folder; false: off."},
    )
    resume_allow_changes: list[str] = field(
        default_factory=list,
        metadata={"help": "Dotted keys (fnmatch patterns) of settings that may differ from the checkpoint resumed "
                  "from, e.g. [training.learning_rate]; each change is recorded in the next checkpoints."},
    )
    evaluation: EvaluationArguments = field(
        default_factory=EvaluationArguments, metadata={"help": EvaluationArguments.__doc__ or ""})
    hub: HubArguments = field(default_factory=HubArguments, metadata={"help": HubArguments.__doc__ or ""})
    card: CardArguments = field(default_factory=CardArguments, metadata={"help": CardArguments.__doc__ or ""})
    diagnostics: DiagnosticsArguments = field(
        default_factory=DiagnosticsArguments, metadata={"help": DiagnosticsArguments.__doc__ or ""})
    pairs: PairArguments = field(default_factory=PairArguments, metadata={"help": PairArguments.__doc__ or ""})

    def __post_init__(self) -> None:
        """Every value checked (type, range, consistency between the loop and its sections) before anything is
        built, trained or written; what needs the stream, methods or model is `hf_ccl.checks.check_run`'s."""
        check_no_tokens(self)
        for name, cls in SECTIONS.items():
            setattr(self, name, as_section(cls, getattr(self, name)))
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            self.resume_from_checkpoint = self.resume_from_checkpoint.lower() == "true"
        check_dataclass(self)
        self.training = validate_training_args(with_training_defaults(self.training))
        check_choice("warmup", self.warmup, WARMUP_RULES)
        check_choice("classification_loss", self.classification_loss, CLASSIFICATION_LOSSES)
        check_choice("class_scope", self.class_scope, CLASS_SCOPES)
        check_range("first_task_epochs", self.first_task_epochs, 0, low_open=True, also="or null")
        check_range("max_length", self.max_length, 2, also="(room for BOS and EOS) or null")
        check_range("seed", self.seed, 0, 2**32 - 1)
        check_range("samples_per_task", self.samples_per_task, 1, also="or null")
        if isinstance(self.image_cache, str):
            if self.image_cache.lower() in ("true", "false"):
                self.image_cache = self.image_cache.lower() == "true"
            elif not self.image_cache.strip() or Path(self.image_cache).expanduser().is_file():
                raise ConfigError(f"image_cache must be true, false or a folder to keep the cache in, got "
                                  f"{self.image_cache!r}", "image_cache")
        if self.training.get("push_to_hub") and not (self.hub.model_id or self.training.get("hub_model_id")):
            raise ConfigError("training.push_to_hub needs a repository: set hub.model_id (or training.hub_model_id)",
                              "training.push_to_hub")
        self._check_resume()
        self._check_budget()

    def _check_resume(self) -> None:
        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume != "auto" and not Path(resume).exists():
            raise ConfigError(f"resume_from_checkpoint: no such folder {resume!r}; give true, 'auto' or the path of a "
                              "task checkpoint (or run folder)")
        if self.overwrite_output_dir and self.resuming:
            raise ConfigError("overwrite_output_dir removes the run that resume_from_checkpoint would continue: set "
                              "one of them", "overwrite_output_dir")
        if self.resume_allow_changes and not self.resuming:
            raise ConfigError("resume_allow_changes applies to a resume: set resume_from_checkpoint too, or remove it",
                              "resume_allow_changes")

    def _check_budget(self) -> None:
        if self.samples_per_task is None:
            return
        if self.first_task_epochs is not None:
            raise ConfigError("samples_per_task fixes every task's compute: leave first_task_epochs unset")
        if "max_steps" in self.training:  # (num_train_epochs is simply overridden, as max_steps does in HF)
            raise ConfigError("samples_per_task sets each task's max_steps: remove training.max_steps")
        if self.training.get("dataloader_drop_last") is False:
            raise ConfigError("samples_per_task trains on whole global batches only (dataloader_drop_last is "
                              "set): remove training.dataloader_drop_last")

    @property
    def resuming(self) -> bool:
        """Whether the run continues an earlier one (`resume_from_checkpoint` set)."""
        return self.resume_from_checkpoint not in (None, False)


def validate_training_args(training: dict[str, Any]) -> dict[str, Any]:
    """The `training` section checked before any training starts (`hf_ccl.training_options`): unknown fields,
    fields the loop sets itself or does not use, types, ranges and mixed precision on this machine. Returns the
    values with lossless conversions applied (a number YAML read as a string)."""
    from .training_options import check_training_args, reporting_callbacks

    checked = check_training_args(training)
    try:
        reporting_callbacks(checked.get("report_to"))  # unknown or unusable integrations fail here
    except (ValueError, RuntimeError) as error:
        raise ConfigError(str(error), "training.report_to") from error
    return checked
