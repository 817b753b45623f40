"""Task-level callbacks: the continual loop's side effects, and the user's own, in the style of `TrainerCallback`.

`ContinualLearner` runs the stream; everything it does besides training, evaluating and keeping method state is a
`TaskCallback`: Hub pushes (`hf_ccl.hub.HubPushCallback`), model cards (`hf_ccl.cards.ModelCardCallback`), the Hub's
`.eval_results/` files (`hf_ccl.eval_results.EvalResultsCallback`),
Mod-X's spatial-disorder diagnostics (`hf_ccl.evaluation.spatial_disorder.SpatialDisorderCallback`) and the compute
accounting (`hf_ccl.compute.ComputeCallback`). Users pass their own with `ContinualLearner(..., task_callbacks=[...])`.

Every event has the signature `on_<event>(self, args, state, control, **kwargs)`, as a `TrainerCallback`'s: `args`
the run's `ContinualArguments`, `state` a `StreamState` (where the stream is), `control` a `StreamControl` (what the
loop should do next), and keyword arguments that depend on the event (`learner` always):

| event                 | when                                                              | kwargs                     |
|-----------------------|-------------------------------------------------------------------|----------------------------|
| `on_stream_begin`     | `fit()` starts, after a resume was restored                       | `learner`                  |
| `on_task_begin`       | before the methods' `on_task_start`                               | `context`                  |
| `on_train_begin`      | the task's Trainer is built, before it trains                     | `context`, `trainer`,      |
|                       |                                                                   | `collator`, `train_dataset`|
| `on_task_trained`     | after training and the methods' `after_training`                  | `context`, `trainer`       |
| `on_task_evaluated`   | the task's row was added (not after tasks `eval_every` skips)     | `context`, `metrics`       |
| `on_task_end`         | after the methods' `on_task_end`, before the checkpoint           | `context`                  |
| `on_save`             | a checkpoint (`task_folder=True`) or the run folder is written:   | `folder`, `task_folder`    |
|                       | add files to `folder` (main process; before the manifest)         |                            |
| `on_restore`          | a task checkpoint is restored (every process)                     | `folder`                   |
| `on_checkpoint_saved` | `task-<k>/` is complete (main process)                            | `folder`                   |
| `on_stream_end`       | `fit()` ends, also when it fails (`error` is then the exception)  | `error`                    |

Callbacks run in the order given, after the built-in ones.

A callback with state that must survive a restart implements `state_dict()` / `load_state_dict(state)`, as methods
do (a nested dict of tensors and JSON values; `hf_ccl.state_files`): every task checkpoint saves it in
`callback_state.json` / `.safetensors` under the callback's `state_key` (default: its class name), and a resume
gives it back before `on_restore`. Files a callback writes in `on_save` are outputs for readers (`compute.json`, the
model card), never read back on resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

EVENTS = (
    "on_stream_begin", "on_task_begin", "on_train_begin", "on_task_trained", "on_task_evaluated", "on_task_end",
    "on_save", "on_restore", "on_checkpoint_saved", "on_stream_end",
)


@dataclass
class StreamState:
    """Where the stream is: the task being run (-1 before the first), optimizer steps over the stream so far, the
    task checkpoint the run resumed from, and the last one written."""

    num_tasks: int
    task_index: int = -1
    task_name: str | None = None
    global_step: int = 0
    resumed_from: Path | None = None
    last_checkpoint: Path | None = None


@dataclass
class StreamControl:
    """What a callback asks of the loop: `should_stop` ends the stream after the current task (its checkpoint is
    written first)."""

    should_stop: bool = False


#: Stem of the files the task callbacks' states are saved in (`callback_state.json` / `.safetensors`).
CALLBACK_STATE = "callback_state"


class TaskCallback:
    """Base class: every event is a no-op, so a callback overrides only the events it needs; a callback with state
    overrides `state_dict` and `load_state_dict`."""

    #: The name its state is saved under in a checkpoint; None: the class name.
    state_key: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """What must survive a restart: tensors and JSON values (saved only when a subclass overrides this)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def on_stream_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_train_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_trained(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_evaluated(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_end(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_save(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_restore(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_checkpoint_saved(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_stream_end(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...


CallbackT = TypeVar("CallbackT", bound=TaskCallback)


@dataclass
class TaskCallbackHandler:
    """Calls one event on every callback, in order (as transformers' `CallbackHandler`)."""

    callbacks: list[TaskCallback] = field(default_factory=list)

    def __post_init__(self) -> None:
        for callback in self.callbacks:
            check_callback(callback)
        stateful_callbacks(self.callbacks)

    def add(self, callbacks: Sequence[TaskCallback]) -> None:
        for callback in callbacks:
            check_callback(callback)
        stateful_callbacks([*self.callbacks, *callbacks])  # two under one state key fail here, before anything runs
        self.callbacks.extend(callbacks)

    def get(self, kind: type[CallbackT]) -> CallbackT | None:
        """The first callback of type `kind`, or None."""
        return next((callback for callback in self.callbacks if isinstance(callback, kind)), None)

    def call(self, event: str, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"Unknown task event {event!r}; events: {', '.join(EVENTS)}")
        for callback in self.callbacks:
            getattr(callback, event)(args, state, control, **kwargs)


def has_state(callback: TaskCallback) -> bool:
    """Whether the callback saves state (its class overrides `state_dict`)."""
    return type(callback).state_dict is not TaskCallback.state_dict


def stateful_callbacks(callbacks: Sequence[TaskCallback]) -> dict[str, TaskCallback]:
    """The callbacks with state, by `state_key`; two under one key is an error."""
    found: dict[str, TaskCallback] = {}
    for callback in callbacks:
        if not has_state(callback):
            continue
        key = callback.state_key or type(callback).__name__
        if key in found:
            raise ValueError(f"Task callbacks {type(found[key]).__name__} and {type(callback).__name__} both save their "
                             f"state as {key!r}: give one of them another `state_key`")
        found[key] = callback
    return found


def save_callback_states(callbacks: Sequence[TaskCallback], directory: str | Path) -> None:
    """Every stateful callback's `state_dict()` in `directory` (`callback_state.json` / `.safetensors`)."""
    from .state_files import save_states  # (here: this module stays free of torch, for the CLI's start)

    save_states(stateful_callbacks(callbacks), directory, CALLBACK_STATE)


def load_callback_states(callbacks: Sequence[TaskCallback], directory: str | Path) -> None:
    """Give every stateful callback its state from `directory`; one the checkpoint holds no state for (added at
    the resume) starts afresh, with a warning."""
    from .state_files import load_states

    load_states(stateful_callbacks(callbacks), directory, CALLBACK_STATE, what="task callback", required=False)


def check_callback(callback: Any) -> None:
    """A task callback is a `TaskCallback` (a `TrainerCallback` belongs in `callbacks`, given to every Trainer)."""
    if not isinstance(callback, TaskCallback):
        raise TypeError(f"task_callbacks takes TaskCallback instances, got {type(callback).__name__} (a "
                        "transformers TrainerCallback goes in `callbacks`)")
