"""The per-task loop: a continual run is a sequence of ordinary Trainer runs, one per task.

For each task k of the stream:
1. the methods' `on_task_start` hooks (they may change the model),
2. the methods' `train_dataset` transforms (replay, joint),
3. training with a fresh optimizer and schedule (`ContinualTrainer`),
4. evaluation on the eval split of every task, seen and not yet seen (one row of the results matrix),
5. the methods' `on_task_end` hooks (so the saved state is the state the next task starts from),
6. a complete checkpoint in `output_dir/task-<k>/`: model, processor, method state, results so far.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import CLIPProcessor, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments

from . import __version__
from .data.collate import CLIPCollator
from .data.task import CANONICAL_COLUMNS, TaskStream
from .distributed import barrier, is_main_process
from .evaluation.evaluator import evaluate_task, iter_column
from .evaluation.matrix import ResultsMatrix
from .evaluation.spatial_disorder import (
    DisorderEmbeddings,
    SpatialDisorder,
    embed_for_disorder,
    plot_spatial_disorder,
    spatial_disorder,
)
from .methods.base import ContinualMethod, TaskContext
from .methods.state import save_method_states
from .modeling import ContinualCLIPModel
from .trainer import ContinualTrainer

logger = logging.getLogger(__name__)

CHECKPOINT_STATE = "continual_state.json"
# TrainingArguments the loop sets itself: a user value would break the run.
MANAGED_TRAINING_ARGS = ("output_dir", "remove_unused_columns", "eval_strategy", "do_eval")


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

    def __post_init__(self) -> None:
        validate_training_args(self.training)


def validate_training_args(training: dict[str, Any]) -> None:
    """Reject unknown or loop-managed TrainingArguments fields before any training starts."""
    valid = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    unknown = sorted(set(training) - valid)
    if unknown:
        raise ValueError(
            f"Unknown training option(s) {unknown}; valid options are the fields of transformers.TrainingArguments, "
            f"e.g. num_train_epochs, max_steps, per_device_train_batch_size, learning_rate, warmup_steps, weight_decay"
        )
    managed = sorted(set(training) & set(MANAGED_TRAINING_ARGS))
    if managed:
        raise ValueError(f"Training option(s) {managed} are set by hf_ccl itself; remove them from the config")


def validate_stream(stream: TaskStream) -> None:
    """Empty streams, empty tasks and non-canonical datasets fail here, before any training."""
    if len(stream) == 0:
        raise ValueError(f"Stream {stream.name!r} has no tasks")
    for index, task in enumerate(stream):
        for split_name, dataset in (("train", task.train), ("eval", task.eval)):
            missing = [c for c in CANONICAL_COLUMNS if c not in dataset.column_names]
            if missing:
                raise ValueError(
                    f"Stream {stream.name!r}, task {index} ({task.name!r}), {split_name} split: missing column(s) "
                    f"{missing}; it has {dataset.column_names}. Build tasks with hf_ccl.data builders."
                )
            if len(dataset) == 0:
                raise ValueError(f"Stream {stream.name!r}, task {index} ({task.name!r}): the {split_name} split is empty")


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
        validate_stream(stream)
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

    @property
    def max_length(self) -> int:
        limit = self.model.config.text_config.max_position_embeddings
        return min(self.args.max_length or limit, limit)

    # ----- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> ResultsMatrix:
        """Run the whole stream; returns the results matrix (also saved in every checkpoint)."""
        if self.args.evaluate_initial:
            self.results.add_row("initial", self.evaluate())
        if self.args.spatial_disorder_task is not None and is_main_process():
            self._disorder_reference = self._embed_for_disorder()
        bar = tqdm(total=len(self.stream), desc=f"stream {self.stream.name}", disable=not self.args.progress)
        last_checkpoint: Path | None = None
        for index, task in enumerate(self.stream):
            bar.set_postfix_str(task.name)
            context = TaskContext(
                task_index=index,
                task=task,
                stream=self.stream,
                model=self.model,
                output_dir=self.output_dir,
                seed=self.args.seed + index,
                extras={"last_checkpoint": str(last_checkpoint) if last_checkpoint else None},
            )
            self._start_task(context)
            self._train_task(context)
            self.results.add_row(task.name, self.evaluate())
            if self._disorder_reference is not None:
                self._measure_disorder(task.name)
            for method in self.methods:
                method.on_task_end(context)
            if self.args.save_checkpoints:
                last_checkpoint = self.save_checkpoint(index)
            bar.update(1)
        bar.close()
        return self.results

    def _start_task(self, context: TaskContext) -> None:
        for method in self.methods:
            new_model = method.on_task_start(context)
            if new_model is not None:
                self.model = context.model = new_model

    def _train_dataset(self, context: TaskContext):  # noqa: ANN202 (datasets.Dataset)
        dataset = context.task.train
        for method in self.methods:
            dataset = method.train_dataset(context, dataset)
        if len(dataset) == 0:
            raise ValueError(f"Task {context.task_index} ({context.task.name!r}) has no training examples")
        return dataset

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
        values["seed"] = self.args.seed + context.task_index
        values["disable_tqdm"] = not self.args.progress
        return TrainingArguments(
            output_dir=str(self.output_dir / "trainer" / f"task-{context.task_index}"),
            remove_unused_columns=False,
            eval_strategy="no",
            **values,
        )

    def _train_task(self, context: TaskContext) -> None:
        collator = CLIPCollator(
            self.image_processor, self.tokenizer, max_length=self.max_length, train=True, seed=context.seed
        )
        train_dataset = self._train_dataset(context)
        # What task-end hooks may need to run the model over the task's data (EWC's Fisher, MAS, DER).
        context.extras.update(
            train_dataset=train_dataset,
            collator=CLIPCollator(
                self.image_processor, self.tokenizer, max_length=self.max_length, train=False, seed=context.seed
            ),
            image_processor=self.image_processor,
            tokenizer=self.tokenizer,
            per_device_batch_size=self._training_arguments(context).per_device_train_batch_size,
        )
        trainer = ContinualTrainer(
            model=self.model,
            args=self._training_arguments(context),
            train_dataset=train_dataset,
            data_collator=collator,
            methods=self.methods,
            context=context,
            callbacks=self.callbacks,
        )
        trainer.train()
        context.extras["log_history"] = trainer.state.log_history

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
            self._save_disorder(partial)
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
                "hf_ccl_version": __version__,
            }
            (partial / CHECKPOINT_STATE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            self.results.save(self.output_dir)
            self._save_disorder(self.output_dir)
        barrier()
        return final
