"""The per-task loop: a continual run is a sequence of ordinary Trainer runs, one per task.

For each task k of the stream:
1. the methods' `on_task_start` hooks (they may change the model),
2. the methods' `train_dataset` transforms (replay, joint),
3. training with a fresh optimizer and schedule (`ContinualTrainer`),
4. evaluation on the eval split of every task, seen and not yet seen (one row of the results matrix),
5. the methods' `on_task_end` hooks (so the saved state is the state the next task starts from),
6. a complete checkpoint in `output_dir/task-<k>/`: model, processor, method state, results so far, model card,
7. with `hub_model_id`, a push of that folder to the Hub (`main` and branch `task-<k>`, in the background).

`resume_from_checkpoint` continues a stopped run from its last complete task checkpoint (local, else the Hub's newest
`task-<k>` branch) with every method's state and the results so far; with Trainer checkpoints (`save_strategy`),
the interrupted task itself resumes from its last one. A finished task is never trained twice.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import (
    AutoTokenizer,
    CLIPProcessor,
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import load_sharded_checkpoint

from . import __version__
from .accumulation import REENCODE_PASSES
from .cards import write_model_card
from .checkpoint_files import CheckpointError, checkpoint_is_complete, verify_checkpoint, write_manifest
from .compute import TaskCompute, forward_macs_per_sample, load_compute, save_compute, task_compute
from .data.collate import CLIPCollator
from .data.streaming import column_names, is_empty, is_streaming, whole_batches
from .data.task import CANONICAL_COLUMNS, TaskStream
from .distributed import barrier, broadcast_object, is_main_process, world_size
from .evaluation.evaluator import evaluate_task, iter_column
from .evaluation.matrix import ResultsMatrix
from .evaluation.spatial_disorder import (
    DisorderEmbeddings,
    SpatialDisorder,
    embed_for_disorder,
    plot_spatial_disorder,
    spatial_disorder,
)
from .evaluation.zeroshot import DEFAULT_TEMPLATES
from .hub import (
    HubPusher,
    PushReport,
    bounded_hub_timeouts,
    download_task_checkpoint,
    ensure_branch,
    task_branches,
)
from .methods.base import ContinualMethod, TaskContext
from .methods.registry import check_methods
from .methods.state import load_method_states, save_method_states
from .modeling import ContinualCLIPModel
from .resume_settings import UNCOMPARED_TRAINING, allowed, describe_diff, run_settings, settings_diff
from .run_folder import RunFolderLock, claim_run_folder
from .stream_logging import StreamLogger, reporting_callbacks
from .tokenization import resize_position_embeddings
from .trainer import MID_TASK_STATE, ContinualTrainer
from .training_options import check_training_args
from .validation import ConfigError, check_choice, check_dataclass, check_range

logger = logging.getLogger(__name__)

CHECKPOINT_STATE = "continual_state.json"
DISORDER_REFERENCE = "spatial_disorder_reference.safetensors"
#: Branch the Trainer's own pushes go to (`training.push_to_hub`): its latest checkpoint in `last-checkpoint/`.
TRAINING_BRANCH = "training"
WARMUP_RULES = ("every_task", "first_task")


@dataclass
class ContinualArguments:
    """How the stream is run; `training` holds `transformers.TrainingArguments` fields used for every task."""

    output_dir: str = field(metadata={"help": "Run folder; each task's checkpoint goes to <output_dir>/task-<k>/."})
    training: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TrainingArguments fields for every task (epochs, batch size, lr, ...)."}
    )
    first_task_epochs: float | None = field(
        default=None, metadata={"help": "Epochs for the first task (e.g. pretraining a random CLIP); None: as others."}
    )
    eval_batch_size: int = field(default=256, metadata={"help": "Batch size for embedding eval images and texts."})
    max_length: int | None = field(
        default=None, metadata={"help": "Token limit; None: the model's max_position_embeddings."}
    )
    seed: int = field(default=0, metadata={"help": "Base seed; task k trains with seed + k."})
    evaluate_initial: bool = field(default=True, metadata={"help": "Evaluate the model before the first task."})
    save_checkpoints: bool = field(default=True, metadata={"help": "Write output_dir/task-<k>/ after every task."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars for the stream and each task."})
    spatial_disorder_task: int | None = field(
        default=None,
        metadata={
            "help": "Mod-X's spatial-disorder diagnostics (paper 000, Sec. 3) after every task, against the initial "
            "model, on this task's eval split (e.g. 0, the old domain); None: off. Written to spatial_disorder.json "
            "(and .png with matplotlib) in the run folder and each checkpoint."
        },
    )

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
            "task-<k> branch of hub_model_id (an error when there is none); 'auto': the same, but start afresh when "
            "there is none; a path: that task checkpoint folder (or run folder)."
        },
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "Hub repository to push every task to (main + branch task-<k>); None: no push."}
    )
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the Hub repository as private."})
    hub_timeout: float = field(default=60.0, metadata={"help": "Seconds before any Hub request is abandoned."})
    hub_retries: int = field(default=3, metadata={"help": "Retries (exponential backoff) of a failing Hub request."})
    hub_retry_backoff: float = field(default=1.0, metadata={"help": "First backoff delay in seconds (doubles)."})
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
    card_license: str | None = field(
        default=None,
        metadata={"help": "License of the trained model for its card's front matter (a Hub license id such as "
                  "apache-2.0, or 'other'); None: 'other', with the base model's and datasets' terms named."},
    )
    resume_allow_changes: list[str] = field(
        default_factory=list,
        metadata={"help": "Dotted keys (fnmatch patterns) of settings that may differ from the checkpoint resumed "
                  "from, e.g. [training.learning_rate]; each change is recorded in the next checkpoints."},
    )

    def __post_init__(self) -> None:
        """Every value checked (type, range, consistency) before anything is built, trained or written."""
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            self.resume_from_checkpoint = self.resume_from_checkpoint.lower() == "true"
        check_dataclass(self)
        self.training = validate_training_args(self.training)
        check_choice("warmup", self.warmup, WARMUP_RULES)
        check_range("first_task_epochs", self.first_task_epochs, 0, low_open=True, also="or null")
        check_range("eval_batch_size", self.eval_batch_size, 1)
        check_range("max_length", self.max_length, 2, also="(room for BOS and EOS) or null")
        check_range("seed", self.seed, 0, 2**32 - 1)
        check_range("spatial_disorder_task", self.spatial_disorder_task, 0, also="(a task index) or null")
        check_range("samples_per_task", self.samples_per_task, 1, also="or null")
        check_range("hub_timeout", self.hub_timeout, 0, low_open=True)
        check_range("hub_retries", self.hub_retries, 0)
        check_range("hub_retry_backoff", self.hub_retry_backoff, 0)
        if self.card_license is not None and not self.card_license.strip():
            raise ConfigError("card_license must be a license id (e.g. apache-2.0, mit, other) or null", "card_license")
        if self.hub_model_id is not None:
            try:
                validate_repo_id(self.hub_model_id)
            except HFValidationError as error:
                raise ConfigError(f"hub_model_id {self.hub_model_id!r} is not a Hub repository id: {error}") from error
        if self.training.get("push_to_hub") and not (self.hub_model_id or self.training.get("hub_model_id")):
            raise ConfigError("training.push_to_hub needs a repository: set hub_model_id (or training.hub_model_id)",
                              "training.push_to_hub")
        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume != "auto" and not Path(resume).exists():
            raise ConfigError(f"resume_from_checkpoint: no such folder {resume!r}; give true, 'auto' or the path of a "
                              "task checkpoint (or run folder)")
        resuming = resume not in (None, False)
        if self.overwrite_output_dir and resuming:
            raise ConfigError("overwrite_output_dir removes the run that resume_from_checkpoint would continue: set "
                              "one of them", "overwrite_output_dir")
        if self.resume_allow_changes and not resuming:
            raise ConfigError("resume_allow_changes applies to a resume: set resume_from_checkpoint too, or remove it",
                              "resume_allow_changes")
        if self.samples_per_task is not None:
            if self.first_task_epochs is not None:
                raise ConfigError("samples_per_task fixes every task's compute: leave first_task_epochs unset")
            if "max_steps" in self.training:  # (num_train_epochs is simply overridden, as max_steps does in HF)
                raise ConfigError("samples_per_task sets each task's max_steps: remove training.max_steps")
            if self.training.get("dataloader_drop_last") is False:
                raise ConfigError("samples_per_task trains on whole global batches only (dataloader_drop_last is "
                                  "set): remove training.dataloader_drop_last")


def validate_training_args(training: dict[str, Any]) -> dict[str, Any]:
    """The `training` section checked before any training starts (`hf_ccl.training_options`): unknown fields,
    fields the loop sets itself or does not use, types, ranges and mixed precision on this machine. Returns the
    values with lossless conversions applied (a number YAML read as a string)."""
    checked = check_training_args(training)
    try:
        reporting_callbacks(checked.get("report_to"))  # unknown or unusable integrations fail here
    except (ValueError, RuntimeError) as error:
        raise ConfigError(str(error), "training.report_to") from error
    return checked


def validate_stream(stream: TaskStream, args: ContinualArguments | None = None) -> None:
    """Empty streams, empty tasks and non-canonical datasets fail here, before any training. A streaming train split
    (`datasets.IterableDataset`) is checked by its features or first row, never read whole; with `args`, a stream
    of such tasks needs a compute budget (a stream has no length, so no epochs)."""
    if len(stream) == 0:
        raise ValueError(f"Stream {stream.name!r} has no tasks")
    for index, task in enumerate(stream):
        for split_name, dataset in (("train", task.train), ("eval", task.eval)):
            where = f"Stream {stream.name!r}, task {index} ({task.name!r})"
            columns = column_names(dataset)  # a stream without known features: its first row's (none when empty)
            missing = [c for c in CANONICAL_COLUMNS if c not in columns]
            if missing and (columns or not is_streaming(dataset)):
                raise ValueError(
                    f"{where}, {split_name} split: missing column(s) {missing}; it has {columns}. Build tasks with "
                    "hf_ccl.data builders."
                )
            if is_empty(dataset):
                raise ValueError(f"{where}: the {split_name} split is empty")
        if args is not None and is_streaming(task.train):
            _check_streaming_budget(args.training, args.samples_per_task, args.first_task_epochs, index, task.name)


def _check_streaming_budget(
    training: dict[str, Any], samples_per_task: int | None, first_task_epochs: float | None, index: int, name: str
) -> None:
    """A streaming task trains for a fixed number of steps: `samples_per_task` or `training.max_steps` (and not the
    first task's epochs)."""
    if samples_per_task is not None:
        return
    if int(training.get("max_steps", -1)) > 0 and not (index == 0 and first_task_epochs is not None):
        return
    raise ValueError(
        f"Task {index} ({name!r}) trains on a stream (an IterableDataset has no length, so no epochs): streaming "
        "tasks need samples_per_task or training.max_steps (and no first_task_epochs)"
    )


class ContinualLearner:
    """Train one model on a stream of tasks, one after another, and keep the task-by-task results matrix.

    `callbacks` (transformers `TrainerCallback`s) are given to every task's Trainer.
    """

    def __init__(
        self,
        model: ContinualCLIPModel,
        stream: TaskStream,
        methods: list[ContinualMethod],
        image_processor: Any,
        tokenizer: PreTrainedTokenizerBase,
        args: ContinualArguments,
        callbacks: list[TrainerCallback] | None = None,
    ):
        validate_stream(stream, args)
        check_methods(methods, args.samples_per_task)
        PartialState()  # joins the process group now when launched distributed (the Trainer would, later)
        self.callbacks = list(callbacks or [])
        self.model = model
        self.stream = stream
        self.methods = methods
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.args = args
        self.output_dir = Path(args.output_dir)
        self.base_model = model.config._name_or_path or None  # what the run started from, for the model card
        self.model.align_special_tokens(tokenizer)
        self.results = ResultsMatrix(
            task_names=stream.task_names, headline_metrics=[task.headline_metric for task in stream]
        )
        if args.spatial_disorder_task is not None and not 0 <= args.spatial_disorder_task < len(stream):
            raise ValueError(f"spatial_disorder_task must index a task of the stream (0..{len(stream) - 1})")
        self.disorder: dict[str, SpatialDisorder] = {}
        self._disorder_reference: DisorderEmbeddings | None = None
        self.pusher: HubPusher | None = None
        self.push_report: PushReport | None = None
        self.compute: list[TaskCompute] = []  # samples seen and MACs per trained task
        self.global_step = 0  # optimizer steps over the stream so far: the step `training.report_to` logs at
        self.stream_logger: StreamLogger | None = None  # one logging run per fit()
        self.settings = run_settings(args, stream, methods)  # what a resume must match (before anything runs)
        self.resume_changes: list[dict[str, Any]] = []  # settings changed on purpose at a resume
        self._lock: RunFolderLock | None = None

    @property
    def max_length(self) -> int:
        limit = self.model.config.text_config.max_position_embeddings
        return min(self.args.max_length or limit, limit)

    # ----- the loop -----------------------------------------------------------------------------------------
    def claim_output_dir(self) -> None:
        """Lock output_dir for this run (main process) and refuse to start a new run over another run's files
        (`overwrite_output_dir` removes them). Done by `fit`; call it earlier to check before writing anything."""
        if self._lock is not None or not is_main_process():
            return
        lock = RunFolderLock(self.output_dir)
        lock.acquire()
        try:
            claim_run_folder(self.output_dir, resume=self.args.resume_from_checkpoint not in (None, False),
                             overwrite=self.args.overwrite_output_dir)
        except BaseException:
            lock.release()
            raise
        self._lock = lock

    def fit(self) -> ResultsMatrix:
        """Run the whole stream; returns the results matrix (also saved in every checkpoint)."""
        self.claim_output_dir()
        try:
            return self._fit()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _fit(self) -> ResultsMatrix:
        self.stream_logger = StreamLogger(self.args.training.get("report_to"), self.output_dir, self.callbacks)
        resumed = self._find_resume_checkpoint()
        if resumed is not None:
            first_task = self.restore(resumed) + 1
            last_checkpoint: Path | None = resumed
        else:
            first_task, last_checkpoint = 0, None
            if self.args.evaluate_initial:
                self.results.add_row("initial", self.evaluate())
                self.stream_logger.log_results(self.results, "initial", step=0)
            if self.args.spatial_disorder_task is not None and is_main_process():
                self._disorder_reference = self._embed_for_disorder()
        self.pusher = self._make_pusher()
        try:
            self._run_tasks(first_task, last_checkpoint)
            self._save_run_files()  # current even when a finished run was resumed
            self.stream_logger.end(self.global_step, model=self.model)
        finally:  # even when a task fails, the finished tasks' pushes complete (bounded by timeouts and retries)
            if self.pusher is not None:
                self.push_report = self.pusher.finish()
                if self.push_report.failed:
                    logger.warning("%d task revision(s) could not be pushed to %s (see push_report; `hf-ccl push` "
                                   "pushes a run's checkpoints again)", len(self.push_report.failed),
                                   self.args.hub_model_id)
        return self.results

    def _run_tasks(self, first_task: int, last_checkpoint: Path | None) -> None:
        bar = tqdm(total=len(self.stream), desc=f"stream {self.stream.name}", disable=not self.args.progress)
        bar.update(first_task)
        for index, task in enumerate(self.stream):
            if index < first_task:
                continue
            bar.set_postfix_str(task.name)
            context = TaskContext(
                task_index=index,
                task=task,
                stream=self.stream,
                model=self.model,
                output_dir=self.output_dir,
                seed=self.args.seed + index,
                tokenizer=self.tokenizer,
                image_processor=self.image_processor,
                max_length=self.max_length,
                eval_batch_size=self.args.eval_batch_size,
                samples_per_task=self.args.samples_per_task,
                base_training=dict(self.args.training),  # as configured, before budget and warmup rules
                run_settings=self.settings,  # stored in mid-task checkpoints, compared on resume
                last_checkpoint=str(last_checkpoint) if last_checkpoint else None,
            )
            self._start_task(context)
            self._train_task(context)
            for method in self.methods:
                self._take_changes(context, method.after_training(context), method, "after_training")
            self.results.add_row(task.name, self.evaluate())
            self.stream_logger.log_results(self.results, task.name, self.global_step, self.compute)
            if self._disorder_reference is not None:
                self._measure_disorder(task.name)
            for method in self.methods:
                method.on_task_end(context)
            if self.args.save_checkpoints or self.pusher is not None:
                last_checkpoint = self.save_checkpoint(index)
                if self.pusher is not None:
                    self.pusher.push(last_checkpoint, index)
                if not self.args.keep_trainer_checkpoints and is_main_process():
                    shutil.rmtree(self.output_dir / "trainer" / f"task-{index}", ignore_errors=True)
            bar.update(1)
        bar.close()

    # ----- Hub -------------------------------------------------------------------------------------------------
    def _make_pusher(self) -> HubPusher | None:
        """The background pusher of task checkpoints (main process only; None without `hub_model_id`)."""
        self.push_report: PushReport | None = None
        if self.args.hub_model_id is None or not is_main_process():
            return None
        return HubPusher(
            self.args.hub_model_id,
            private=self.args.hub_private_repo,
            timeout=self.args.hub_timeout,
            retries=self.args.hub_retries,
            backoff=self.args.hub_retry_backoff,
        )

    # ----- resume ----------------------------------------------------------------------------------------------
    def _find_resume_checkpoint(self) -> Path | None:
        """The task checkpoint folder to continue from, or None to start from the first task."""
        request = self.args.resume_from_checkpoint
        if request in (None, False):
            return None
        if isinstance(request, str) and request != "auto":
            path = Path(request)
            if (path / CHECKPOINT_STATE).exists():
                return path
            found = latest_task_checkpoint(path)
            if found is None:
                raise ValueError(f"resume_from_checkpoint={request!r}: no complete task checkpoint (a task-<k>/ folder "
                                 f"with {CHECKPOINT_STATE}) there")
            return found
        found = latest_task_checkpoint(self.output_dir)
        if found is None and self.args.hub_model_id is not None:
            found = self._download_latest_from_hub()
        if found is None and request is True and broadcast_object(
                newest_complete_trainer_checkpoint(self.output_dir / "trainer" / "task-0") if is_main_process() else None):
            logger.info("No task checkpoint yet in %s: task 0 resumes from its Trainer checkpoint", self.output_dir)
            return None
        if found is None and request is True:
            where = str(self.output_dir) + (f" or on the Hub at {self.args.hub_model_id}" if self.args.hub_model_id
                                            else "")
            raise ValueError(f"resume_from_checkpoint=True but there is no complete task checkpoint in {where}; use "
                             "'auto' to start afresh when there is none")
        return found

    def _download_latest_from_hub(self) -> Path | None:
        """Fetch the newest `task-<k>` revision of `hub_model_id` into output_dir (main process; others wait)."""
        repo = self.args.hub_model_id
        bounded_hub_timeouts(self.args.hub_timeout)  # the download gets bounded timeouts too
        branches = task_branches(repo)
        if not branches:
            return None
        index = max(branches)
        folder = self.output_dir / f"task-{index}"
        if is_main_process():
            logger.info("Resuming from %s revision task-%d", repo, index)
            download_task_checkpoint(repo, index, folder)
        barrier()
        if not (folder / CHECKPOINT_STATE).exists():
            raise ValueError(f"Revision task-{index} of {repo} has no {CHECKPOINT_STATE}: not an hf_ccl task checkpoint")
        return folder  # verified by `restore`, like a local one

    def restore(self, folder: str | Path) -> int:
        """Load a task checkpoint written by `save_checkpoint`: model weights, tokenizer (if it grew), every method's
        state, the results so far. Returns the index of the task it was written after. Every problem is an error
        naming the file, never a silent fresh start."""
        folder = Path(folder)
        try:
            verify_checkpoint(folder)
        except CheckpointError as error:
            raise CheckpointError(f"{error}. Remove {folder} to resume from the task before it, or restore the "
                                  "file") from error
        state = _read_json(folder / CHECKPOINT_STATE)
        index = int(state["task_index"])
        names = self.stream.task_names
        if state.get("task_names") != names:
            raise ValueError(f"{folder / CHECKPOINT_STATE} was written for tasks {state.get('task_names')}, but this "
                             f"stream has {names}: resume with the same stream")
        methods = [method.name for method in self.methods]
        if state.get("methods") != methods:
            raise ValueError(f"{folder / CHECKPOINT_STATE} was written with methods {state.get('methods')}, but this "
                             f"run has {methods}: resume with the same methods")
        self._check_settings(state, folder / CHECKPOINT_STATE, index)
        tokenizer_file = folder / "tokenizer_config.json"
        if tokenizer_file.exists():
            saved = AutoTokenizer.from_pretrained(str(folder))
            if len(saved) != len(self.tokenizer):
                self.tokenizer = saved
        load_model_weights(self.model, folder)
        self.model.align_special_tokens(self.tokenizer)
        load_method_states(self.methods, folder)
        try:
            self.results = ResultsMatrix.load(folder)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"Cannot read the results matrix in {folder}: {error}") from error
        self.compute = load_compute(folder)
        # (checkpoints written before `global_step` was stored: the compute records hold every task's steps)
        self.global_step = int(state.get("global_step", sum(record.optimizer_steps for record in self.compute)))
        trained = [row.label for row in self.results.rows if row.label != "initial"]
        if len(trained) != index + 1:
            raise ValueError(f"{folder} holds {len(trained)} trained rows in results.json, expected {index + 1}")
        disorder = folder / DISORDER_REFERENCE
        if self.args.spatial_disorder_task is not None and disorder.exists():
            tensors = _load_safetensors(disorder)
            self._disorder_reference = DisorderEmbeddings(tensors["images"], tensors["texts"], tensors["correct"])
            saved = _read_json(folder / "spatial_disorder.json") if (folder / "spatial_disorder.json").exists() else {}
            self.disorder = {label: SpatialDisorder.from_dict(value) for label, value in saved.items()}
        logger.info("Resumed after task %d (%s) from %s", index, state.get("task_name"), folder)
        return index

    def _start_task(self, context: TaskContext) -> None:
        """Task-start hooks. A hook may assign `context.model` and call `context.replace_tokenizer` (a vocabulary
        grown for a new language): the run then trains, evaluates and saves with what the context holds."""
        for method in self.methods:
            self._take_changes(context, method.on_task_start(context), method, "on_task_start")

    def _take_changes(self, context: TaskContext, returned: Any, method: ContinualMethod, hook: str) -> None:
        """Adopt the model, tokenizer and token limit a hook left in `context`. A model returned by the hook (the
        interface before `context.model` was assignable) is taken too, with a deprecation warning."""
        if returned is not None:
            warnings.warn(f"{type(method).__name__}.{hook} returned a model: assign context.model instead (returning "
                          "one is deprecated)", FutureWarning, stacklevel=2)
            context.model = returned
        self.model = context.model
        if context.tokenizer is not self.tokenizer:
            self.tokenizer = context.tokenizer
            self.model.align_special_tokens(self.tokenizer)

    def _train_dataset(self, context: TaskContext, training_args: TrainingArguments):  # noqa: ANN202 (datasets.Dataset)
        dataset = context.task.train
        for method in self.methods:
            dataset = method.train_dataset(context, dataset)
        if is_streaming(dataset):
            dataset = self._streaming_train_dataset(context, dataset, training_args)
        if is_empty(dataset):  # a stream (IterableDataset) is read up to its first row (or first whole batch)
            raise ValueError(f"Task {context.task_index} ({context.task.name!r}) has no training examples" + (
                " (a stream must hold at least one whole global batch)" if is_streaming(dataset) else ""))
        if self.args.samples_per_task is not None and not is_streaming(dataset):
            batch = global_batch_size(training_args.to_dict())
            if len(dataset) < batch:
                raise ValueError(
                    f"Task {context.task_index} ({context.task.name!r}) trains on {len(dataset)} examples, fewer than one "
                    f"global batch ({batch}): with a compute budget every step needs a whole batch, so it could not "
                    "train at all. Use a smaller per_device_train_batch_size or give the task more data."
                )
        return dataset

    def _streaming_train_dataset(self, context: TaskContext, dataset: Any, args: TrainingArguments) -> Any:
        """A stream trains for `max_steps`; with `dataloader_drop_last` (set by the budget) each pass keeps only
        whole global batches, which the Trainer does not do for an IterableDataset, so samples seen = the budget."""
        if args.max_steps <= 0:
            raise ValueError(
                f"Task {context.task_index} ({context.task.name!r}) trains on a stream (an IterableDataset has no "
                "length, so no epochs): streaming tasks need samples_per_task or training.max_steps"
            )
        return whole_batches(dataset, global_batch_size(args.to_dict())) if args.dataloader_drop_last else dataset

    def _training_arguments(self, context: TaskContext) -> TrainingArguments:
        values: dict[str, Any] = {
            "report_to": [],
            "save_strategy": "no",
            "logging_steps": 10,
            "ddp_find_unused_parameters": False,
            "dataloader_num_workers": 0,
            "dataloader_pin_memory": torch.cuda.is_available(),
            **self.args.training,
        }
        if context.task_index == 0 and self.args.first_task_epochs is not None:
            values["num_train_epochs"] = self.args.first_task_epochs
            values.pop("max_steps", None)
        if self.args.samples_per_task is not None:
            values["max_steps"] = self._budget_steps(values)
            values["dataloader_drop_last"] = True  # every step sees a full global batch: samples seen = budget
        if self.args.warmup == "first_task" and context.task_index > 0:
            values["warmup_steps"] = 0
        for method in self.methods:
            values.update(method.training_overrides(context, dict(values)))
        values["seed"] = self.args.seed + context.task_index
        values["report_to"] = []  # the stream's integrations report, through self.stream_logger
        values["disable_tqdm"] = not self.args.progress
        if values.get("push_to_hub"):  # mid-task checkpoints through the Trainer, on their own branch
            values.setdefault("hub_model_id", self.args.hub_model_id)
            values.setdefault("hub_revision", TRAINING_BRANCH)
            values.setdefault("hub_strategy", "checkpoint")
            if values["hub_model_id"] is None:
                raise ValueError("training.push_to_hub needs a repository: set hub_model_id (or training.hub_model_id)")
        return TrainingArguments(
            output_dir=str(self.output_dir / "trainer" / f"task-{context.task_index}"),
            remove_unused_columns=False,
            eval_strategy="no",
            **values,
        )

    def _budget_steps(self, values: dict[str, Any]) -> int:
        """Optimizer steps that spend exactly `samples_per_task` examples at this run's global batch."""
        batch = global_batch_size(values)
        steps, rest = divmod(self.args.samples_per_task, batch)
        if rest or steps == 0:
            raise ValueError(
                f"samples_per_task={self.args.samples_per_task} is not a positive multiple of the global batch {batch} "
                "(per_device_train_batch_size x processes x gradient_accumulation_steps): change one of them"
            )
        return steps

    def _train_task(self, context: TaskContext) -> None:
        training_args = self._training_arguments(context)  # once per task: the methods' overrides run here
        options: dict[str, Any] = {}
        for method in self.methods:
            options.update(method.collator_options(context))
        collator = CLIPCollator(
            self.image_processor, self.tokenizer, max_length=self.max_length, train=True, seed=context.seed, **options
        )
        train_dataset = self._train_dataset(context, training_args)
        # What task-end hooks may need to run the model over the task's data (EWC's Fisher, MAS, DER).
        context.train_dataset = train_dataset
        context.collator = CLIPCollator(
            self.image_processor, self.tokenizer, max_length=self.max_length, train=False, seed=context.seed, **options
        )
        context.per_device_batch_size = training_args.per_device_train_batch_size
        if training_args.push_to_hub and is_main_process():
            ensure_branch(training_args.hub_model_id, training_args.hub_revision, private=self.args.hub_private_repo,
                          retries=self.args.hub_retries, backoff=self.args.hub_retry_backoff)
        trainer = ContinualTrainer(
            model=self.model,
            args=training_args,
            train_dataset=train_dataset,
            data_collator=collator,
            methods=self.methods,
            context=context,
            callbacks=self.callbacks,
        )
        self.stream_logger.attach(trainer, offset=self.global_step)
        macs_per_sample = self._forward_macs(collator, train_dataset)
        trainer.train(resume_from_checkpoint=self._mid_task_checkpoint(trainer.args, context.task_index))
        context.log_history = trainer.state.log_history
        self.global_step += trainer.state.global_step
        self.compute.append(task_compute(
            context.task.name, trainer.state.global_step, global_batch_size(trainer.args.to_dict()), macs_per_sample,
            sum(method.extra_forward_passes for method in self.methods)
            + (REENCODE_PASSES if training_args.gradient_accumulation_steps > 1 else 0.0),
        ))

    def _forward_macs(self, collator: CLIPCollator, dataset: Any) -> float:
        """Forward MACs per example of the model being trained, measured on two training examples (the collator's
        sampler state is restored, so measuring changes nothing)."""
        state = collator.state_dict()
        rows = list(itertools.islice(iter(dataset), 2))  # map-style or streaming (IterableDataset)
        batch = collator(rows)
        collator.load_state_dict(state)
        return forward_macs_per_sample(self.model, batch)

    def _mid_task_checkpoint(self, training_args: TrainingArguments, task_index: int) -> str | None:
        """The interrupted task's last Trainer checkpoint when resuming (it needs `save_strategy`): the local one,
        else (with `training.push_to_hub`) the `last-checkpoint/` the Trainer pushed to the `training` branch, when
        it belongs to this task. None: the task starts from its beginning."""
        if self.args.resume_from_checkpoint in (None, False):
            return None
        trainer_dir = Path(training_args.output_dir)
        found = newest_complete_trainer_checkpoint(trainer_dir) if is_main_process() else None
        found = broadcast_object(found)
        if found is None and training_args.push_to_hub:
            found = self._download_training_checkpoint(training_args, trainer_dir, task_index)
        if found is not None:
            task = _read_json(Path(found) / MID_TASK_STATE / "task.json")
            if task.get("task_index") != task_index:
                raise ValueError(f"Trainer checkpoint {found} was written during task {task.get('task_index')}, not "
                                 f"task {task_index}")
            if "settings" in task:
                self._check_settings(task, Path(found) / MID_TASK_STATE / "task.json", task_index - 1)
        return found

    def _download_training_checkpoint(
        self, training_args: TrainingArguments, trainer_dir: Path, task_index: int
    ) -> str | None:
        """Fetch `last-checkpoint/` from the Trainer's Hub branch into trainer_dir (main process; others wait); None
        when there is none or it was written during another (earlier) task."""
        target = trainer_dir / "checkpoint-hub"
        if is_main_process():
            try:
                snapshot_download(training_args.hub_model_id, revision=training_args.hub_revision,
                                  allow_patterns=["last-checkpoint/*"], local_dir=str(target))
            except (RepositoryNotFoundError, RevisionNotFoundError):
                pass
        barrier()
        folder = target / "last-checkpoint"
        if not (folder / MID_TASK_STATE).is_dir():
            return None
        try:  # the manifest the Trainer pushed with it (`ContinualTrainer._push_from_checkpoint`)
            verify_checkpoint(folder, legacy_required=("trainer_state.json", f"{MID_TASK_STATE}/task.json"))
        except CheckpointError as error:
            logger.warning("The Trainer checkpoint on the Hub is damaged (%s): task %d starts from its beginning",
                           error, task_index)
            return None
        task = _read_json(folder / MID_TASK_STATE / "task.json").get("task_index")
        return str(folder) if task == task_index else None

    def _check_settings(self, saved: dict[str, Any], source: Path, after_task: int) -> None:
        """Refuse a resume whose settings differ from those `saved` (a checkpoint's state), except the keys of
        `resume_allow_changes`, which are recorded. Checkpoints without `settings` (older hf_ccl) are compared on
        the keys they stored."""
        settings = saved.get("settings")
        if settings is None:
            legacy = {"seed": saved.get("seed"), "methods": saved.get("methods"),
                      "method_args": saved.get("method_configs"), "first_task_epochs": saved.get("first_task_epochs"),
                      "training": {k: v for k, v in (saved.get("training") or {}).items()
                                   if k in self.settings["training"] or k not in UNCOMPARED_TRAINING}}
            settings = {key: value for key, value in legacy.items() if key in saved or key == "method_args"}
            now = {key: self.settings[key] for key in settings}
        else:
            now = self.settings
        changes = settings_diff(settings, now)
        refused = [change for change in changes if not allowed(change[0], self.args.resume_allow_changes)]
        if refused:
            described, keys = describe_diff(refused)
            raise ConfigError(
                f"{source} was written with other settings than this run's (saved -> now): {described}. Resume with "
                f"the same settings, or allow these changes with resume_allow_changes=[{', '.join(keys)}]",
                "resume_from_checkpoint")
        self.resume_changes = list(saved.get("resume_changes", []))
        recorded = {(change["key"], json.dumps(change["now"])) for change in self.resume_changes}
        for key, old, new in changes:
            if (key, json.dumps(new)) not in recorded:
                self.resume_changes.append({"after_task": after_task, "key": key, "saved": old, "now": new})
                logger.warning("Resuming after task %d with %s changed: %r -> %r (allowed)", after_task, key, old, new)

    def _save_run_files(self) -> None:
        """The run folder's results, compute and disorder files, as in the last task checkpoint."""
        if is_main_process() and (self.args.save_checkpoints or self.pusher is not None):
            self.results.save(self.output_dir)
            save_compute(self.compute, self.output_dir)
            self._save_disorder(self.output_dir)

    # ----- evaluation and checkpoints ---------------------------------------------------------------------
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Metrics of the current model on the eval split of every task (computed on the main process)."""
        metrics: dict[str, dict[str, float]] = {}
        if is_main_process():
            for task in self.stream:
                metrics[task.name] = evaluate_task(
                    self.model,
                    task,
                    self.image_processor,
                    self.tokenizer,
                    batch_size=self.args.eval_batch_size,
                    max_length=self.max_length,
                )
        barrier()
        return metrics

    def _disorder_dataset(self):  # noqa: ANN202 (datasets.Dataset)
        return self.stream[self.args.spatial_disorder_task].eval

    def _embed_for_disorder(self) -> DisorderEmbeddings:
        dataset = self._disorder_dataset()
        return embed_for_disorder(
            self.model, iter_column(dataset, "image"), list(iter_column(dataset, "texts")), self.image_processor,
            self.tokenizer, self.args.eval_batch_size, self.max_length,
        )

    def _measure_disorder(self, label: str) -> None:
        """Spatial disorder of the current model against the initial one (main process only)."""
        current = self._embed_for_disorder()
        reference = self._disorder_reference
        self.disorder[f"initial -> {label}"] = spatial_disorder(
            reference.images, reference.texts, current.images, current.texts, reference.correct
        )

    def _save_disorder(self, folder: Path) -> None:
        if not self.disorder:
            return
        payload = {label: result.to_dict() for label, result in self.disorder.items()}
        (folder / "spatial_disorder.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        try:
            plot_spatial_disorder(self.disorder, folder / "spatial_disorder.png")
        except ImportError:
            logger.info("matplotlib is not installed: spatial_disorder.png not written")

    def save_checkpoint(self, index: int) -> Path:
        """Write `output_dir/task-<index>/` atomically (a `.partial` folder renamed at the end); main process only."""
        final = self.output_dir / f"task-{index}"
        if is_main_process():
            partial = self.output_dir / f"task-{index}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            self.model.save_pretrained(partial)
            CLIPProcessor(image_processor=self.image_processor, tokenizer=self.tokenizer).save_pretrained(partial)
            self.image_processor.save_pretrained(partial)  # preprocessor_config.json too, for older transformers
            save_method_states(self.methods, partial)
            self.results.save(partial)
            save_compute(self.compute, partial)
            self._save_disorder(partial)
            if self._disorder_reference is not None:
                reference = self._disorder_reference
                save_file({"images": reference.images.contiguous(), "texts": reference.texts.contiguous(),
                           "correct": reference.correct.contiguous()}, str(partial / DISORDER_REFERENCE))
            state = {
                "task_index": index,
                "task_name": self.stream[index].name,
                "stream": self.stream.name,
                "task_names": self.stream.task_names,
                "task_sources": [task.source for task in self.stream],
                "methods": [method.name for method in self.methods],
                "method_configs": {method.name: method.config.to_dict() for method in self.methods},
                "base_model": self.base_model,
                "seed": self.args.seed,
                "training": self.args.training,
                "first_task_epochs": self.args.first_task_epochs,
                "global_step": self.global_step,
                "hf_ccl_version": __version__,
                "settings": self.settings,
                "resume_changes": self.resume_changes,
                "card_license": self.args.card_license,
                "evaluation": [evaluation_protocol(task) for task in self.stream],
            }
            (partial / CHECKPOINT_STATE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
            write_model_card(partial, repo_id=self.args.hub_model_id)
            write_manifest(partial)  # last: a folder without it was cut short
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
        self._save_run_files()
        barrier()
        return final


# ----- checkpoint helpers ------------------------------------------------------------------------------------------
def latest_task_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete `task-<k>/` folder (one with `continual_state.json`) with the highest k in `run_dir`, or None.
    `.partial` folders (a save that was interrupted) are ignored."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = []
    for child in run_dir.iterdir():
        name = child.name
        if child.is_dir() and name.startswith("task-") and name[5:].isdigit() and (child / CHECKPOINT_STATE).exists():
            found.append((int(name[5:]), child))
    return max(found)[1] if found else None


def evaluation_protocol(task: Any) -> dict[str, Any]:
    """What the model card says of how a task is evaluated: its kind, eval rows, classes and prompt templates."""
    return {"task": task.name, "kind": task.kind, "split": "eval", "examples": len(task.eval),
            "classes": len(task.class_names) if task.class_names else None,
            "templates": len(task.eval_templates or DEFAULT_TEMPLATES) if task.kind == "classification" else None}


def newest_complete_trainer_checkpoint(trainer_dir: Path) -> str | None:
    """The newest `checkpoint-<n>/` under `trainer_dir` whose manifest verifies; newer ones that do not (cut short
    by a kill or a full disk, damaged) are removed with a warning. None when there is none."""
    if not trainer_dir.is_dir():
        return None
    candidates = [p for p in trainer_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
                  and p.name[len("checkpoint-"):].isdigit()]
    for folder in sorted(candidates, key=lambda p: int(p.name[len("checkpoint-"):]), reverse=True):
        if checkpoint_is_complete(folder):
            return str(folder)
        logger.warning("Trainer checkpoint %s is incomplete or damaged: removed; resuming from an earlier one", folder)
        shutil.rmtree(folder, ignore_errors=True)
    return None


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load a checkpoint's weights into `model` (strict), growing the token embedding (and the text position embedding)
    first if the vocabulary (or the context) grew."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        load_sharded_checkpoint(model, str(folder), strict=True)
        return
    weights = folder / "model.safetensors"
    if not weights.exists():
        raise ValueError(f"Checkpoint {folder} has no model.safetensors (incomplete download or copy?)")
    state = _load_safetensors(weights)
    embedding = model.get_input_embeddings().weight
    saved_rows = next((t.shape[0] for k, t in state.items() if k.endswith("token_embedding.weight")), None)
    if saved_rows is not None and saved_rows != embedding.shape[0]:
        model.resize_token_embeddings(saved_rows)
    saved_positions = state.get("text_model.embeddings.position_embedding.weight")
    if saved_positions is not None and saved_positions.shape[0] > model.config.text_config.max_position_embeddings:
        resize_position_embeddings(model, saved_positions.shape[0])  # a context grown by `grow_vocab`
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error


def global_batch_size(training: dict[str, Any]) -> int:
    """Examples per optimizer step over all processes."""
    per_device = int(training.get("per_device_train_batch_size", 8))
    accumulation = int(training.get("gradient_accumulation_steps", 1))
    return per_device * accumulation * world_size()
