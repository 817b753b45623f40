"""What a run costs (`hf_ccl.compute`, `hf_ccl.step_meter`): samples counted from the batches (partial ones as they
are), MACs measured per step shape, wall time by phase with the run's start-up and initial evaluation, peak memory,
trainable parameters and method state, in `compute.json`, the `cost` section of `results.json`, `results.md`, the
printed summary and the model card; the total is the wall time a user measures, less a small stated remainder."""

from __future__ import annotations

import json
import mmap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from torch.utils.flop_counter import FlopCounterMode

from hf_ccl import compute
from hf_ccl.cli import main
from hf_ccl.compute import (
    METHOD_PHASES,
    METHOD_STATE_STEM,
    PHASES,
    ComputeCallback,
    TaskCompute,
    compute_summary,
    cost_table,
    cost_totals,
    mean_run_cost,
    peak_memory,
    phase_timer,
    reset_peak_memory,
    run_cost,
    run_cost_cells,
    saved_method_bytes,
    state_bytes,
    stored_method_bytes,
    trainable_parameter_count,
)
from hf_ccl.evaluation.matrix import ResultsMatrix
from hf_ccl.methods import build_methods, save_method_states
from hf_ccl.methods.state import STATE_JSON, STATE_STEM, STATE_TENSORS
from hf_ccl.step_meter import StepMeter, batch_rows, step_shape
from hf_ccl.testing import tiny_clip


def test_phase_timer_adds_up_and_counts_a_failing_block():
    seconds: dict[str, float] = {}
    with phase_timer(seconds, "eval"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), phase_timer(seconds, "eval"):
        time.sleep(0.01)
        raise RuntimeError("boom")
    assert seconds["eval"] >= 0.02
    with pytest.raises(ValueError, match="unknown phase 'evaluation'"), phase_timer(seconds, "evaluation"):
        pass


def test_state_bytes_by_hand():
    # 3 float32 (12 B) + 2 int64 (16 B) + the key lengths (1 + 1 + 5) + JSON of 7 ("7": 1 B) and of "ab" (4 B)
    state = {"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.int64), 7], "count": "ab"}
    assert state_bytes(state) == 12 + 16 + 1 + 1 + 5 + 1 + 4


def test_run_cost_of_two_tasks_by_hand_and_its_mean_over_seeds():
    def record(task: str, seconds: dict[str, float], rss: int, trainable: int, state: dict[str, int],
               step: float | None, storage: int | None) -> TaskCompute:
        return TaskCompute(task, 10, 4, 40, 1.2e8, seconds, rss, None, trainable, 100, state, macs_measured=True,
                           median_step_seconds=step, extra_storage_bytes=storage)

    records = [record("a", {"train": 2.0, "eval": 1.0, "task_end": 0.5}, 300, 50, {"ewc": 10}, 0.25, 1000),
               record("b", {"train": 3.0, "eval": 1.5, "task_start": 0.25, "checkpoint": 0.75}, 200, 60,
                      {"ewc": 20, "er": 4}, 0.5, 3000),
               record("c", {"train": 1.0}, 100, 60, {"ewc": 20, "er": 4}, 0.125, 2000)]
    cost = run_cost(records)
    # time/step: the median of the tasks' medians (0.125, 0.25, 0.5); extra storage: the largest on disk
    assert cost == {"wall_s": 10.0, "train_s": 6.0, "eval_s": 2.5, "methods_s": 0.75, "peak_rss_bytes": 300,
                    "peak_cuda_bytes": None, "trainable_parameters": 60, "method_state_bytes": 24, "samples": 120,
                    "macs": 3.6e8, "step_s": 0.25, "extra_storage_bytes": 3000}
    other = dict(cost, wall_s=12.0, peak_rss_bytes=500, step_s=0.5)
    mean = mean_run_cost([cost, other])
    assert mean["wall_s"] == 11.0 and mean["peak_rss_bytes"] == 400 and mean["peak_cuda_bytes"] is None
    assert run_cost_cells(mean) == "11.0 | 6.0 | 2.5 | 0.8 | 0.375 | 400 B | 60 | 2.9 KiB | 120 | 3.60e+08"
    # a cost recorded before these columns existed (older results) shows them as missing
    old = {key: value for key, value in cost.items() if key not in ("step_s", "extra_storage_bytes")}
    assert run_cost_cells(mean_run_cost([old])) == "10.0 | 6.0 | 2.5 | 0.8 | - | 300 B | 60 | - | 120 | 3.60e+08"


def test_peak_memory_sees_an_allocation_after_the_reset():
    size = 64 * 1024 * 1024
    reset_peak_memory()
    before, _ = peak_memory()
    # 64 MiB of fresh pages, touched: an anonymous mapping, since malloc may hand out memory the process already holds
    # (a long-lived test process, e.g. a pytest-xdist worker, has freed heap that is still resident)
    block = mmap.mmap(-1, size)
    np.frombuffer(block, dtype=np.uint8)[:] = 1
    after, cuda = peak_memory()
    assert after - before >= 0.9 * size
    assert cuda is None or cuda >= 0


def test_trainable_parameters_count_frozen_towers_out():
    model = tiny_clip(seed=0)
    trainable, total = trainable_parameter_count(model)
    assert trainable == total == sum(p.numel() for p in model.parameters())
    for parameter in model.vision_model.parameters():
        parameter.requires_grad_(False)
    trainable, total = trainable_parameter_count(model)
    assert trainable == total - sum(p.numel() for p in model.vision_model.parameters())


def _batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 100 + length)
    return {"input_ids": torch.randint(1, 400, (rows, length), generator=generator),
            "attention_mask": torch.ones(rows, length, dtype=torch.long),
            "pixel_values": torch.randn(rows, 3, 32, 32, generator=generator)}


