"""The per-task loop: a continual run is a sequence of ordinary Trainer runs, one per task.

For each task k of the stream:
1. the methods' `on_task_start` hooks (they may change the model),
2. the methods' `train_dataset` transforms (replay, joint),
3. training with a fresh optimizer and schedule (`ContinualTrainer`),
4. evaluation on the eval split of every task, seen and not yet seen (one row of the results matrix),
5. the methods' `on_task_end` hooks (so the saved state is the state the next task starts from),
6. a complete checkpoint in `output_dir/task-<k>/`: model, processor, method state, results so far, model card,
7. with `hub.model_id`, a push of that folder to the Hub (`main` and branch `task-<k>`, in the background).

`resume_from_checkpoint` continues a stopped run from its last complete task checkpoint (local, else the Hub's newest
`task-<k>` branch) with every method's state and the results so far; with Trainer checkpoints (`save_strategy`),
the interrupted task itself resumes from its last one. A finished task is never trained twice.
"""

from __future__ import annotations

import gc
import logging
import math
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from tqdm.auto import tqdm
from transformers import (
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainingArguments,
)

from . import checkpointing
from .arguments import ContinualArguments, validate_training_args  # noqa: F401 (re-exported)
from .callbacks import StreamControl, StreamState, TaskCallback, TaskCallbackHandler
from .cards import ModelCardCallback
from .checkpointing import (  # noqa: F401  (re-exported: public names of this module before they moved)
    CHECKPOINT_STATE,
    latest_task_checkpoint,
    load_model_weights,
    newest_complete_trainer_checkpoint,
)
from .checks import RunPlan, check_pair_stream, check_run, validate_stream  # noqa: F401 (re-exported)
from .class_prompts import ClassPrompts
from .compute import ComputeCallback, TaskCompute, global_batch_size, phase_timer
from .data.image_cache import cached_pixels_dataset
from .data.reference import ReferenceBatches
from .data.streaming import is_empty, is_streaming, whole_batches
from .data.task import CollatorSetup, ModelPart, TaskStream
from .data.workers import dataloader_defaults, training_device_type
from .distributed import barrier, broadcast_object, is_main_process, launch_defaults, world_size
from .eval_results import EvalResultsCallback
from .evaluation.checks import NonFiniteEmbeddingError
from .evaluation.matrix import ResultsMatrix
from .evaluation.schedule import StreamEvaluator, evaluated_after
from .evaluation.spatial_disorder import SpatialDisorderCallback
from .hub import (
    HubPushCallback,
    PushReport,
    ensure_branch,
)
from .methods.base import ContinualMethod, TaskContext
from .modeling import ContinualDualEncoder
from .pair_features import ModalityEncoder, encode_pair_stream, pair_encoders
from .resume_settings import run_settings
from .run_folder import RunFolderLock, claim_run_folder
from .run_state import RunState
from .stream_logging import StreamLogger
from .trainer import ContinualTrainer

logger = logging.getLogger(__name__)

#: Branch the Trainer's own pushes go to (`training.push_to_hub`): its latest checkpoint in `last-checkpoint/`.
TRAINING_BRANCH = "training"


