"""`ContinualTrainer`: a `transformers.Trainer` whose loss is the global contrastive loss plus the methods' terms.

One Trainer trains one task (fresh optimizer and schedule); `hf_ccl.continual.ContinualLearner` drives the stream.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils.memory import clear_device_cache
from torch.utils.flop_counter import FlopCounterMode
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .accumulation import REENCODE_PASSES, Batch, accumulated_backward
from .checkpoint_files import write_manifest
from .class_prompts import CROSS_ENTROPY_TERM, ClassPrompts, class_prompt_loss
from .distributed import check_distributed_trainer, check_sharded_loader, is_main_process, rank
from .methods.base import ContinualMethod, TaskContext
from .methods.state import load_method_states, save_method_states
from .modeling import ContinualDualEncoder
from .sharding import gather_model, is_sharded, shard_ready
from .step_meter import StepMeter
from .training_options import check_transformers_version, fsdp_request

CONTRASTIVE_TERM = "contrastive"
#: Sub-folder of a Trainer checkpoint (`checkpoint-<step>/`) with the methods' and the collator's mid-task state.
MID_TASK_STATE = "hf_ccl"
#: Per-process file (`<name><rank>.json`) of a mid-task checkpoint with the task's step counts so far.
STEP_METER_FILE = "step_meter_rank"
MAX_LOGIT_SCALE = math.log(100.0)  # OpenAI CLIP clamps exp(logit_scale) at 100; transformers does not
SHOWN_NAMES = 5  # non-finite weights or outputs named in an error


class NonFiniteError(FloatingPointError):
    """Training produced NaN or infinite values; the message names the task and the step."""


class NonFiniteLossError(NonFiniteError):
    """The loss became NaN or infinite; the message names the task, the first non-finite step and its terms."""


class NonFiniteModelError(NonFiniteError):
    """The model's weights, or its outputs on the last training batch, became NaN or infinite after an update whose
    loss was finite (the last update of a task overflowed); the message names the task, the step and what is not
    finite."""


class NonFiniteWatch:
    """The first non-finite loss of a task, kept on the device: `record` runs every step without a host sync, and
    only `first` (called at logging steps, before a checkpoint is saved and when training ends) reads it back."""

    def __init__(self, device: torch.device | str):
        #: The first optimizer step whose loss was not finite (-1: none yet).
        self.step = torch.full((), -1, dtype=torch.long, device=device)
        #: {term names: (the step they were recorded at, -1 when none; their values at that step)}.
        self._terms: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self, step: int, loss: torch.Tensor, names: Sequence[str], values: torch.Tensor) -> None:
        """Note `step` (and the term `values`) if `loss` is not finite and no earlier step was, on the device."""
        first = ~torch.isfinite(loss.detach()) & (self.step < 0)
        self.step = torch.where(first, step, self.step)
        key = tuple(names)
        at, kept = self._terms.get(key) or (torch.full_like(self.step, -1), torch.zeros_like(values))
        self._terms[key] = (torch.where(first, step, at), torch.where(first, values.detach(), kept))

    def first(self) -> tuple[int, dict[str, float]] | None:
        """(step, {term: value}) of the first non-finite loss, or None (reads the device: a host sync)."""
        step = int(self.step)
        if step < 0:
            return None
        for names, (at, values) in self._terms.items():
            if int(at) == step:
                return step, dict(zip(names, values.tolist(), strict=True))
        return step, {}


class MethodHooksCallback(TrainerCallback):
    """Calls each method's `pre_optimizer_step` between backward (after clipping) and `optimizer.step()` and its
    `post_optimizer_step` right after the step, clears the gradients of the methods' `optimizer_parameters` and
    clamps `logit_scale` to [0, ln 100] after every step."""

    def __init__(self, trainer: ContinualTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        trainer = self.trainer
        model = trainer.unwrapped_model()
        if trainer.context is not None:
            trainer.context.global_step = state.global_step
        with trainer.step_meter.hooks():
            for method in trainer.methods:
                method.pre_optimizer_step(model, trainer.context)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        """Clamp the temperature after each step, as OpenAI CLIP training does: exp(logit_scale) <= 100 (the family's
        `max_logit_scale`; SigLIP has none); clear
        the gradients of the methods' own parameters (the Trainer's `model.zero_grad()` does not reach them).
        Each method's `post_optimizer_step` runs first."""
        model = self.trainer.unwrapped_model()
        with self.trainer.step_meter.hooks():
            for method in self.trainer.methods:
                method.post_optimizer_step(model, self.trainer.context)
        for method in self.trainer.methods:
            for parameter in method.optimizer_parameters():
                parameter.grad = None
        logit_scale = getattr(model, "logit_scale", None)
        limit = getattr(model, "max_logit_scale", MAX_LOGIT_SCALE)
        if isinstance(logit_scale, torch.nn.Parameter) and limit is not None:
            with torch.no_grad():
                logit_scale.clamp_(0.0, limit)
        return control