def _forward_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch, return_loss=True).loss.backward()


def test_step_meter_counts_rows_and_each_shapes_measured_forward_and_backward():
    model, meter = tiny_clip(seed=0), StepMeter()
    full, partial = _batch(8, 7), _batch(3, 7)
    for batch in (full, full, partial):  # an epoch of 19 rows at batch 8: 8, 8, 3
        meter.batch(batch)
        with meter.step([batch]):
            _forward_backward(model, batch)
    assert meter.samples == 19 and batch_rows(partial) == 3
    assert meter.steps == {step_shape([full]): 2, step_shape([partial]): 1}
    by_hand = {}
    for name, batch in (("full", full), ("partial", partial)):  # what one step of each shape multiplies
        counter = FlopCounterMode(display=False)
        with counter:
            _forward_backward(model, batch)
        by_hand[name] = counter.get_total_flops() / 2
        forward = FlopCounterMode(display=False)
        with torch.no_grad(), forward:
            model(**batch)
        assert 2 < by_hand[name] / (forward.get_total_flops() / 2) < 3  # measured, not "3 x forward"
    assert meter.macs == 2 * by_hand["full"] + by_hand["partial"]
    with meter.step([full]), meter.hooks():  # a known shape is not measured again, nor are its hooks
        pass
    assert meter.macs == 3 * by_hand["full"] + by_hand["partial"]
    restored = StepMeter()
    restored.load_state_dict(json.loads(json.dumps(meter.state_dict())))  # as a mid-task checkpoint keeps it
    assert (restored.samples, restored.macs) == (meter.samples, meter.macs)
    restored.unmeasured_steps = 2  # steps a resume found no counts for: at the measured steps' mean
    assert restored.macs == pytest.approx(meter.macs * (1 + 2 / 4))


def test_step_meter_times_each_step_from_its_start_to_the_next_ones():
    meter, batch = StepMeter(), _batch(2, 7)
    assert meter.median_step_seconds is None
    for pause in (0.0, 0.05, 0.01, 0.02):  # the pause before each step is part of the previous step's time
        time.sleep(pause)
        with meter.step([batch]):
            pass
    assert len(meter.step_seconds) == 3  # 4 steps, 3 intervals
    assert [round(value, 2) for value in meter.step_seconds] == pytest.approx([0.05, 0.01, 0.02], abs=0.01)
    assert meter.median_step_seconds == sorted(meter.step_seconds)[1]
    restored = StepMeter()
    restored.load_state_dict(json.loads(json.dumps(meter.state_dict())))  # a mid-task checkpoint keeps them ...
    with restored.step([batch]):
        pass
    assert restored.step_seconds == meter.step_seconds  # ... and the first step after a resume starts a new interval