def planned_steps(rows: int, training: dict[str, Any], processes: int = 1) -> int:
    """Optimizer steps a task of `rows` training examples takes under `training` (TrainingArguments fields), as
    `Trainer.set_initial_training_values` counts them: `max_steps` when set, else epochs x ceil(batches / accumulation)
    with each process's share of the rows (the distributed sampler pads it up)."""
    if int(training.get("max_steps", -1)) > 0:
        return int(training["max_steps"])
    per_process = math.ceil(rows / processes)
    batch = int(training.get("per_device_train_batch_size", 8))
    batches = per_process // batch if training.get("dataloader_drop_last") else math.ceil(per_process / batch)
    accumulation = int(training.get("gradient_accumulation_steps", 1))
    per_epoch = max(batches // accumulation + int(batches % accumulation > 0), 1)
    return math.ceil(float(training.get("num_train_epochs", 3.0)) * per_epoch)


def check_frozen_encoders(model: ContinualDualEncoder, task_name: str) -> None:
    """On a pair task only the learner heads may train: the cached features come from the frozen towers."""
    moving = [name for name, p in model.named_parameters() if p.requires_grad and not name.startswith("learner_heads.")]
    if moving:
        raise ValueError(f"pair task {task_name!r}: CLIP parameters {moving[:3]}{' ...' if len(moving) > 3 else ''} "
                         "would train, but the task's features were cached from the frozen towers; only the learner "
                         "heads may train (a method made them trainable)")


def release_task_trainer(trainer: ContinualTrainer, model: ContinualDualEncoder) -> None:
    """Drop what a trained task's Trainer holds beside the run's `model`: its optimizer state (AdamW's moments, 8 bytes
    per trained parameter), its DDP wrapper (the reducer's gradient buckets, 4 bytes per parameter) or, under FSDP2,
    the sharded student the gathered `model` replaced. Each task's Trainer builds its own, and the loop's reference to
    the last Trainer would otherwise keep the previous task's alive through the whole next task (measured on a
    ViT-B/32: peak RSS 4.6 -> 3.1 GiB in one process, 4.3 -> 3.7 GiB per DDP process, benchmarks/memory.py)."""
    if trainer.optimizer is not None:
        trainer.optimizer.state.clear()
    trainer.model = trainer.model_wrapped = model
    trainer.accelerator.free_memory()  # its references to the prepared model, optimizer and data loaders


class ContinualLearner:
    """Train one model on a stream of tasks, one after another, and keep the task-by-task results matrix.

    `callbacks` (transformers `TrainerCallback`s) are given to every task's Trainer; `task_callbacks`
    (`hf_ccl.callbacks.TaskCallback`s) get the stream's events, after the built-in ones (compute accounting,
    spatial disorder, model cards, Hub pushes).
    """

    def __init__(
        self,
        model: ContinualDualEncoder,
        stream: TaskStream,
        methods: list[ContinualMethod],
        image_processor: Any,
        tokenizer: PreTrainedTokenizerBase,
        args: ContinualArguments,
        callbacks: list[TrainerCallback] | None = None,
        task_callbacks: list[TaskCallback] | None = None,
        modality_encoders: Mapping[str, ModalityEncoder] | None = None,
        plan: RunPlan | None = None,
    ):
        #: What was checked of this run (`hf_ccl.checks`): `plan` (the CLI's) when it covers these arguments and methods.
        self.plan = check_run(model, stream, methods, args, image_processor, plan)
        # joins the process group now when launched distributed (the Trainer would, later), on the CPU when it must
        PartialState(cpu=bool({**launch_defaults(args.training), **args.training}.get("use_cpu")))
        self.callbacks = list(callbacks or [])
        self.modality_encoders = dict(modality_encoders or {})
        self.model = model
        self.stream = stream
        self.image_processor = image_processor
        self.args = args
        self.output_dir = Path(args.output_dir)
        self.base_model = model.config._name_or_path or None  # what the run started from, for the model card
        self.model.align_special_tokens(tokenizer)
        self.task_callbacks = TaskCallbackHandler(
            [ComputeCallback(), SpatialDisorderCallback(), ModelCardCallback(), EvalResultsCallback(), HubPushCallback()]
        )
        self.task_callbacks.add(list(task_callbacks or []))
        self.state = StreamState(num_tasks=len(stream))
        self.control = StreamControl()
        #: What the run carries from task to task and across a resume (`hf_ccl.run_state`): what checkpoints save.
        self.run_state = RunState(
            results=ResultsMatrix(task_names=stream.task_names, headline_metrics=[
                task.kind_spec.headline(args.class_scope) for task in stream]),
            tokenizer=tokenizer,
            methods=methods,
            settings=run_settings(args, stream, methods),  # what a resume must match (before anything runs)
            callbacks=self.task_callbacks.callbacks,
            allow_changes=list(args.resume_allow_changes),
            description={"base_model": self.base_model, "seed": args.seed, "training": args.training,
                         "first_task_epochs": args.first_task_epochs, "card_license": args.card.license,
                         "class_scope": args.class_scope},
        )
        self.stream_logger: StreamLogger | None = None  # one logging run per fit()
        self._lock: RunFolderLock | None = None
        self._owns_lock = False
        #: When this run's clock started (`time.time()`): the process's start under `hf-ccl train` (`hf_ccl.run.run`),
        #: else the learner's creation; the start-up cost is from here to the first task (`hf_ccl.compute`).
        self.started_at = time.time()
        self.initial_eval_seconds = 0.0  # the evaluation before the first task, in the last fit()

    @property
    def compute(self) -> list[TaskCompute]:
        """Samples seen and MACs of every trained task (`ComputeCallback`)."""
        callback = self.task_callbacks.get(ComputeCallback)
        return callback.records if callback is not None else []

    @property
    def push_report(self) -> PushReport | None:
        """What the Hub pushes of the last `fit()` did (None without `hub.model_id`)."""
        callback = self.task_callbacks.get(HubPushCallback)
        return callback.report if callback is not None else None

    # ----- the run's state (`self.run_state`) -------------------------------------------------------------
    @property
    def results(self) -> ResultsMatrix:
        """The results matrix so far."""
        return self.run_state.results

    @results.setter
    def results(self, value: ResultsMatrix) -> None:
        self.run_state.results = value

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer the model trains and evaluates with (a method may grow it)."""
        return self.run_state.tokenizer

    @tokenizer.setter
    def tokenizer(self, value: PreTrainedTokenizerBase) -> None:
        self.run_state.tokenizer = value

    @property
    def methods(self) -> list[ContinualMethod]:
        """The methods, in order (each one's state is saved in every checkpoint)."""
        return self.run_state.methods

    @methods.setter
    def methods(self, value: list[ContinualMethod]) -> None:
        self.run_state.methods = value

    @property
    def global_step(self) -> int:
        """Optimizer steps over the stream so far: the step `training.report_to` logs at."""
        return self.run_state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.run_state.global_step = value

    @property
    def settings(self) -> dict[str, Any]:
        """What a resume must match (`hf_ccl.resume_settings.run_settings`)."""
        return self.run_state.settings

    @property
    def resume_changes(self) -> list[dict[str, Any]]:
        """Settings changed on purpose at a resume (`resume_allow_changes`)."""
        return self.run_state.resume_changes

    @property
    def writes_checkpoints(self) -> bool:
        """Whether task checkpoints are written (asked for, or needed for the Hub pushes)."""
        return self.args.save_checkpoints or self.args.hub.model_id is not None

    def event(self, name: str, **kwargs: Any) -> None:
        """Call task event `name` on every task callback, with this learner and the stream's state."""
        self.state.global_step = self.global_step
        self.task_callbacks.call(name, self.args, self.state, self.control, learner=self, **kwargs)

    def encode_pair_tasks(self) -> None:
        """Replace each pair task's splits by their frozen features (`hf_ccl.pair_features`), once per run."""
        if not any(kind.trains is ModelPart.LEARNER_HEADS for kind in self.stream.kinds):
            return
        encoders = pair_encoders(
            self.model, self.image_processor, self.tokenizer, self.stream.modalities,
            image_modalities=self.args.pairs.image_modalities,
            precomputed_modalities=self.args.pairs.precomputed_modalities,
            given=self.modality_encoders, max_length=self.max_length,
        )
        self.stream = encode_pair_stream(self.stream, encoders)

    @property
    def max_length(self) -> int:
        limit = self.model.max_text_positions
        return min(self.args.max_length or limit, limit)

    # ----- the loop -----------------------------------------------------------------------------------------
    def claim_output_dir(self, lock: RunFolderLock | None = None) -> None:
        """Lock output_dir for this run (main process) and refuse to start a new run over another run's files
        (`overwrite_output_dir` removes them). Done by `fit`; call it earlier to check before writing anything.
        `lock`: one the caller already holds on output_dir (and releases itself, after `fit`)."""
        if self._lock is not None or not is_main_process():
            return
        owned = lock is None
        lock = lock or RunFolderLock(self.output_dir)
        if owned:
            lock.acquire()
        try:
            claim_run_folder(self.output_dir, resume=self.args.resume_from_checkpoint not in (None, False),
                             overwrite=self.args.overwrite_output_dir)
        except BaseException:
            if owned:
                lock.release()
            raise
        self._lock, self._owns_lock = lock, owned

    def fit(self) -> ResultsMatrix:
        """Run the whole stream; returns the results matrix (also saved in every checkpoint).

        While it runs, the objects that existed before are frozen for the cyclic garbage collector (`gc.freeze`,
        undone at the end): each task's Trainer ends with a full `gc.collect()` (accelerate's `free_memory`), which
        would otherwise walk every object of the process (measured: 0.28 s per task in a CLI run, more in a long
        Python session); it then walks only what the run made. Nothing is lost: frozen objects are collected after
        `gc.unfreeze()` as before."""
        self.claim_output_dir()
        frozen = gc.get_freeze_count() == 0  # (a caller's own freeze is left as it is)
        if frozen:
            gc.freeze()
        try:
            return self._fit()
        finally:
            if frozen:
                gc.unfreeze()
            if self._lock is not None and self._owns_lock:
                self._lock.release()
            self._lock = None
            self.started_at = time.time()  # a later fit()'s start-up starts now

    def _fit(self) -> ResultsMatrix:
        self.initial_eval_seconds = 0.0
        self.stream_logger = StreamLogger(self.args.training.get("report_to"), self.output_dir, self.callbacks)
        self.state, self.control = StreamState(num_tasks=len(self.stream)), StreamControl()
        self.encode_pair_tasks()  # with the model the run starts from: its towers are the frozen encoders
        resumed = checkpointing.find_resume_checkpoint(self.args.resume_from_checkpoint, self.output_dir,
                                                       self.args.hub.model_id, self.args.hub.timeout)
        if resumed is not None:
            first_task = self.restore(resumed) + 1
            self.state.resumed_from = self.state.last_checkpoint = resumed
        else:
            first_task = 0
        self._check_planned_steps(first_task)
        if resumed is not None and first_task == len(self.stream):
            logger.warning("Every task of the stream was already trained (resumed from %s): nothing to train; the "
                           "results are those of the finished run", resumed)
        elif resumed is None:
            if self.args.evaluation.initial:
                started = time.perf_counter()
                self.results.add_row("initial", self.evaluate(trained=0))
                self.initial_eval_seconds = time.perf_counter() - started
                self.stream_logger.log_results(self.results, "initial", step=0)
        error: BaseException | None = None
        try:
            self.event("on_stream_begin")
            self._run_tasks(first_task)
            if self.writes_checkpoints:  # current even when a finished run was resumed
                checkpointing.save_run_files(self.output_dir, self.results, self._write_outputs)
            self.stream_logger.end(self.global_step, model=self.model)
        except BaseException as raised:
            error = raised
            raise
        finally:  # the Hub pushes of the finished tasks complete even when a task failed
            self.event("on_stream_end", error=error)
        return self.results

    def _run_tasks(self, first_task: int) -> None:
        bar = tqdm(total=len(self.stream), desc=f"stream {self.stream.name}", disable=not self.args.progress)
        bar.update(first_task)
        for index, task in enumerate(self.stream):
            if index < first_task:
                continue
            bar.set_postfix_str(task.name)
            self.state.task_index, self.state.task_name = index, task.name
            last = self.state.last_checkpoint
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
                eval_batch_size=self.args.evaluation.batch_size,
                samples_per_task=self.args.samples_per_task,
                base_training=dict(self.args.training),  # as configured, before budget and warmup rules
                run_settings=self.settings,  # stored in mid-task checkpoints, compared on resume
                last_checkpoint=str(last) if last else None,
            )
            self.event("on_task_begin", context=context)
            clock = context.phase_seconds  # wall time by phase (`hf_ccl.compute`)
            with phase_timer(clock, "task_start"):
                self._start_task(context)
            if task.kind_spec.trains is ModelPart.LEARNER_HEADS:
                check_frozen_encoders(self.model, task.name)
            trainer = self._train_task(context)
            with phase_timer(clock, "after_training"):
                for method in self.methods:
                    self._run_hook(context, method, "after_training")
            self.event("on_task_trained", context=context, trainer=trainer)
            release_task_trainer(trainer, self.model)
            if evaluated_after(index, len(self.stream), self.args.evaluation.every):
                with phase_timer(clock, "eval"):
                    metrics = self.evaluate(trained=index + 1)
                self.results.add_row(task.name, metrics)
                self.event("on_task_evaluated", context=context, metrics=metrics)
            else:  # evaluation.every: the row is marked not evaluated (the derived metrics that need it are null)
                self.results.add_row(task.name, {}, evaluated=False)
            with phase_timer(clock, "task_end"):
                for method in self.methods:
                    method.on_task_end(context)
            self.event("on_task_end", context=context)
            assert self.stream_logger is not None  # (one per fit())
            self.stream_logger.log_results(self.results, task.name, self.global_step, self.compute)
            if self.writes_checkpoints:
                with phase_timer(clock, "checkpoint"):
                    self.state.last_checkpoint = self.save_checkpoint(index)
                if is_main_process():
                    self.event("on_checkpoint_saved", folder=self.state.last_checkpoint)
                    if not self.args.keep_trainer_checkpoints:
                        shutil.rmtree(self.output_dir / "trainer" / f"task-{index}", ignore_errors=True)
            bar.update(1)
            if broadcast_object(self.control.should_stop if is_main_process() else None):
                logger.info("A task callback stopped the stream after task %d (%s)", index, task.name)
                break
        bar.close()

    # ----- checkpoints (hf_ccl.checkpointing) -------------------------------------------------------------
    def save_checkpoint(self, index: int) -> Path:
        """Write `output_dir/task-<index>/` atomically (main process; see `hf_ccl.checkpointing`)."""
        return checkpointing.save_checkpoint(self.output_dir, index, self.run_state, self.model, self.image_processor,
                                             self.stream, self.max_length, self._write_outputs)

    def restore(self, folder: str | Path) -> int:
        """Load a task checkpoint: model, tokenizer, method states, results, the callbacks' state; then the
        `on_restore` event. Returns the index of the task it was written after."""
        index = checkpointing.restore(folder, self.run_state, self.model, self.stream.task_names)
        self.event("on_restore", folder=Path(folder))
        return index

    def _write_outputs(self, folder: Path, task_folder: bool) -> None:
        """The task callbacks' files for readers in a checkpoint or the run folder: the `on_save` event."""
        self.event("on_save", folder=folder, task_folder=task_folder)

    def _start_task(self, context: TaskContext) -> None:
        """Task-start hooks. A hook may assign `context.model` and call `context.replace_tokenizer` (a vocabulary
        grown for a new language): the run then trains, evaluates and saves with what the context holds. The hooks
        run with the global RNGs seeded with the task's seed (a LoRA adapter's initialisation), as in a resumed run."""
        from transformers import set_seed

        set_seed(context.seed)
        for method in self.methods:
            self._run_hook(context, method, "on_task_start")

    def _run_hook(self, context: TaskContext, method: ContinualMethod, hook: str) -> None:
        """Call `method.<hook>(context)` and adopt the model, tokenizer and token limit it left in `context`. A model
        the hook returned (the interface before `context.model` was assignable; the hooks are declared to return
        None) is taken too, with a deprecation warning."""
        returned = getattr(method, hook)(context)
        if returned is not None:
            warnings.warn(f"{type(method).__name__}.{hook} returned a model: assign context.model instead (returning "
                          "one is deprecated)", FutureWarning, stacklevel=2)
            context.model = returned
        self.model = context.model
        if context.tokenizer is not None and context.tokenizer is not self.tokenizer:
            self.tokenizer = context.tokenizer
            self.model.align_special_tokens(self.tokenizer)

    def _class_prompts(self, context: TaskContext) -> ClassPrompts | None:
        """The candidate class prompts of a classification task trained with the cross-entropy loss: its own
        classes, and those of the tasks before it in the `"seen"` and `"all"` scopes or when a method trains on their
        rows."""
        if self.args.classification_loss != "cross_entropy" or not context.task.kind_spec.has_classes:
            return None
        past = self.args.class_scope in ("seen", "all") or any(method.trains_on_past_tasks for method in self.methods)
        tasks = context.seen_tasks if past else [context.task]
        return ClassPrompts.build(tasks, self.tokenizer, scope=self.args.class_scope, max_length=self.max_length,
                                  padding=self.model.text_padding)

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
        if self.args.image_cache and context.task.kind_spec.has_images:  # built once per machine, then read by all
            with training_args.main_process_first(local=True, desc="image cache"):
                folder = None if self.args.image_cache is True else self.args.image_cache
                dataset = cached_pixels_dataset(dataset, self.image_processor, cache_dir=folder)
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
            # none on a CPU; on a GPU, the process's share of the cores (hf_ccl.data.workers)
            **dataloader_defaults(self.args.training, training_device_type(self.args.training)),
            "dataloader_pin_memory": torch.cuda.is_available(),
            **launch_defaults(self.args.training),  # several processes without a GPU: DDP on the CPU (gloo)
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
        values["logging_nan_inf_filter"] = False  # its check syncs every step; ContinualTrainer refuses non-finite losses
        if values.get("push_to_hub"):  # mid-task checkpoints through the Trainer, on their own branch
            values.setdefault("hub_model_id", self.args.hub.model_id)
            values.setdefault("hub_revision", TRAINING_BRANCH)
            values.setdefault("hub_strategy", "checkpoint")
            if values["hub_model_id"] is None:
                raise ValueError("training.push_to_hub needs a repository: set hub.model_id (or training.hub_model_id)")
        return TrainingArguments(
            output_dir=str(self.output_dir / "trainer" / f"task-{context.task_index}"),
            remove_unused_columns=False,
            eval_strategy="no",
            **values,
        )

    def _budget_steps(self, values: dict[str, Any]) -> int:
        """Optimizer steps that spend exactly `samples_per_task` examples at this run's global batch."""
        batch = global_batch_size(values)
        assert self.args.samples_per_task is not None  # called only with a budget
        steps, rest = divmod(self.args.samples_per_task, batch)
        if rest or steps == 0:
            raise ValueError(
                f"samples_per_task={self.args.samples_per_task} is not a positive multiple of the global batch {batch} "
                "(per_device_train_batch_size x processes x gradient_accumulation_steps): change one of them"
            )
        return steps

    def _check_planned_steps(self, first_task: int) -> None:
        """Before the stream trains: each task's optimizer steps, where they are known without training (map-style
        data that no method transforms), against what the methods need (`ContinualMethod.check_task_steps`)."""
        if any(type(method).train_dataset is not ContinualMethod.train_dataset for method in self.methods):
            return  # replay, joint: the data a task trains on is known at its start (checked then)
        for index, task in enumerate(self.stream):
            if index < first_task or is_streaming(task.train):
                continue
            values = {**self.args.training}
            if index == 0 and self.args.first_task_epochs is not None:
                values["num_train_epochs"], values["max_steps"] = self.args.first_task_epochs, -1
            if self.args.samples_per_task is not None:
                values["max_steps"] = self._budget_steps(values)
                values["dataloader_drop_last"] = True
            steps = planned_steps(len(task.train), values, world_size())
            for method in self.methods:
                method.check_task_steps(index, task.name, steps)

    def _check_task_steps(self, context: TaskContext, trainer: ContinualTrainer) -> None:
        """Before a task trains, with its exact optimizer steps: what the methods need, and a learning rate that
        leaves zero (a warmup as long as a one-step task would train nothing)."""
        steps = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]
        for method in self.methods:
            method.check_task_steps(context.task_index, context.task.name, steps)
        warmup = trainer.args.get_warmup_steps(steps)
        if steps == 1 and warmup >= 1:
            raise ValueError(
                f"Task {context.task_index} ({context.task.name!r}) trains 1 optimizer step, and its warmup "
                f"(training.warmup_steps={trainer.args.warmup_steps}) takes it: the learning rate of that step is 0, so "
                "the task would train nothing. Set training.warmup_steps=0 or train the task longer")

    def _train_task(self, context: TaskContext) -> ContinualTrainer:
        with phase_timer(context.phase_seconds, "setup"):
            trainer = self._build_trainer(context)
            self._check_task_steps(context, trainer)
        with phase_timer(context.phase_seconds, "train"):
            trainer.train(resume_from_checkpoint=checkpointing.mid_task_checkpoint(
                self.args.resume_from_checkpoint, trainer.args, context.task_index, self.run_state))
        context.log_history = trainer.state.log_history
        self.global_step += trainer.state.global_step
        if trainer.is_fsdp_enabled:  # FSDP2: the plain model, gathered on every process
            self.model = context.model = trainer.trained_model()
        return trainer

    def _build_trainer(self, context: TaskContext) -> ContinualTrainer:
        """The task's Trainer: arguments, collators and dataset (after the methods' transforms), callbacks."""
        training_args = self._training_arguments(context)  # once per task: the methods' overrides run here
        options: dict[str, Any] = {}
        for method in self.methods:
            options.update(method.collator_options(context))
        context.class_prompts = self._class_prompts(context)
        if context.class_prompts is not None:
            options["class_labels"] = context.class_prompts.labels
        # The kind batches its task; the eval-mode twin is what task-end hooks run the model over (EWC's Fisher, DER).
        collator, context.collator = context.task.kind_spec.collators(context.task, CollatorSetup(
            self.image_processor, self.tokenizer, self.max_length, context.seed,
            num_workers=training_args.dataloader_num_workers, padding=self.model.text_padding, options=options))
        for method in self.methods:  # reference sets, collated like the task's own batches (ZSCL)
            reference = method.reference_data(context)
            if reference is not None:
                context.references[method.name] = ReferenceBatches(reference, context.collator, context.seed,
                                                                   context.task_index)
        train_dataset = self._train_dataset(context, training_args)
        context.train_dataset = train_dataset
        context.per_device_batch_size = training_args.per_device_train_batch_size
        if training_args.push_to_hub and is_main_process():
            assert training_args.hub_model_id is not None and training_args.hub_revision is not None  # (set above)
            ensure_branch(training_args.hub_model_id, training_args.hub_revision, private=self.args.hub.private,
                          retries=self.args.hub.retries, backoff=self.args.hub.backoff)
        trainer = ContinualTrainer(
            model=self.model,
            args=training_args,
            train_dataset=train_dataset,
            data_collator=collator,
            methods=self.methods,
            context=context,
            callbacks=self.callbacks,
        )
        assert self.stream_logger is not None  # (one per fit())
        self.stream_logger.attach(trainer, offset=self.global_step)
        self.event("on_train_begin", context=context, trainer=trainer, collator=collator, train_dataset=train_dataset)
        return trainer

    # ----- evaluation and checkpoints ---------------------------------------------------------------------
    def evaluate(self, trained: int | None = None) -> dict[str, dict[str, float]]:
        """Metrics of the current model, after training the first `trained` tasks (default: as many as the results
        have rows; the `"seen"` class scope reads it), on the eval split of every task (computed on the main process): on each
        task's fixed subsample with `evaluation.max_examples`, reusing the embeddings of towers that did not change
        (`evaluation.cache`); the protocol is recorded in the results matrix (`hf_ccl.evaluation.schedule`)."""
        evaluator = self.__dict__.get("_evaluator")
        if evaluator is None:  # one per learner: its embedding cache lives as long as the run
            evaluator = self._evaluator = StreamEvaluator(
                eval_every=self.args.evaluation.every, max_examples=self.args.evaluation.max_examples,
                seed=self.args.seed, cache=self.args.evaluation.cache, class_scope=self.args.class_scope)
        evaluator.record(self.results, self.stream)  # a resume on other eval rows stops here, before any scoring
        if trained is None:
            trained = self.results.num_trained
        metrics: dict[str, dict[str, float]] = {}
        if is_main_process():
            try:
                metrics = evaluator.evaluate(self.model, self.stream, self.image_processor, self.tokenizer,
                                             batch_size=self.args.evaluation.batch_size, max_length=self.max_length,
                                             trained=trained)
            except NonFiniteEmbeddingError as error:  # name the model evaluated and what is kept
                model = ("the initial model" if trained == 0
                         else f"the model after task {trained - 1} ({self.stream[trained - 1].name!r})")
                last = self.state.last_checkpoint
                kept = f"the last good checkpoint is kept at {last}" if last else "no checkpoint was written"
                raise NonFiniteEmbeddingError(f"Non-finite embeddings of {model} (global step {self.global_step}; "
                                              f"{kept}): {error}") from error
        barrier()
        return metrics
