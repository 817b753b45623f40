"""benchmarks/families.py, one table of every family on the same streams: which methods it compares (and why not the
others), its options, the table's rows for runs, refusals and failures, and a smoke run end to end (about 12 s, marked slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_ccl.methods import build_methods
from hf_ccl.methods.registry import available_methods
from hf_ccl.testing import TINY_CLIP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families  # noqa: E402  (benchmarks/ is not a package)


def _parse(tmp_path: Path, *argv: str):
    return families.parse([*argv, "--runs-dir", str(tmp_path / "runs")])


def test_every_registered_method_is_compared_or_listed_with_a_reason():
    listed = set(families.FAMILIES) | {name for key in families.NOT_COMPARED for name in key.split(", ")}
    assert set(available_methods()) == listed
    assert families.METHODS.split(",") == list(families.FAMILIES)
    assert set(families.WHY) == set(families.FAMILIES)


def test_every_compared_method_builds_with_its_configuration(tmp_path):
    options = _parse(tmp_path)
    for name in families.FAMILIES:
        (method,) = build_methods([name], families.family_args(name, options))
        assert method.name == name
    assert families.family_args("prompt", options) == {"prompt": {"ctx_init": "a photo of a", "schedule": "shared"}}
    assert families.family_args("ctp", options)["ctp"]["queue_size"] == 4 * options.batch_size
    assert [families.learning_rate(n, options) for n in ("finetune", "moe_adapters", "lora", "prompt")] == [
        options.lr, options.moe_lr, options.lora_lr, options.prompt_lr]


def test_smoke_changes_the_defaults_and_given_options_still_win(tmp_path):
    options = _parse(tmp_path, "--smoke", "--train-per-task", "12")
    assert options.train_per_task == 12
    assert (options.eval_per_task, options.start_model, options.seeds, options.order) == (16, TINY_CLIP, [0], ["I"])
    full = _parse(tmp_path)
    assert (full.train_per_task, full.epochs, full.seeds, full.order, full.start_model) == (
        300, 1.0, [0, 1], ["I"], families.MODEL)
    # ZSCL averages every 100 of 1000 steps: a tenth of a task's 5 steps rounds to every step
    assert full.ensemble_every == 1 and _parse(tmp_path, "--train-per-task", "6400").ensemble_every == 10


@pytest.mark.parametrize("argv, message", [
    (["--methods", "finetune,nope"], "Unknown method 'nope'"),
    (["--methods", "er,er"], "each method once"),
    (["--streams", "digits"], "unknown ['digits']"),
    (["--tasks", "photo,nope"], "['nope'] belong to none"),
    (["--train-per-task", "0"], "must be > 0"),
    (["--order", "III"], "unknown order"),
    (["--start-model", "[1]"], "JSON object"),
])
def test_a_wrong_option_is_refused_before_anything_runs(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        _parse(tmp_path, *argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_tasks_go_to_the_stream_they_belong_to(tmp_path):
    options = _parse(tmp_path, "--tasks", "sketch,cifar10,photo")
    assert families.stream_tasks("pacs-domains", options) == ["sketch", "photo"]
    assert families.stream_tasks("mtil-heldout", options) == ["cifar10"]
    assert families.stream_tasks("mtil-heldout", _parse(tmp_path, "--tasks", "photo")) is None


def _run(method: str, seed: int, last: float, transfer: float) -> dict:
    cost = {"wall_s": 1.0, "train_s": 0.5, "eval_s": 0.3, "methods_s": 0.1, "peak_rss_bytes": 2**20,
            "peak_cuda_bytes": None, "trainable_parameters": 10, "method_state_bytes": 0, "samples": 8, "macs": 1e6}
    return {"stream": "pacs-domains", "method": method, "seed": seed, "order": "I", "tasks": ["photo", "sketch"],
            "R": [[last, transfer], [last - 1, last + 1]], "last": last, "average": last, "transfer": transfer, "transfer_above": float("nan"), "plasticity": last,
            "forgetting": 0.0, "control_last": 5.0, "zero_shot": 20.0, "zero_shot_transfer": 15.0,
            "zero_shot_transfer_above": float("nan"), "median_step_s": 0.1 * (2 if method == "er" else 1),
            "cost": cost}


def test_the_table_lists_runs_refusals_failures_and_verdicts_against_finetune():
    runs = [_run("finetune", s, 30.0 + s, 10.0) for s in range(3)] + [_run("er", s, 40.0 + s, 9.0 + s) for s in
                                                                       range(3)]
    baseline = {"task": "photo", "n": 16, "n_classes": 7, "chance": 100 / 7, "majority": 18.75, "score": 25.0}
    start = {"control": 7.0, "streams": {"pacs-domains": {"tasks": ["photo", "sketch"], "above": [True, False],
                                                          "baselines": [baseline, {**baseline, "task": "sketch"}]}}}
    lines = families.stream_table(
        "pacs-domains", runs, {("pacs-domains", "cllclip"): "no | pipes"},
        {("pacs-domains", "gem"): ["ValueError: boom"]}, ["finetune", "er", "gem", "cllclip"], start)
    text = "\n".join(lines)
    assert "| photo | 7 | 16 | 14.3 | 18.8 | 25.0 ± 10.8 |" in text
    assert "| zero-shot model | | 20.0 ± 0.0 | 20.0 ± 0.0 | 15.0 ± 0.0 |" in text
    er = next(line for line in lines if line.startswith("| er |"))
    assert "| 41.0 ± 0.8 |" in er and "| 2.00 |" in er  # mean ± std over seeds; its step time vs finetune's
    assert "| gem | gradient projection | **failed** in 1 of 1 runs: ValueError: boom |" in text
    assert "cannot run here: no \\| pipes |" in text
    header = next(line for line in lines if line.startswith("| method | family | Last"))
    rows = [line for line in lines if line.startswith(("| er | replay", "| gem |", "| cllclip |"))]
    assert len(rows) == 3 and all(line.count(" |") == header.count(" |") for line in rows)  # every column there
    assert "| chance / majority | 14.3 / 18.8 | 14.3 / 18.8 |\n| finetune | 30.0 ± 11.5 | 32.0 ± 11.7 |" in text
    assert "| er's Last is above finetune's | +10.00 | [+10.00, +10.00] | 3 | holds |" in text
    assert "| er keeps Transfer better than finetune | +0.00 |" in text


@pytest.mark.slow
def test_a_smoke_run_writes_the_table_the_json_and_the_plot(tmp_path):
    output = tmp_path / "out" / "families"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "families.py"), "--smoke", "--methods", "finetune,er,learner_heads",
         "--streams", "pacs-domains", "--start-cache", str(tmp_path / "cache"), "--runs-dir", str(tmp_path / "r"),
         "--output", str(output)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(output.with_suffix(".json").read_text())
    assert [(r["stream"], r["method"]) for r in record["runs"]] == [("pacs-domains", "finetune"), ("pacs-domains", "er")]
    assert [r["method"] for r in record["refused"]] == ["learner_heads"] and record["failed"] == []
    table = output.with_suffix(".md").read_text()
    assert "| learner_heads |  | cannot run here: learner_heads trains pair tasks" in table
    assert output.with_suffix(".png").stat().st_size > 0