def test_extra_storage_is_the_method_state_files_on_disk(tmp_path, monkeypatch):
    """What a run without checkpoints measures in a temporary folder is what a checkpoint's files take."""
    (method,) = build_methods(["wise_ft"])
    method.finetuned = {"w": torch.zeros(100, 3)}  # 1,200 bytes of tensor
    save_method_states([method], tmp_path)
    on_disk = sum((tmp_path / name).stat().st_size for name in (STATE_JSON, STATE_TENSORS))
    assert stored_method_bytes(tmp_path) == saved_method_bytes([method]) == on_disk > 1200
    assert stored_method_bytes(tmp_path / "nothing") == 0
    assert METHOD_STATE_STEM == STATE_STEM
    # A run resumed from this checkpoint fills in its task's extra storage (which the checkpoint could not hold)
    # once it trains on; a finished run resumed only to rewrite its files keeps them as the checkpoint has them.
    callback = ComputeCallback()
    callback.records = [TaskCompute("t", 1, 2, 2, 6.0)]
    callback.on_restore(None, None, None, folder=tmp_path)
    assert callback.records[0].extra_storage_bytes is None
    callback.on_task_begin(None, None, None)
    assert callback.records[0].extra_storage_bytes == on_disk

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compute, "save_states", full_disk)
    assert saved_method_bytes([method]) is None  # unmeasured, and the run goes on


TINY_RUN = ["model.config.hidden_size=32", "model.config.num_layers=1", "stream_args.max_train_per_task=20",
            "stream_args.max_eval_per_task=8", "training.num_train_epochs=1", "training.per_device_train_batch_size=8",
            "methods=[ewc]", "progress=false"]


@pytest.fixture(scope="module")
def ewc_run(tmp_path_factory) -> tuple[Path, float, str]:
    """`hf-ccl train --config digits` (EWC, 5 tasks of 20 rows, batches 8, 8, 4), its wall time measured around the
    call, and what it printed."""
    import contextlib
    import io

    output_dir = tmp_path_factory.mktemp("cost") / "run"
    printed = io.StringIO()
    started = time.time()
    with contextlib.redirect_stdout(printed):
        assert main(["train", "--config", "digits", *TINY_RUN, f"output_dir={output_dir}"], started_at=started) == 0
    return output_dir, time.time() - started, printed.getvalue()


def _records(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "compute.json").read_text())["tasks"]


def test_every_task_records_its_cost(ewc_run):
    output_dir, _, _ = ewc_run
    records = _records(output_dir)
    assert len(records) == 5
    for index, record in enumerate(records):
        assert set(record["seconds"]) == set(PHASES)  # the run folder's copy has every phase, checkpoints included
        seconds = record["seconds"]
        assert seconds["train"] > 0 and seconds["eval"] > 0 and seconds["task_end"] > 0
        # 20 rows at batch 8: steps of 8, 8 and 4 rows; counted as batched (not 3 x 8 = 24)
        assert record["optimizer_steps"] == 3 and record["global_batch"] == 8 and record["samples_seen"] == 20
        assert record["macs_measured"] and record["macs"] > 0 and record["step_shapes"] >= 2
        assert record["trainable_parameters"] == record["total_parameters"] > 0
        assert record["peak_rss_bytes"] > 0
        # 3 steps: 2 intervals from one step's start to the next's, within the task's training time
        assert 0 < record["median_step_seconds"] < seconds["train"]
        assert record["extra_storage_bytes"] == stored_method_bytes(output_dir / f"task-{index}") > (
            record["method_state_bytes"]["ewc"])  # the files: the tensors, their JSON and the config
        typed = TaskCompute.from_dict(record)
        assert typed.wall_seconds == pytest.approx(sum(seconds.values()))
        assert typed.method_seconds == pytest.approx(sum(seconds[phase] for phase in METHOD_PHASES))
        # EWC keeps a Fisher diagonal and an anchor of every trained parameter (float32)
        assert record["method_state_bytes"]["ewc"] >= 2 * 4 * record["trainable_parameters"]
        own = json.loads((output_dir / f"task-{index}" / "compute.json").read_text())["tasks"][index]
        assert "checkpoint" not in own["seconds"] and own["extra_storage_bytes"] is None  # written after it
        assert own["seconds"]["train"] == seconds["train"] and own["samples_seen"] == 20


