"""`training.report_to` gives one logging run per stream: TensorBoard event files read back after a tiny 3-task run
on digits, a mid-task resume, and the CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import struct
from collections import defaultdict
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2
from transformers import TrainerCallback

from hf_ccl.cli import main
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.evaluation.matrix import ResultsMatrix
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

# 32 training examples per task at batch 16: 2 steps per epoch; the first task trains 2 epochs. Global steps:
# task 0 -> 1..4, task 1 -> 5..6, task 2 -> 7..8. A Trainer checkpoint after every step (for the resume test).
TRAINING = {
    "num_train_epochs": 1, "per_device_train_batch_size": 16, "learning_rate": 1e-3, "logging_steps": 1,
    "report_to": ["tensorboard"], "save_strategy": "steps", "save_steps": 1,
}
TASK_ENDS = [4, 6, 8]
FLOAT32 = 1e-6  # TensorBoard stores float32 scalars


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every event file in `run_dir`: tag -> [(step, value), ...] in write order. (tensorboardX
    writes TFRecords: length, its CRC, the Event proto, its CRC.)"""
    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, position = path.read_bytes(), 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position:position + 8])
            event = event_pb2.Event.FromString(data[position + 12:position + 12 + length])
            position += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars[value.tag].append((event.step, value.simple_value))
    return scalars


def the_run_dir(output_dir: Path) -> Path:
    """The one TensorBoard run of `output_dir` (and no event file anywhere else in it)."""
    runs = [path for path in (output_dir / "runs").iterdir() if path.is_dir()]
    assert len(runs) == 1, runs
    events = list(output_dir.rglob("events.out.tfevents.*"))
    assert events and all(path.parent == runs[0] for path in events), events
    return runs[0]


def steps(series: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in series]


class StepRecorder(TrainerCallback):
    """A user callback: the steps it is shown at each log."""

    def __init__(self):
        self.steps: list[int] = []

    def on_log(self, args, state, control, **kwargs):  # noqa: ANN001
        self.steps.append(state.global_step)


def run_stream(output_dir: Path, resume: bool = False, callbacks: tuple = ()) -> ContinualLearner:
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=16)
    stream.tasks = stream.tasks[:3]
    args = ContinualArguments(output_dir=str(output_dir), training=dict(TRAINING), first_task_epochs=2,
                              progress=False, seed=2, resume_from_checkpoint=True if resume else None,
                              keep_trainer_checkpoints=True)
    learner = ContinualLearner(tiny_clip(seed=2), stream, build_methods(["finetune"]), load_image_processor(32),
                               load_tokenizer(), args, callbacks=list(callbacks))
    learner.fit()
    return learner


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("stream-logging")
    return output_dir, run_stream(output_dir, callbacks=[StepRecorder()])


def test_one_run_with_a_global_step_across_tasks(reference):
    output_dir, learner = reference
    scalars = read_scalars(the_run_dir(output_dir))
    assert steps(scalars["train/loss"]) == list(range(1, 9))  # no restart at a task boundary
    assert steps(scalars["train/learning_rate"]) == list(range(1, 9))
    assert steps(scalars["train/train_runtime"]) == TASK_ENDS  # each task's Trainer summary, at its last step
    assert learner.global_step == 8
    recorder = next(c for c in learner.callbacks if isinstance(c, StepRecorder))
    assert recorder.steps == [1, 2, 3, 4, 4, 1, 2, 2, 1, 2, 2]  # user callbacks keep each task's own steps
    assert json.loads((output_dir / "task-2" / "continual_state.json").read_text())["global_step"] == 8


