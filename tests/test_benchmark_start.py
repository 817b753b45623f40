"""benchmarks/pretrain_start.py (the benchmarks' starting model) and the scripts that start from it: the pretraining
mix holds every captioned source and templated Caltech-101 and none of the held-out datasets; the cache key follows
the recipe; mtil.py and forgetting.py (`--size start`) run end to end on a tiny starting model (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import pretrain_start  # noqa: E402  (benchmarks/ is not a package)

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 32}


def test_the_pretraining_mix_holds_the_captioned_sources_and_templated_caltech(shared_data_root):
    (task,) = pretrain_start.pretraining_stream(shared_data_root)
    assert task.kind == "retrieval" and task.name == "pretraining-mix"
    sources = Counter(image_id.split("/")[0] for image_id in task.train["image_id"])
    assert dict(sources) == {"flickr8k": 6000, "fashion": 1608, "caltech101": 6096}
    assert set(task.train["label"]) == {-1}  # captions: no class of any task
    caltech = next(row for row in task.train if row["image_id"].startswith("caltech101/"))
    assert len(caltech["texts"]) == 34 and len(set(caltech["texts"])) == 34  # one per CLIP_benchmark template
    assert {i.split("/")[0] for i in task.eval["image_id"]} == {"flickr8k"}
    held_out = {"cifar10", "dtd10", "pacs", "rsscn7", "mnist", "gtsrb"}
    assert not held_out & set(sources) and set(pretrain_start.HELD_OUT) == held_out


def test_the_cache_folder_follows_every_part_of_the_recipe(tmp_path):
    folder = pretrain_start.start_model_folder(TINY, pretrain_start.RECIPE, tmp_path)
    assert folder.parent == tmp_path and folder.name.startswith("start-")
    for change in ({"epochs": 1.0}, {"seed": 1}, {"lr": 5e-4}, {"batch_size": 64}):
        assert pretrain_start.start_model_folder(TINY, {**pretrain_start.RECIPE, **change}, tmp_path) != folder
    assert pretrain_start.start_model_folder({**TINY, "num_layers": 2}, pretrain_start.RECIPE, tmp_path) != folder


def _script(tmp_path: Path, name: str, *argv: str) -> subprocess.CompletedProcess:
    start = ["--start-model", json.dumps(TINY), "--start-epochs", "0.02", "--start-cache", str(tmp_path / "cache")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *argv, *start, "--seeds", "0",
                           "--output", str(tmp_path / "out" / "table"), "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)


@pytest.mark.slow
def test_mtil_from_the_starting_model_end_to_end(tmp_path):
    done = _script(tmp_path, "mtil.py", "--methods", "finetune,wise_ft", "--train-per-task", "16",
                   "--eval-per-task", "20", "--control-examples", "20", "--epochs", "1", "--batch-size", "8",
                   "--order", "I,II")
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| chance / majority |" in table and "| zero-shot model |" in table
    assert "WiSE-FT keeps Transfer better than fine-tuning" in table
    runs = json.loads((tmp_path / "out" / "table.json").read_text())["runs"]
    assert {(r["method"], r["order"]) for r in runs} == {(m, o) for m in ("finetune", "wise_ft") for o in ("I", "II")}
    assert all(len(r["control"]) == 5 and 0 <= r["plasticity"] <= 100 for r in runs)


@pytest.mark.slow
def test_forgetting_from_the_starting_model_with_method_options(tmp_path):
    done = _script(tmp_path, "forgetting.py", "--stream", "pacs-domains", "--size", "start",
                   "--methods", "finetune,modx:alpha=5", "--train-per-task", "16", "--eval-per-task", "14",
                   "--control-examples", "20", "--epochs", "1", "--batch-size", "8", "--order", "I")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "out" / "table.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["finetune", "modx:alpha=5"]
    assert all(len(r["control"]) == 4 for r in runs)