def test_the_total_is_the_wall_time_a_user_measures(ewc_run):
    """Start-up (imports are done here: the config, the stream, the model) and the initial evaluation are rows of
    their own; with the tasks they make up the wall time measured around the command, less the work after the
    last task (the run folder's files, the printing)."""
    output_dir, outside, _ = ewc_run
    saved = json.loads((output_dir / "compute.json").read_text())
    run = saved["run"]
    assert run["launches"] == 1 and run["startup_seconds"] > 0 and run["initial_eval_seconds"] > 0
    assert saved["total_seconds"]["startup"] == run["startup_seconds"]
    total = saved["total_wall_seconds"]
    assert total == pytest.approx(run["startup_seconds"] + run["initial_eval_seconds"]
                                  + sum(sum(task["seconds"].values()) for task in saved["tasks"]))
    assert 0 <= outside - total < max(1.0, 0.1 * outside), (outside, total)


def test_cost_reaches_results_json_markdown_the_card_and_the_summary(ewc_run):
    output_dir, _, printed = ewc_run
    saved = json.loads((output_dir / "results.json").read_text())
    assert [task["task"] for task in saved["cost"]["tasks"]] == saved["task_names"]
    compute = json.loads((output_dir / "compute.json").read_text())
    totals = cost_totals(saved["cost"]["tasks"], saved["cost"]["run"])
    assert saved["cost"]["run"] == compute["run"]
    assert saved["cost"]["total_wall_seconds"] == pytest.approx(totals["total_wall_seconds"])
    assert saved["cost"]["total_samples_seen"] == 100 and saved["cost"]["macs_measured"]
    assert 0 < saved["cost"]["eval_share"] < 1
    loaded = ResultsMatrix.load(output_dir)  # read back
    assert loaded.cost == saved["cost"]["tasks"] and loaded.cost_run == compute["run"]
    for text in ((output_dir / "results.md").read_text(), ModelCard.load(output_dir / "task-4" / "README.md").content):
        assert "| start-up |" in text and "| initial evaluation |" in text and "| **total** |" in text
        assert "peak RSS" in text and "~" not in text.split("| **total** |")[1].split("\n")[0]
        assert "| time/step (s) |" in text and "| extra storage |" in text
    assert "start-up:" in printed and "initial evaluation:" in printed and "Cost per task" in printed
    assert "digits-89: 20 samples (3 steps of up to 8)" in printed


def test_older_compute_files_read_and_their_macs_show_as_an_estimate():
    older = {"task": "t", "optimizer_steps": 1, "global_batch": 2, "samples_seen": 2, "forward_macs_per_sample": 1.0,
             "forward_passes_per_sample": 3.0, "macs": 6.0, "step_macs": 0.0, "seconds": {"train": 1.0}}
    record = TaskCompute.from_dict(older)
    assert record.macs == 6.0 and not record.macs_measured and record.peak_rss_bytes is None
    assert "| ~6.00e+00 |" in "\n".join(cost_table([record]))
    assert "| start-up |" not in "\n".join(cost_table([record]))  # no run phases recorded: no such rows, never zeros
    bare = TaskCompute(task="t", optimizer_steps=1, global_batch=2, samples_seen=2, macs=6.0)
    assert "Cost per task" not in compute_summary([bare])  # nothing measured: no cost lines, never zeros