class ContinualTrainer(Trainer):
    """Trainer for one task of a continual stream.

    `compute_loss` returns `contrastive + sum(method terms)` (the method terms alone when a method sets
    `replaces_contrastive_loss`; the class-prompt cross-entropy, ZSCL Eq. 1, instead of the contrastive loss on a
    classification task trained with `classification_loss: cross_entropy`, `hf_ccl.class_prompts`); each term (and each method's `metrics()`) is summed on the device, averaged over
    the logging window and logged as `loss/<name>`.

    A NaN or infinite loss stops training with `NonFiniteLossError`, which names the first non-finite step and its
    terms. The check stays on the device (`NonFiniteWatch`): no step waits for the GPU to find out. It is read on the
    host at every logging step (so with `logging_strategy="steps"`, `logging_steps` bounds how many steps train on
    after the first non-finite one), before any checkpoint is saved (a non-finite model is never saved) and when the
    task's training ends or fails (an error a method raised on NaN gradients is then reported as the non-finite
    loss it came from). With `logging_strategy="no"` the delay is up to the next checkpoint or the end of the task.
    An update that overflows after a finite loss (the last one of a task: no later loss shows it) is found by
    `NonFiniteModelError`: every weight and the model's outputs on the last training batch are checked when the
    task's training ends and before any checkpoint is saved (one host sync each), so such a model is neither
    evaluated nor saved.

    Gradient accumulation is exact for the contrastive loss and every method term (`hf_ccl.accumulation`): the
    micro-batches of one optimizer step are kept until the last one arrives, and the loss is computed once over
    all of them, so `per_device_train_batch_size=32, gradient_accumulation_steps=2` trains as `64 x 1` does.
    Every micro-batch's rows and every step's MACs are counted (`step_meter`, `hf_ccl.step_meter`).
    Mixed precision (`bf16`/`fp16`) covers the whole loss computation, the methods' teachers and momentum models
    included, not only the model's forward. Methods always see the unwrapped model (no DDP or `torch.compile`
    wrapper, so their parameter names are the model's own).

    The optimizer is the Trainer's own, with two method hooks: parameters named by a method's `no_weight_decay`
    go to the group without weight decay, and each method's `optimizer_parameters` are added as one more group
    without weight decay. The optimizer and the TrainingArguments are put in `context.optimizer` and
    `context.training_args` for the methods' `pre_optimizer_step`.
    """

    def __init__(
        self,
        *args: Any,
        methods: Sequence[ContinualMethod] = (),
        context: TaskContext | None = None,
        **kwargs: Any,
    ):
        check_transformers_version()
        super().__init__(*args, **kwargs)
        if not isinstance(self.model, ContinualDualEncoder):
            raise TypeError(f"ContinualTrainer trains a dual encoder of hf_ccl (hf_ccl.modeling.ContinualDualEncoder, "
                            f"e.g. ContinualCLIPModel), got {type(self.model).__name__}")
        check_distributed_trainer(self.args)  # several processes are one DDP run, or refused before training
        self.methods = list(methods)
        self.context = context
        # Our loss is a per-batch mean, not normalised by `num_items_in_batch`: let the Trainer scale it for
        # gradient accumulation and never multiply it by the number of processes.
        self.model_accepts_loss_kwargs = False
        self._term_sums: dict[str, torch.Tensor] = {}
        self._metric_sums: dict[str, torch.Tensor | float] = {}
        self._watch = NonFiniteWatch(self.args.device)
        #: The last micro-batch trained on: the model's outputs on it are checked to be finite after the last update.
        self._last_batch: Batch | None = None
        self._term_count = 0
        self._pending_chunks: list[Batch] = []  # micro-batches of the optimizer step in progress
        #: Rows batched and MACs of this process's steps (`hf_ccl.step_meter`; summed over processes by the loop).
        self.step_meter = StepMeter()
        if self.args.gradient_accumulation_steps > 1 and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError(
                "gradient_accumulation_steps > 1 is not supported with DeepSpeed or FSDP: hf_ccl's exact contrastive "
                "accumulation (hf_ccl.accumulation) is only implemented for one process and DDP. Use a larger "
                "per_device_train_batch_size instead."
            )
        #: The 0-d parameters reshaped to [1] for FSDP2 (`hf_ccl.sharding`), squeezed back by `trained_model`.
        self.sharded_scalars: list[str] = self._ready_for_fsdp()
        self.add_callback(MethodHooksCallback(self))
        if self.context is not None:
            self.context.training_args = self.args

    def _ready_for_fsdp(self) -> list[str]:
        """With FSDP2 (`training.fsdp` or `accelerate launch --use_fsdp`), the model readied for the Trainer's
        sharding (`hf_ccl.sharding.shard_ready`); FSDP asked for but not taken by accelerate is refused."""
        request = fsdp_request({"fsdp": self.args.fsdp, "fsdp_config": self.args.fsdp_config})
        if not self.is_fsdp_enabled:
            if request is not None:
                raise ValueError(f"{request[0]} asked for FSDP, but accelerate did not enable it "
                                 f"({self.accelerator.state.distributed_type}): the run would not be sharded")
            return []
        version = getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise ValueError(f"FSDP{version} is not supported: hf_ccl trains with FSDP2 (fsdp_config.version: 2, or "
                             "accelerate launch --fsdp_version 2)")
        return shard_ready(cast(ContinualDualEncoder, self.model), self.accelerator.state.fsdp_plugin)

    def trained_model(self) -> ContinualDualEncoder:
        """The task's model as the loop keeps it between tasks: unwrapped, and when it trained sharded, gathered into
        a plain model with the full weights on every process (`hf_ccl.sharding.gather_model`, a collective call)."""
        model = self.unwrapped_model()
        return gather_model(model, self.sharded_scalars) if is_sharded(model) else model

    @property
    def replaces_contrastive_loss(self) -> bool:
        """Whether a method's terms are the whole loss (the model's contrastive loss is then left out)."""
        return any(method.replaces_contrastive_loss for method in self.methods)

    @property
    def class_prompts(self) -> ClassPrompts | None:
        """The class prompts of a task trained with the cross-entropy loss (`hf_ccl.class_prompts`), else None."""
        return None if self.context is None else self.context.class_prompts

    @property
    def uses_contrastive_loss(self) -> bool:
        """Whether the model's contrastive loss is a term of the loss (not replaced by a method's terms or by the
        class-prompt cross-entropy)."""
        return not self.replaces_contrastive_loss and self.class_prompts is None

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """The Trainer's rule (no decay for biases and norms) less the parameters a method's `no_weight_decay`
        names."""
        names = super().get_decay_parameter_names(model)
        excluded: set[str] = set()
        for method in self.methods:
            excluded |= set(method.no_weight_decay(cast(ContinualDualEncoder, model)))
        return [name for name in names if name not in excluded]

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer plus one group, without weight decay, for the methods' `optimizer_parameters`
        (moved to the model's device first)."""
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if fresh:
            holder = model or self.model
            assert holder is not None, "the Trainer holds a model"
            in_model = {id(p) for p in holder.parameters()}
            extra = [p for method in self.methods for p in method.optimizer_parameters() if p.requires_grad]
            clash = [p for p in extra if id(p) in in_model]
            if clash:
                raise ValueError("optimizer_parameters must not be parameters of the model (the Trainer has them)")
            if extra:
                device = next(holder.parameters()).device
                for parameter in extra:  # in place (same object) on the model's device, before any optimizer state
                    parameter.data = parameter.data.to(device)
                optimizer.add_param_group({"params": extra, "weight_decay": 0.0})
        if self.context is not None:
            self.context.optimizer = optimizer
        return optimizer

    def unwrapped_model(self, model: torch.nn.Module | None = None) -> ContinualDualEncoder:
        """The model without its DDP, mixed-precision or `torch.compile` wrappers: what methods see (the dual encoder
        the Trainer was given, checked at construction)."""
        return cast(ContinualDualEncoder, self.accelerator.unwrap_model(
            model if model is not None else self.model_wrapped, keep_torch_compile=False))

    def _method_context(self) -> TaskContext:
        """The task context the methods' step hooks read; a Trainer given methods without one cannot call them."""
        if self.context is None:
            raise ValueError("ContinualTrainer was given methods but no context (hf_ccl.methods.TaskContext): their "
                             "loss terms read it; pass context=, or no methods")
        return self.context

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, then the model handed back bare: accelerate marks a prepared model (through a
        `torch.compile` wrapper the mark lands on the model itself) and patches its forward for autocast, and the
        next task's Trainer would then skip compiling and wrapping it."""
        self._watch = NonFiniteWatch(self.args.device)
        try:
            try:
                output = super().train(*args, **kwargs)
            except NonFiniteError:
                raise
            except Exception as error:  # e.g. a method's solver on NaN gradients: report the loss it came from
                self._raise_if_non_finite(f"when training failed with {type(error).__name__}: {error}", error,
                                          gather=False)
                raise
            finally:
                model = self.accelerator.unwrap_model(self.model_wrapped, keep_fp32_wrapper=False,
                                                      keep_torch_compile=False)
                model.__dict__.pop("_is_accelerate_prepared", None)
            self._raise_if_non_finite("when the task's training ended")
            self._raise_if_non_finite_model("when the task's training ended")
        finally:
            self._last_batch = None  # not kept past the task
        return output

    def get_train_dataloader(self) -> Any:
        """The Trainer's DataLoader, refused when several processes would all read the same batches."""
        loader = super().get_train_dataloader()
        check_sharded_loader(loader, self.train_dataset)
        return loader

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """The run's autocast (bf16/fp16) around the whole loss: accelerate only wraps the model's own forward, and
        the methods' teachers and momentum models would otherwise run in float32."""
        return self.accelerator.autocast()

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """One micro-batch. Before the last micro-batch of an optimizer step, it is only kept (and 0 is returned);
        the last one runs forward and backward over all of them (`hf_ccl.accumulation`), so the loss and every
        method term see the whole accumulated batch. Returns the loss of that batch. An optimizer step of one
        micro-batch is `Trainer.training_step` itself (`compute_loss` below adds the methods' terms)."""
        self.step_meter.batch(inputs)
        if not self.accelerator.gradient_state.sync_gradients:
            self._pending_chunks.append(inputs)
            return torch.zeros((), device=self.args.device)
        if self.context is not None:  # the step methods draw per-step data for (reference batches, GEM's memory)
            self.context.global_step = self.state.global_step
        chunks = [self._prepare_inputs(chunk) for chunk in (*self._pending_chunks, inputs)]
        self._pending_chunks = []
        self._last_batch = chunks[-1]
        model.train()
        optimizer_train = getattr(self.optimizer, "train", None)
        if callable(optimizer_train):
            optimizer_train()
        with self.step_meter.step(chunks, self._estimated_step_macs if self.args.torch_compile else None):
            if len(chunks) == 1:  # the Trainer's own step: its paths (context parallelism, cache clearing, ...) kept
                return super().training_step(model, chunks[0], num_items_in_batch)
            loss = self._accumulated_step(model, chunks)
        empty_every = self.args.torch_empty_cache_steps
        if empty_every is not None and self.state.global_step % empty_every == 0:
            clear_device_cache()
        return loss.detach()

    def _estimated_step_macs(self, chunks: list[Batch]) -> float:
        """MACs of a compiled model's step, estimated: a forward of the uncompiled model on each micro-batch,
        measured (eval mode, no gradients, the RNG untouched), times 3 for forward and backward (one more forward
        per chunk under exact accumulation). A compiled step is not measured directly: under `FlopCounterMode`
        dynamo would run it eagerly."""
        model = self.unwrapped_model()
        was_training = model.training
        model.eval()
        counter = FlopCounterMode(display=False)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), counter:
                for chunk in chunks:
                    self.compute_loss(model, chunk)
        finally:
            model.train(was_training)
        passes = 3.0 + (REENCODE_PASSES if len(chunks) > 1 else 0.0)  # forward + backward ≈ 3 forwards
        return counter.get_total_flops() / 2.0 * passes

    def _accumulated_step(self, model: torch.nn.Module, chunks: list[Batch]) -> torch.Tensor:
        """Forward and backward over several micro-batches as one batch (`hf_ccl.accumulation`)."""
        unwrapped = self.unwrapped_model(model)

        def encode(chunk: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            with self.compute_loss_context_manager():
                outputs = model(**chunk, features_only=True)
            return outputs.image_features, outputs.text_features

        def batch_loss(batch: Batch, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
            with self.compute_loss_context_manager():
                outputs = unwrapped.contrastive_outputs(
                    image_features, text_features, batch.get("text_hash"), batch.get("image_hash"),
                    return_loss=self.uses_contrastive_loss,
                )
                return self._total_loss(unwrapped, batch, outputs)

        parameters = [*unwrapped.parameters(), *(p for method in self.methods for p in method.optimizer_parameters())]
        return accumulated_backward(
            chunks, encode, batch_loss, parameters, self.accelerator.backward,
            no_sync=lambda: self.accelerator.no_sync(model),
        )

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        outputs = model(**inputs, return_loss=self.uses_contrastive_loss)
        loss = self._total_loss(self.unwrapped_model(model), inputs, outputs)
        return (loss, outputs) if return_outputs else loss

    def _total_loss(self, model: ContinualDualEncoder, inputs: dict[str, torch.Tensor], outputs: Any) -> torch.Tensor:
        """The contrastive loss (unless a method replaces it) plus every method's terms, checked to be finite and
        summed on the device for logging."""
        prompts = self.class_prompts
        if self.replaces_contrastive_loss:
            terms = {}
        elif prompts is not None:  # ZSCL Eq. 1: the batch's images against every candidate class prompt
            labels = inputs["class_labels"]
            terms = {CROSS_ENTROPY_TERM: class_prompt_loss(
                model, outputs.image_embeds, prompts.class_embeddings(model), labels, prompts.candidate_mask(labels))}
        else:
            terms = {CONTRASTIVE_TERM: outputs.loss}
        for method in self.methods:
            for name, value in method.loss_terms(model, inputs, outputs, self._method_context()).items():
                terms[f"{method.name}/{name}"] = value
        if not terms:
            raise ValueError("A method replaces the contrastive loss but no method returned a loss term")
        values = torch.stack([term.float() for term in terms.values()])
        loss = values.sum()
        if not model.training:  # not a training step (no step to name, no logging window): checked at once
            if not torch.isfinite(loss):
                raise self._non_finite_error(self.state.global_step, dict(zip(terms, values.tolist(), strict=True)),
                                             "outside a training step")
            return loss
        self._watch.record(self.state.global_step + 1, loss, list(terms), values)
        for name, value in terms.items():  # summed on device: no host sync per term and step
            value = value.detach().float()
            self._term_sums[name] = self._term_sums[name] + value if name in self._term_sums else value
        for method in self.methods:
            for name, raw in method.metrics().items():
                key = f"{method.name}/{name}"
                metric = _metric_value(raw, key)
                self._metric_sums[key] = self._metric_sums[key] + metric if key in self._metric_sums else metric
        self._term_count += 1
        return loss

    def _raise_if_non_finite(self, found: str, cause: BaseException | None = None, gather: bool = True) -> None:
        """Raise `NonFiniteLossError` if a step of this task had a non-finite loss (on any process with `gather`,
        which every process must then call). `found` says when it was found. Reads the device: a host sync."""
        mine = self._watch.first()
        steps = [-1 if mine is None else mine[0]]
        if gather and self.args.world_size > 1:
            steps = self.accelerator.gather(torch.tensor(steps, device=self._watch.step.device)).tolist()
        bad = [step for step in steps if step >= 0]
        if not bad:
            return
        step = min(bad)
        values = mine[1] if mine is not None and mine[0] == step else None
        raise self._non_finite_error(step, values, found) from cause

    def _raise_if_non_finite_model(self, found: str) -> None:
        """Raise `NonFiniteModelError` if a weight (the model's or a method's) or the model's output on the last
        training batch is not finite, on any process (every process must call it). The loss check cannot see this:
        it reads the loss before the update. Reads the device once: a host sync."""
        model = self.unwrapped_model()
        names, flags = finite_flags(model, self.methods)
        outputs = self._outputs_on_last_batch(model)
        names += [f"output {name} on the last training batch" for name in outputs]
        flags += [torch.isfinite(value).all() for value in outputs.values()]
        if not flags:
            return
        stacked = torch.stack([flag.to(self.args.device) for flag in flags]).to(torch.uint8)
        if self.args.world_size > 1:
            stacked = self.accelerator.gather(stacked.unsqueeze(0)).amin(dim=0)
        bad = [name for name, ok in zip(names, stacked.tolist(), strict=True) if not ok]
        if not bad:
            return
        shown = ", ".join(bad[:SHOWN_NAMES]) + (f", ... ({len(bad)} in all)" if len(bad) > SHOWN_NAMES else "")
        raise NonFiniteModelError(
            f"Non-finite model at {self._where(self.state.global_step)}: {shown} hold NaN or infinite values, "
            f"although the loss was finite (an update overflowed; found {found}). Nothing of it was saved. Lower "
            "training.learning_rate (or set training.max_grad_norm) and resume: resume_from_checkpoint=auto "
            "'resume_allow_changes=[training.learning_rate]'"
        )

    @torch.no_grad()
    def _outputs_on_last_batch(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's outputs (towers' features, or a pair batch's learner outputs) on the last micro-batch trained
        on, in eval mode under the run's autocast; empty when no step ran."""
        if self._last_batch is None:
            return {}
        was_training = model.training
        model.eval()
        try:
            with self.compute_loss_context_manager():
                outputs = model(**self._last_batch, features_only=True)
        finally:
            model.train(was_training)
        return {name: value for name, value in outputs.items()
                if isinstance(value, torch.Tensor) and value.is_floating_point()}

    def _where(self, step: int) -> str:
        """Where a non-finite value was found: the task, the step and the last good checkpoint."""
        where = f"step {step}"
        if self.context is not None:
            where = f"task {self.context.task_index} ({self.context.task.name!r}), {where}"
            last = self.context.last_checkpoint
            where += f"; the last good checkpoint is kept at {last}" if last else "; no checkpoint was written yet"
        return where

    def _non_finite_error(self, step: int, values: dict[str, float] | None, found: str) -> NonFiniteLossError:
        where = self._where(step)
        terms = "recorded on another process" if values is None else ", ".join(
            f"{name}={value:.4g}" for name, value in values.items())
        return NonFiniteLossError(
            f"Non-finite loss at {where}. Loss terms: {terms}. Found {found} (the loss is checked on the host at "
            "logging steps, before a checkpoint is saved and when a task's training ends)"
        )

    # ----- mid-task checkpoints: the Trainer saves model, optimizer, scheduler and RNG; we add the rest ------------
    def _save_rng_state(self, output_dir: str) -> None:
        """Beside the RNG state (before any push of the checkpoint): every method's state and the caption sampler's
        position, so that `train(resume_from_checkpoint=...)` continues the task exactly."""
        super()._save_rng_state(output_dir)
        folder = Path(output_dir) / MID_TASK_STATE
        folder.mkdir(parents=True, exist_ok=True)
        if is_main_process():
            save_method_states(self.methods, folder)
            task: dict[str, Any] = {"task_index": None if self.context is None else self.context.task_index,
                    "task_name": None if self.context is None else self.context.task.name}
            if self.context is not None and self.context.run_settings is not None:
                task["settings"] = self.context.run_settings  # compared when the task resumes
            (folder / "task.json").write_text(json.dumps(task), encoding="utf-8")
        sampler = getattr(self.data_collator, "state_dict", None)
        if callable(sampler):
            path = folder / f"collator_rank{rank()}.json"
            path.write_text(json.dumps(sampler()), encoding="utf-8")
        (folder / f"{STEP_METER_FILE}{rank()}.json").write_text(json.dumps(self.step_meter.state_dict()),
                                                                 encoding="utf-8")

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, then (once every process has written its files) its manifest, written last:
        a checkpoint without one was cut short and is skipped on resume (`hf_ccl.checkpoint_files`). A model that
        trained on a non-finite loss, or whose weights or outputs are not finite, is never saved:
        `NonFiniteLossError` / `NonFiniteModelError` instead."""
        self._raise_if_non_finite(f"before saving {PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._raise_if_non_finite_model(f"before saving {PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if is_main_process() and folder.is_dir():
            write_manifest(folder)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Trainer's push of a mid-task checkpoint (`training.push_to_hub`), with its manifest written first so
        that a download can be verified (the full manifest, with every process's files, follows in
        `_save_checkpoint`)."""
        if is_main_process():
            write_manifest(checkpoint_folder)
        super()._push_from_checkpoint(checkpoint_folder)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The interrupted task's optimizer and schedule state (moments, step), with this run's hyperparameters:
        torch's `load_state_dict` would restore the saved groups' learning rate, weight decay and betas, so a change
        a resume allowed (`resume_allow_changes=[training.learning_rate]`) would do nothing until the next task.
        The schedule keeps its position; its base rates become this run's."""
        fresh = [{key: value for key, value in group.items() if key != "params"}
                 for group in self.optimizer.param_groups] if self.optimizer is not None else []
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not fresh or self.optimizer is None:
            return
        changed = False
        for group, values in zip(self.optimizer.param_groups, fresh, strict=True):
            for key, value in values.items():
                if key != "lr" and group.get(key) != value:
                    group[key], changed = value, True
        scheduler = self.lr_scheduler
        if not changed or scheduler is None:
            return
        bases = [group["initial_lr"] for group in self.optimizer.param_groups]
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler.base_lrs = list(bases)
            for group, base, factor in zip(self.optimizer.param_groups, bases, scheduler.lr_lambdas, strict=True):
                group["lr"] = base * factor(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        elif list(getattr(scheduler, "base_lrs", bases)) != bases:
            raise ValueError(f"The interrupted task's schedule ({type(scheduler).__name__}) cannot take another "
                             "learning rate mid-task: resume with the saved training.learning_rate, or from the "
                             "task's start (remove its Trainer checkpoints)")

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        folder = Path(checkpoint) / MID_TASK_STATE
        if not folder.is_dir():
            raise ValueError(
                f"Trainer checkpoint {checkpoint} has no {MID_TASK_STATE}/ folder with the methods' state; it was not "
                "written by hf_ccl (or is incomplete): delete it to restart the task from its beginning"
            )
        load_method_states(self.methods, folder)
        self._load_step_meter(folder)
        path = folder / f"collator_rank{rank()}.json"
        loader = getattr(self.data_collator, "load_state_dict", None)
        if callable(loader) and path.exists():
            try:
                loader(json.loads(path.read_text(encoding="utf-8")))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"Cannot read the caption sampler state {path}: {error}") from error

    def _load_step_meter(self, folder: Path) -> None:
        """The counts of the steps before the checkpoint; a checkpoint of an older version has none: its steps are
        then counted as whole batches at the measured steps' mean MACs (`StepMeter.unmeasured_steps`)."""
        path = folder / f"{STEP_METER_FILE}{rank()}.json"
        if not path.exists():
            self.step_meter.unmeasured_steps = self.state.global_step
            return
        try:
            self.step_meter.load_state_dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"Cannot read the step counts {path} (truncated or corrupt?): {error}; delete the "
                             "Trainer checkpoint to restart the task from its beginning") from error

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, after the non-finite check, with the window's means of the loss terms and metrics
        (read from the device here, once per logging step)."""
        self._raise_if_non_finite(f"at the log of step {self.state.global_step}")
        if self._term_count and "loss" in logs:
            for prefix, sums in (("loss/", self._term_sums), ("", self._metric_sums)):
                for name, total in sums.items():
                    mean = float(total) / self._term_count
                    logs[prefix + name] = round(mean, 6) if math.isfinite(mean) else mean
            self._term_sums.clear()
            self._metric_sums.clear()
            self._term_count = 0
        super().log(logs, start_time)


def finite_flags(
    model: torch.nn.Module, methods: Sequence[ContinualMethod] = ()
) -> tuple[list[str], list[torch.Tensor]]:
    """The names of the model's floating-point parameters and the methods' own, and per parameter a device flag:
    whether it is finite (a sharded parameter: this process's shard). Nothing is read back here."""
    named = [*model.named_parameters(), *((f"{method.name}/{index}", parameter) for method in methods
                                          for index, parameter in enumerate(method.optimizer_parameters()))]
    names, flags = [], []
    for name, parameter in named:
        if not parameter.is_floating_point():
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # a DTensor's shard
        names.append(f"weight {name}")
        flags.append(torch.isfinite(local.detach()).all())
    return names, flags


def _metric_value(value: Any, key: str) -> torch.Tensor | float:
    """A method's metric as summed: a one-element tensor stays on its device (detached, float32), a number is a
    float; anything else is refused (the trainer would otherwise log it wrongly)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metrics() of {key} must be a number or a one-element tensor, got shape "
                            f"{tuple(value.shape)}")
        return value.detach().float().reshape(())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metrics() of {key} must be a number or a one-element tensor, got {type(value).__name__}")
