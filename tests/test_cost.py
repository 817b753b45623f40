"""What a run costs (`hf_ccl.compute`): wall time by phase, peak memory, trainable parameters and method state, in
`compute.json`, the `cost` section of `results.json`, `results.md`, the printed summary, the model card and the
stream's logs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard

from hf_ccl.compute import (
    METHOD_PHASES,
    PHASES,
    TaskCompute,
    compute_summary,
    cost_totals,
    mean_run_cost,
    peak_memory,
    phase_timer,
    reset_peak_memory,
    run_cost,
    run_cost_cells,
    state_bytes,
    trainable_parameter_count,
)
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.evaluation.matrix import ResultsMatrix
from hf_ccl.methods import build_methods
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
    def record(task: str, seconds: dict[str, float], rss: int, trainable: int, state: dict[str, int]) -> TaskCompute:
        return TaskCompute(task, 10, 4, 40, 1e6, 3.0, 1.2e8, seconds, rss, None, trainable, 100, state)

    records = [record("a", {"train": 2.0, "eval": 1.0, "task_end": 0.5}, 300, 50, {"ewc": 10}),
               record("b", {"train": 3.0, "eval": 1.5, "task_start": 0.25, "checkpoint": 0.75}, 200, 60,
                      {"ewc": 20, "er": 4})]
    cost = run_cost(records)
    assert cost == {"wall_s": 9.0, "train_s": 5.0, "eval_s": 2.5, "methods_s": 0.75, "peak_rss_bytes": 300,
                    "peak_cuda_bytes": None, "trainable_parameters": 60, "method_state_bytes": 24, "samples": 80,
                    "macs": 2.4e8}
    other = dict(cost, wall_s=11.0, peak_rss_bytes=500)
    mean = mean_run_cost([cost, other])
    assert mean["wall_s"] == 10.0 and mean["peak_rss_bytes"] == 400 and mean["peak_cuda_bytes"] is None
    assert run_cost_cells(mean) == "10.0 | 5.0 | 2.5 | 0.8 | 400 B | 60 | 24 B | 80 | 2.40e+08"


def test_peak_memory_sees_an_allocation_after_the_reset():
    reset_peak_memory()
    before, _ = peak_memory()
    block = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
    after, cuda = peak_memory()
    assert after - before >= 0.9 * block.nbytes
    assert cuda is None or cuda >= 0


def test_trainable_parameters_count_frozen_towers_out():
    model = tiny_clip(seed=0)
    trainable, total = trainable_parameter_count(model)
    assert trainable == total == sum(p.numel() for p in model.parameters())
    for parameter in model.vision_model.parameters():
        parameter.requires_grad_(False)
    trainable, total = trainable_parameter_count(model)
    assert trainable == total - sum(p.numel() for p in model.vision_model.parameters())


@pytest.fixture(scope="module")
def ewc_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("cost") / "run"
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:2]
    args = ContinualArguments(output_dir=str(output_dir), progress=False,
                              training={"per_device_train_batch_size": 8, "max_steps": 2})
    learner = ContinualLearner(tiny_clip(seed=0), stream, build_methods("ewc"), load_image_processor(32),
                               load_tokenizer(), args)
    learner.fit()
    return learner, output_dir


def test_every_task_records_its_cost(ewc_run):
    learner, output_dir = ewc_run
    trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    for index, record in enumerate(learner.compute):
        assert set(record.seconds) == set(PHASES)  # the run folder's copy has every phase, checkpoints included
        assert record.seconds["train"] > 0 and record.seconds["eval"] > 0 and record.seconds["task_end"] > 0
        assert record.wall_seconds == pytest.approx(sum(record.seconds.values()))
        assert record.method_seconds == pytest.approx(sum(record.seconds[p] for p in METHOD_PHASES))
        assert record.trainable_parameters == record.total_parameters == trainable
        assert record.peak_rss_bytes > 0
        # EWC keeps a Fisher diagonal and an anchor of every trained parameter (float32)
        assert record.method_state_bytes["ewc"] >= 2 * 4 * trainable
        own = json.loads((output_dir / f"task-{index}" / "compute.json").read_text())["tasks"][index]
        assert "checkpoint" not in own["seconds"]  # the task's own checkpoint is written after it
        assert own["seconds"]["train"] == record.seconds["train"]


def test_cost_reaches_results_json_markdown_and_the_card(ewc_run):
    learner, output_dir = ewc_run
    saved = json.loads((output_dir / "results.json").read_text())
    assert [task["task"] for task in saved["cost"]["tasks"]] == learner.stream.task_names
    totals = cost_totals(saved["cost"]["tasks"])
    assert saved["cost"]["total_wall_seconds"] == pytest.approx(totals["total_wall_seconds"])
    assert 0 < saved["cost"]["eval_share"] < 1
    assert ResultsMatrix.load(output_dir).cost == saved["cost"]["tasks"]  # read back
    markdown = (output_dir / "results.md").read_text()
    assert "## Cost" in markdown and "| **total** |" in markdown
    card = ModelCard.load(output_dir / "task-1" / "README.md")
    assert "### Cost" in card.content and "peak RSS" in card.content
    summary = compute_summary(learner.compute)
    assert "Cost per task" in summary and "evaluation" in summary


def test_older_compute_files_without_cost_still_read(ewc_run):
    record = TaskCompute(task="t", optimizer_steps=1, global_batch=2, samples_seen=2, forward_macs_per_sample=1.0,
                         forward_passes_per_sample=3.0, macs=6.0)
    assert record.seconds == {} and record.peak_rss_bytes is None
    assert "Cost per task" not in compute_summary([record])  # nothing measured: no cost lines, never zeros