def test_matrix_summary_and_compute_logged_at_each_task_end(reference):
    output_dir, learner = reference
    scalars = read_scalars(the_run_dir(output_dir))
    results = ResultsMatrix.load(output_dir)
    rows = [results.initial, *results.rows]
    for task in results.task_names:
        for metric in rows[0].metrics[task]:
            series = scalars[f"eval/results/{task}/{metric}"]
            assert steps(series) == [0, *TASK_ENDS], (task, metric)
            expected = [row.metrics[task][metric] for row in rows]
            assert [value for _, value in series] == pytest.approx(expected, rel=FLOAT32, abs=FLOAT32)
    headline = scalars["eval/results/headline_mean"]
    assert steps(headline) == [0, *TASK_ENDS]
    assert headline[-1][1] == pytest.approx(results.headline()[-1].mean(), rel=FLOAT32)
    for name, value in results.summary().items():  # the final derived metrics, at the last task's end
        series = scalars[f"eval/summary/{name}"]
        assert series[-1] == (8, pytest.approx(value, rel=FLOAT32, abs=FLOAT32)), name
    assert steps(scalars["eval/summary/final_average"]) == TASK_ENDS
    assert scalars["train/compute/samples_seen"] == [(4, 64.0), (6, 32.0), (8, 32.0)]
    assert scalars["train/compute/total_samples_seen"] == [(4, 64.0), (6, 96.0), (8, 128.0)]
    assert steps(scalars["train/compute/macs"]) == TASK_ENDS
    assert scalars["train/compute/total_macs"][-1][1] == pytest.approx(sum(r.macs for r in learner.compute), rel=FLOAT32)


def test_resumed_mid_task_run_continues_the_global_step(reference, tmp_path):
    """Resume from task 0's checkpoint and task 1's Trainer checkpoint at its step 1: the new run logs from global
    step 6 on, with the same losses as the uninterrupted run at those steps."""
    output_dir, _ = reference
    shutil.copytree(output_dir / "task-0", tmp_path / "task-0")
    shutil.copytree(output_dir / "trainer" / "task-1" / "checkpoint-1", tmp_path / "trainer" / "task-1" / "checkpoint-1")
    learner = run_stream(tmp_path, resume=True)
    resumed = read_scalars(the_run_dir(tmp_path))
    uninterrupted = read_scalars(the_run_dir(output_dir))
    assert steps(resumed["train/loss"]) == [6, 7, 8]
    assert [v for _, v in resumed["train/loss"]] == pytest.approx([v for _, v in uninterrupted["train/loss"][5:]],
                                                                  rel=FLOAT32)
    assert steps(resumed["eval/results/headline_mean"]) == [6, 8]  # no initial row: it belongs to the first run
    assert learner.global_step == 8


def test_cli_run_logs_one_tensorboard_run(tmp_path):
    overrides = [
        f"output_dir={tmp_path}", "progress=false", "training.max_steps=2", "training.per_device_train_batch_size=16",
        "training.logging_steps=1", "training.report_to=[tensorboard]", "stream_args.max_train_per_task=32",
        "stream_args.max_eval_per_task=8", "model.config.hidden_size=32", "model.config.num_layers=1",
    ]
    assert main(["train", "--config", "recipes/configs/digits.yaml", *overrides]) == 0
    scalars = read_scalars(the_run_dir(tmp_path))
    assert steps(scalars["train/loss"]) == list(range(1, 11))  # 5 tasks x 2 steps
    assert steps(scalars["eval/results/digits-89/accuracy"]) == [0, 2, 4, 6, 8, 10]


@pytest.mark.parametrize(("report_to", "match"), [
    ("[nope]", "training.report_to: nope is not supported, only azure_ml, "),
    ("[tensorboard,wandb]", "training.report_to names 'wandb', which cannot be used here: .*pip install"),
])
def test_cli_unusable_integration_fails_before_anything_is_written(tmp_path, capsys, report_to, match):
    if "wandb" in report_to and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    code = main(["train", "--config", "recipes/configs/digits.yaml", f"output_dir={tmp_path}",
                 f"training.report_to={report_to}"])
    assert code == 2  # refused: a one-line error naming the option
    assert re.search(match, capsys.readouterr().err)
    assert not any(tmp_path.iterdir())


@pytest.mark.multiprocess
def test_two_processes_log_one_run_from_the_main_process(tmp_path):
    from test_distributed import launch_two_processes

    launch_two_processes(Path(__file__).parent / "scripts" / "two_process_logging.py", str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [report["world_size"] for report in reports] == [2, 2]
    assert [report["global_step"] for report in reports] == [6, 6]
    run = the_run_dir(tmp_path / "run")
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # one writer: the main process's
    scalars = read_scalars(run)
    assert steps(scalars["train/loss"]) == [1, 2, 3, 4, 5, 6]
    assert steps(scalars["eval/results/headline_mean"]) == [0, 3, 6]
