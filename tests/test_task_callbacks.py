"""Task-level callbacks: the events a user callback sees, in order, with what each carries; `should_stop`; the
built-in side effects (compute, model card) running as callbacks; and the state protocol they share with methods
(`state_dict` / `load_state_dict`, saved in every checkpoint and given back on resume)."""

from __future__ import annotations

import json
import shutil
import weakref

import pytest
import torch
from transformers import TrainerCallback

from hf_ccl.callbacks import EVENTS, TaskCallback
from hf_ccl.checkpoint_files import write_manifest
from hf_ccl.checkpointing import restore_states, save_states
from hf_ccl.compute import ComputeCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods, save_method_states
from hf_ccl.testing import tiny_clip


class Recorder(TaskCallback):
    """Every event as (event, task index, extra keyword names); stops the stream after `stop_after`."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[tuple[str, int, tuple[str, ...]]] = []
        self.stop_after = stop_after
        self.saved_files: list[set[str]] = []

    def _record(self, event: str, state, kwargs) -> None:  # noqa: ANN001
        assert kwargs["learner"] is not None
        self.events.append((event, state.task_index, tuple(sorted(set(kwargs) - {"learner"}))))


def _make_recorder_class() -> type[Recorder]:
    def handler(event: str):  # noqa: ANN202
        def method(self, args, state, control, **kwargs):  # noqa: ANN001, ANN202
            self._record(event, state, kwargs)
            if event == "on_save" and kwargs["task_folder"]:
                self.saved_files.append({path.name for path in kwargs["folder"].iterdir()})
            if event == "on_task_end" and state.task_index == self.stop_after:
                control.should_stop = True
        return method

    return type("EventRecorder", (Recorder,), {event: handler(event) for event in EVENTS})


class Counter(TaskCallback):
    """A user callback with state: the tasks it saw, and a tensor."""

    def __init__(self) -> None:
        self.tasks: list[str] = []
        self.total = torch.zeros(2)

    def on_task_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.tasks.append(state.task_name)
        self.total += 1

    def state_dict(self) -> dict:
        return {"tasks": list(self.tasks), "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.tasks, self.total = list(state["tasks"]), state["total"].clone()


class OptimizerStateProbe(TaskCallback):
    """A weak reference to one AdamW moment of each trained task; whether each is still alive when a task begins."""

    def __init__(self) -> None:
        self.moments: list[weakref.ref] = []
        self.alive_at_task_begin: list[list[bool]] = []

    def on_task_trained(self, args, state, control, **kwargs):  # noqa: ANN001
        self.moments.append(weakref.ref(next(iter(kwargs["trainer"].optimizer.state.values()))["exp_avg"]))

    def on_task_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self.alive_at_task_begin.append([moment() is not None for moment in self.moments])


def _learner(tmp_path, callbacks, tasks: int = 2, **options) -> ContinualLearner:
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:tasks]
    args = ContinualArguments(
        output_dir=str(tmp_path / "run"), progress=False, evaluation={"initial": False},
        training={"per_device_train_batch_size": 8, "num_train_epochs": 1, "logging_steps": 1}, **options,
    )
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods("finetune"), load_image_processor(32),
                            load_tokenizer(), args, task_callbacks=callbacks)


def test_events_in_order_with_their_arguments(tmp_path):
    recorder, optimizer_probe = _make_recorder_class()(), OptimizerStateProbe()
    learner = _learner(tmp_path, [recorder, optimizer_probe])
    learner.fit()
    # the previous task's optimizer state is gone before the next task trains (it held 8 B per parameter)
    assert len(optimizer_probe.moments) == 2 and optimizer_probe.alive_at_task_begin == [[], [False]]
    names = [event for event, _, _ in recorder.events]
    per_task = ["on_task_begin", "on_train_begin", "on_task_trained", "on_task_evaluated", "on_task_end", "on_save",
                "on_save", "on_checkpoint_saved"]  # the task folder, then the run folder
    assert names == ["on_stream_begin", *per_task, *per_task, "on_save", "on_stream_end"]
    kwargs = {event: keys for event, _, keys in recorder.events}
    assert kwargs["on_train_begin"] == ("collator", "context", "train_dataset", "trainer")
    assert kwargs["on_task_evaluated"] == ("context", "metrics")
    assert kwargs["on_checkpoint_saved"] == ("folder",) and kwargs["on_stream_end"] == ("error",)
    assert [index for event, index, _ in recorder.events if event == "on_task_begin"] == [0, 1]
    # the built-in callbacks wrote their files before the user's on_save saw the folder (the manifest comes after)
    assert {"compute.json", "README.md", "continual_state.json"} <= recorder.saved_files[0]
    assert "checkpoint_manifest.json" not in recorder.saved_files[0]
    compute = json.loads((tmp_path / "run" / "task-1" / "compute.json").read_text())
    assert [record["optimizer_steps"] for record in compute["tasks"]] == [2, 2] == [
        record.optimizer_steps for record in learner.compute]


def test_should_stop_ends_the_stream_after_the_task_and_a_resume_restores_every_callback_state(tmp_path):
    learner = _learner(tmp_path, [_make_recorder_class()(stop_after=0), Counter()])
    matrix = learner.fit()
    assert (tmp_path / "run" / "task-0" / "checkpoint_manifest.json").exists()
    assert not (tmp_path / "run" / "task-1").exists()
    assert [row.label for row in matrix.rows] == [learner.stream[0].name]
    saved = json.loads((tmp_path / "run" / "task-0" / "callback_state.json").read_text())
    assert set(saved) == {"compute", "spatial_disorder", "Counter"}  # the stateful ones, by state_key
    # the resumed run's callbacks start from their saved state, through the same protocol as the methods'
    counter = Counter()
    resumed = _learner(tmp_path, [counter], resume_from_checkpoint=True)
    resumed.fit()
    names = [task.name for task in resumed.stream]
    assert counter.tasks == names and counter.total.tolist() == [2.0, 2.0]
    assert [record.task for record in resumed.compute] == names
    saved_seconds = {phase: value for phase, value in learner.compute[0].seconds.items() if phase != "checkpoint"}
    assert resumed.compute[0].seconds == saved_seconds  # task 0's record, as saved (before its checkpoint's time)
    assert resumed.global_step == 4


def test_a_checkpoint_without_callback_state_restores_the_built_in_callbacks_from_their_files(tmp_path):
    """Checkpoints written before the callbacks' state protocol (no callback_state.json) keep resuming: compute
    records from compute.json, the spatial-disorder reference from its safetensors file; a user callback starts
    afresh."""
    from safetensors.torch import save_file

    from hf_ccl.evaluation.spatial_disorder import REFERENCE_FILE, SpatialDisorderCallback

    folder = tmp_path / "task-0"
    folder.mkdir()
    records = {"tasks": [{"task": "a", "optimizer_steps": 3, "global_batch": 8, "samples_seen": 24, "macs": 1.0}],
               "run": {"startup_seconds": 2.0, "initial_eval_seconds": 0.5, "launches": 1}}
    (folder / "compute.json").write_text(json.dumps(records))
    save_file({"images": torch.ones(2, 4), "texts": torch.zeros(2, 4), "correct": torch.tensor([True, False])},
              str(folder / REFERENCE_FILE))
    save_method_states([], folder)  # the methods' file, as every checkpoint has
    compute, disorder, counter = ComputeCallback(), SpatialDisorderCallback(), Counter()
    restore_states(folder, [], [compute, disorder, counter])
    assert [(r.task, r.optimizer_steps) for r in compute.records] == [("a", 3)] and compute.run.launches == 1
    assert disorder.reference is not None and disorder.reference.correct.tolist() == [True, False]
    assert counter.tasks == []
    # written through the protocol, the same states come back
    save_states(folder, [], [compute, disorder, counter])
    write_manifest(folder)
    again = ComputeCallback(), SpatialDisorderCallback(), Counter()
    restore_states(folder, [], list(again))
    assert again[0].records == compute.records and again[0].run == compute.run
    assert torch.equal(again[1].reference.images, disorder.reference.images)
    shutil.rmtree(folder)


def test_two_callbacks_saving_state_under_one_key_are_refused(tmp_path):
    with pytest.raises(ValueError, match="Counter and Counter both save their state as 'Counter'"):
        _learner(tmp_path, [Counter(), Counter()])


def test_stream_end_sees_the_error(tmp_path):
    class Failing(TaskCallback):
        def on_task_trained(self, args, state, control, **kwargs):  # noqa: ANN001
            raise RuntimeError("boom")

    class Ending(TaskCallback):
        error: BaseException | None = None

        def on_stream_end(self, args, state, control, **kwargs):  # noqa: ANN001
            Ending.error = kwargs["error"]

    with pytest.raises(RuntimeError, match="boom"):
        _learner(tmp_path, [Failing(), Ending()], tasks=1).fit()
    assert isinstance(Ending.error, RuntimeError)


def test_a_trainer_callback_is_refused_as_a_task_callback(tmp_path):
    with pytest.raises(TypeError, match="TaskCallback instances, got TrainerCallback"):
        _learner(tmp_path, [TrainerCallback()])
