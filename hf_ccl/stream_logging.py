"""One logging run per stream: the `training.report_to` integrations see a whole continual run as one training run.

A continual run trains one Trainer per task. Left to the Trainer, its reporting integrations (TensorBoard, W&B,
MLflow, ...) would start a new run for every task, with steps restarting at 1. `StreamLogger` creates them once per
stream and stands between them and each task's Trainer, as one `TrainerCallback`:

- `on_init_end` and `on_train_begin` reach them once, when the first task of the stream starts training;
  `on_train_end` once, from `end()` after the last task;
- every other event reaches them with the stream's global step: the optimizer steps of the earlier tasks plus the
  task's own (`on_save` keeps the task's step: it names that Trainer's `checkpoint-<step>/` folder);
- they see the task's TrainingArguments with `output_dir` set to the run folder (TensorBoard writes to
  `<output_dir>/runs/<date>_<host>/`) and `report_to` set to the stream's integrations;
- `log_results` logs a results-matrix row, the derived metrics and the task's compute at a given global step.

Only the main process reports (the integrations are still created on every process, so a missing package fails
everywhere at once).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import get_reporting_integration_callbacks

from .compute import TaskCompute
from .distributed import is_main_process
from .evaluation.matrix import INITIAL_LABEL, ResultsMatrix
from .training_options import integration_names, reporting_callbacks  # noqa: F401 (re-exported)

#: Integrations rewrite a log key `eval_<name>` as `eval/<name>` (and any other key as `train/<key>`).
RESULTS_PREFIX = "eval_results"
SUMMARY_PREFIX = "eval_summary"
COMPUTE_PREFIX = "compute"
# What the Trainer passes with every event besides args, state and control; kept to replay stream-level events.
TRAINER_OBJECTS = ("model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader")
# Events passed on with the stream's global step; on_init_end, on_train_begin, on_train_end and on_save have their
# own rules (see the module docstring).
SHIFTED_EVENTS = (
    "on_epoch_begin", "on_epoch_end", "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step",
    "on_substep_end", "on_step_end", "on_evaluate", "on_predict", "on_log", "on_prediction_step", "on_push_begin",
)


class StreamLogger(TrainerCallback):
    """The `report_to` integrations of one stream, fed by every task's Trainer with a global step.

    Give each task's Trainer to `attach(trainer, offset)` with `offset` = the optimizer steps of all earlier tasks
    (those finished before a resume included); `log_results` after each evaluation; `end` after the last task.
    """

    def __init__(self, report_to: str | Sequence[str] | None, run_dir: str | Path,
                 user_callbacks: Sequence[TrainerCallback] = ()):
        self.names = integration_names(report_to)
        self.integrations = reporting_callbacks(report_to)
        self.active = bool(self.integrations) and is_main_process()
        self.run_dir = str(run_dir)
        self.user_callbacks = list(user_callbacks)
        self.offset = 0
        self.started = False
        self._args: TrainingArguments | None = None
        self._args_view: TrainingArguments | None = None
        self._state: TrainerState | None = None
        self._objects: dict[str, Any] = {}
        self._pending: list[tuple[dict[str, float], int]] = []  # logged before the first task began training

    # ----- wiring ----------------------------------------------------------------------------------------------
    def attach(self, trainer: Trainer, offset: int) -> None:
        """Make `trainer` report through this stream, counting its steps from `offset`. The integration callbacks
        it made itself from `args.report_to` are dropped (the learner passes none, but TrainingArguments adds
        `kubeflow` inside a Kubeflow job); callbacks given by the user are kept."""
        made = tuple(get_reporting_integration_callbacks(trainer.args.report_to))
        user = set(map(id, self.user_callbacks))
        for callback in list(trainer.callback_handler.callbacks):
            if type(callback) in made and id(callback) not in user:
                trainer.remove_callback(callback)
        self.offset = offset
        if self.active:
            trainer.add_callback(self)

    def log_results(self, matrix: ResultsMatrix, label: str, step: int, compute: Sequence[TaskCompute] = ()) -> None:
        """Log the row `label` of `matrix` (every cell, the headline mean), the derived metrics so far and the
        compute of task `label` (if recorded) at global step `step`."""
        if self.active:
            self.log(results_logs(matrix, label, compute), step)

    def log(self, logs: dict[str, float], step: int) -> None:
        """Send `logs` to every integration at global step `step` (queued until the stream starts training)."""
        if not self.active or not logs:
            return
        if not self.started:
            self._pending.append((logs, step))
            return
        args, state = self._seen()
        self._call("on_log", args, self._state_at(state, step), TrainerControl(), logs=dict(logs), **self._objects)

    def end(self, step: int, model: Any = None) -> None:
        """The stream's `on_train_end` at global step `step` (closes TensorBoard writers, ends MLflow, DVCLive and
        Neptune runs); `model`: the final model, when a method replaced the Trainer's."""
        if not (self.active and self.started):
            return
        objects = {**self._objects, **({"model": model} if model is not None else {})}
        args, state = self._seen()
        self._call("on_train_end", args, self._state_at(state, step), TrainerControl(), **objects)
        self.started = False

    # ----- the Trainer's events ----------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self._remember(args, state, kwargs)
        if self.started:
            return control
        self.started = True
        state_view = self._state_at(state, self.offset + state.global_step)
        control = self._call("on_init_end", self._args_view, state_view, control, **kwargs)
        control = self._call("on_train_begin", self._args_view, state_view, control, **kwargs)
        pending, self._pending = self._pending, []
        for logs, step in pending:
            self.log(logs, step)
        return control

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        """A task's end is not the stream's (`end()` is)."""
        self._remember(args, state, kwargs)
        return control

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
        """The Trainer's own args and step: integrations that upload `checkpoint-<step>/` find the folder."""
        return self._call("on_save", args, state, control, **kwargs)

    def on_init_end(self, args, state, control, **kwargs):  # noqa: ANN001
        return control  # sent once, when the stream starts training (see on_train_begin)

    def _shifted(self, event: str, args, state, control, **kwargs):  # noqa: ANN001
        self._remember(args, state, kwargs)
        return self._call(event, self._seen()[0], self._state_at(state, self.offset + state.global_step), control,
                          **kwargs)

    # ----- helpers -------------------------------------------------------------------------------------------
    def _remember(self, args: TrainingArguments, state: TrainerState, kwargs: dict[str, Any]) -> None:
        if args is not self._args:
            self._args = args
            self._args_view = copy.copy(args)
            self._args_view.output_dir = self.run_dir
            self._args_view.report_to = list(self.names)
        self._state = state
        self._objects = {key: kwargs[key] for key in TRAINER_OBJECTS if key in kwargs}

    def _seen(self) -> tuple[TrainingArguments, TrainerState]:
        """The stream's view of the Trainer's args and its last state (both known once a Trainer called back)."""
        assert self._args_view is not None and self._state is not None, "no Trainer event seen yet"
        return self._args_view, self._state

    @staticmethod
    def _state_at(state: TrainerState, step: int) -> TrainerState:
        """`state` seen from the stream: `global_step` (and `max_steps`, by as much) moved to `step`."""
        view = copy.copy(state)
        view.max_steps = state.max_steps + step - state.global_step
        view.global_step = step
        return view

    def _call(self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl,
              **kwargs: Any) -> TrainerControl:
        for integration in self.integrations:
            result = getattr(integration, event)(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control


def _shifted_event(event: str):  # noqa: ANN202
    def handler(self: StreamLogger, args, state, control, **kwargs):  # noqa: ANN001
        return self._shifted(event, args, state, control, **kwargs)

    handler.__name__ = event
    handler.__doc__ = f"`{event}` at the stream's global step."
    return handler


for _event in SHIFTED_EVENTS:
    setattr(StreamLogger, _event, _shifted_event(_event))


def results_logs(matrix: ResultsMatrix, label: str, compute: Sequence[TaskCompute] = ()) -> dict[str, float]:
    """The scalars logged after an evaluation: `eval_results/<task>/<metric>` for every cell of row `label`,
    `eval_results/headline_mean` (the row's mean headline metric over the tasks evaluated), `eval_summary/<name>`
    for `matrix.summary()`, and for a trained task with a compute record `compute/samples_seen`, `compute/macs`, the
    totals so far, `compute/seconds/<phase>` (the phases timed so far), peak memory, trainable parameters and
    `compute/method_state_bytes`. Undefined values (NaN) are left out."""
    if label == INITIAL_LABEL:
        initial = matrix.initial_headline()
        if matrix.initial is None or initial is None:
            raise ValueError("the results matrix has no initial row")
        row, headline = matrix.initial, initial
    else:
        index = next((i for i, row in enumerate(matrix.rows) if row.label == label), None)
        if index is None:
            raise ValueError(f"the results matrix has no row {label!r}; rows: {[r.label for r in matrix.rows]}")
        row, headline = matrix.rows[index], matrix.headline()[index]
    logs = {f"{RESULTS_PREFIX}/{task}/{name}": value
            for task, metrics in row.metrics.items() for name, value in metrics.items()}
    finite = [value for value in headline if math.isfinite(value)]
    if finite:
        logs[f"{RESULTS_PREFIX}/headline_mean"] = sum(finite) / len(finite)
    if label != INITIAL_LABEL:
        logs.update({f"{SUMMARY_PREFIX}/{name}": value for name, value in matrix.summary().items()})
        records = [record for record in compute if record.task == label]
        if records:
            logs[f"{COMPUTE_PREFIX}/samples_seen"] = records[-1].samples_seen
            logs[f"{COMPUTE_PREFIX}/macs"] = records[-1].macs
            logs[f"{COMPUTE_PREFIX}/total_samples_seen"] = sum(record.samples_seen for record in compute)
            logs[f"{COMPUTE_PREFIX}/total_macs"] = sum(record.macs for record in compute)
            record = records[-1]
            for phase, seconds in record.seconds.items():
                logs[f"{COMPUTE_PREFIX}/seconds/{phase}"] = seconds
            for key in ("peak_rss_bytes", "peak_cuda_bytes", "trainable_parameters"):
                if getattr(record, key) is not None:
                    logs[f"{COMPUTE_PREFIX}/{key}"] = getattr(record, key)
            logs[f"{COMPUTE_PREFIX}/method_state_bytes"] = sum(record.method_state_bytes.values())
    return {key: float(value) for key, value in logs.items() if math.isfinite(float(value))}
