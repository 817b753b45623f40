"""The X-TAIL and class-incremental protocols: the `"all"` class scope (every class of the stream, X-TAIL) in the
evaluator and its scorer hook, X-TAIL's metrics against RAIL's own computation, the streams (bundled, and from a
local Hub server at pinned commits), and the recipes through `hf-ccl train`."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_classification_streams import _cifar_images, _push, _wds_files

import hf_ccl.evaluation.continual_metrics as cm
from hf_ccl.class_prompts import scope_class_names, seen_class_names
from hf_ccl.data import build_stream, load_tokenizer
from hf_ccl.data.cil import (
    CALTECH101_LEFT_OUT,
    CIFAR100_CLIP_ORDER,
    CIFAR100_REPO,
    IMAGENET_R_REPO,
    seed_1993_order,
)
from hf_ccl.data.mtil import MTIL_REPOS
from hf_ccl.data.xtail import XTAIL_DATASETS, XTAIL_TEMPLATES, few_shot_rows, xtail_stream
from hf_ccl.evaluation.schedule import StreamEvaluator
from hf_ccl.families import default_image_processor
from hf_ccl.testing import tiny_model


def _labels(dataset) -> list[int]:
    return dataset.with_format("arrow")["label"].to_pylist()


# ----- the "all" class scope -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=10)
    stream.tasks = stream.tasks[:3]
    return stream


class RecordingScorer(torch.nn.Module):
    """An `EvaluationScorer` that records the candidate names it is given and scores the right class highest when
    `oracle` holds each eval row's true name (None: cosine similarity)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []
        self.oracle: list[str] | None = None

    def class_scores(self, image_embeds, class_embeds, class_names):
        self.calls.append(list(class_names))
        if self.oracle is None:
            return None
        return torch.tensor([[float(name == truth) for name in class_names] for truth in self.oracle])


def test_all_scope_scores_every_class_of_the_stream_and_hands_them_to_the_scorer(digits):
    """X-TAIL (RAIL): before any training, and after each task, every task's images are scored among the classes of
    every task of the stream (seen and unseen), each name once; the scorer hook receives exactly those names."""
    model, tokenizer = tiny_model(), load_tokenizer()
    scorer = RecordingScorer()
    model.add_module("xtail_scorer", scorer)
    processor = default_image_processor(model)
    every = ["zero", "one", "two", "three", "four", "five"]
    for task in digits:
        assert scope_class_names(digits.tasks, 0, task, "all") == every
        assert scope_class_names(digits.tasks, 0, task, "task") is None
    assert scope_class_names(digits.tasks, 1, digits.tasks[2], "seen") == ["zero", "one", "four", "five"]
    evaluator = StreamEvaluator(class_scope="all", cache=False)
    metrics = evaluator.evaluate(model, digits.tasks, processor, tokenizer, batch_size=16, max_length=None, trained=0)
    assert [call for call in scorer.calls if len(call) > 2] == [every] * 3  # the task's own 2, then all 6
    for task in digits:
        assert set(metrics[task.name]) >= {"accuracy", "all_accuracy", "all_top5_accuracy"}
        assert "seen_accuracy" not in metrics[task.name]
        assert metrics[task.name]["all_accuracy"] <= metrics[task.name]["accuracy"]  # more candidates only lose
    task = digits.tasks[1]  # labels index the union: an oracle scorer is right on every row
    scorer.oracle = [task.class_names[label] for label in _labels(task.eval)]
    oracle = evaluator.evaluate(model, [task], processor, tokenizer, batch_size=16, max_length=None, trained=0)
    assert oracle[task.name]["all_accuracy"] == 100.0 == oracle[task.name]["accuracy"]
    assert task.kind_spec.headline("all") == "all_accuracy" and task.kind_spec.headline("seen") == "seen_accuracy"


def test_xtail_metrics_are_rails_computation():
    """RAIL's `primal_RAIL.py` (end of file) computes Transfer on the upper triangle with NumPy masked arrays, Avg.
    as the mean of every cell and Last as the last row's mean: exactly ZSCL's MTIL metrics on the same matrix."""
    R = np.random.default_rng(0).uniform(1, 99, size=(10, 10))
    masked = np.ma.masked_equal(np.triu(R, k=1), 0)
    assert cm.mtil_transfer(R) == pytest.approx(float(np.mean(np.mean(masked, axis=0))))
    assert cm.mtil_average(R) == pytest.approx(float(np.mean(np.mean(R, axis=0))))
    assert cm.mtil_last(R) == pytest.approx(float(np.mean(R[-1, :])))
    small = [[60.0, 10.0, 20.0], [50.0, 70.0, 30.0], [40.0, 65.0, 80.0]]  # by hand
    assert cm.mtil_transfer(small) == pytest.approx((10.0 + (20.0 + 30.0) / 2) / 2)
    assert cm.mtil_average(small) == pytest.approx(425.0 / 9)
    assert cm.mtil_last(small) == pytest.approx(185.0 / 3)


# PROOF's released class-incremental logs (Zhou et al., github.com/zhoudw-zdw/PROOF at 0bb2052,
# `logs/proof/cifar224/0/10/cifarb0.log` and `50/10/cifarb50.log`: PyCIL's seed-1993 order, CLIP ViT-B/16): after
# each step, the accuracy on the test images of every 10-class group seen so far (100 test images per class), the
# "total" over all of them (the CNN top1 curve) and its running mean ("Average Accuracy (CNN)").
PROOF_CIFAR_B0_GROUPS = [
    [97.8], [94.9, 92.5], [92.7, 88.8, 93.1], [89.8, 87.1, 89.7, 86.9], [88.3, 82.3, 89.5, 82.2, 90.7],
    [87.1, 82.9, 87.7, 82.5, 85.1, 86.3], [86.1, 79.8, 86.8, 79.7, 84.9, 81.0, 91.8],
    [83.9, 77.3, 86.1, 79.9, 79.3, 72.4, 85.1, 85.8], [82.0, 72.5, 82.8, 79.7, 78.7, 75.3, 82.3, 77.3, 87.8],
    [79.6, 72.7, 82.1, 78.2, 77.2, 75.0, 82.7, 74.4, 80.1, 89.1],
]
PROOF_CIFAR_B0_CURVE = [97.8, 93.7, 91.53, 88.38, 86.6, 85.27, 84.3, 81.22, 79.82, 79.11]
PROOF_CIFAR_B50_GROUPS = [
    [90.7, 86.9, 90.9, 86.8, 88.2], [84.6, 81.3, 88.1, 82.8, 84.7, 88.5], [85.4, 79.8, 86.8, 80.9, 84.0, 81.5, 93.3],
    [84.4, 78.8, 87.3, 79.0, 80.5, 73.3, 85.2, 85.9], [82.3, 73.3, 84.0, 78.9, 80.6, 75.3, 85.0, 73.2, 89.2],
    [80.8, 74.8, 83.7, 77.2, 80.0, 76.5, 83.8, 69.8, 81.3, 89.4],
]
PROOF_CIFAR_B50_CURVE = [88.7, 85.0, 84.53, 81.8, 80.2, 79.73]


@pytest.mark.parametrize("groups, curve, average, base", [
    (PROOF_CIFAR_B0_GROUPS, PROOF_CIFAR_B0_CURVE, 86.773, 1),
    (PROOF_CIFAR_B50_GROUPS, PROOF_CIFAR_B50_CURVE, 83.32, 5),
])
def test_class_incremental_metrics_reproduce_proofs_released_logs(groups, curve, average, base):
    """CIFAR-100 B0-Inc10 and B50-Inc10: the task-by-task matrix (a task's accuracy: the mean of its 10-class groups,
    equal sizes) through `class_incremental_per_step` / `_average` / `_last` gives PROOF's curve, its Average Accuracy
    and its last accuracy (to the logs' rounding)."""
    T = len(groups)
    R = np.full((T, T), np.nan)
    for i, row in enumerate(groups):
        tasks = [row[:base]] + [[value] for value in row[base:]]
        R[i, : len(tasks)] = [np.mean(task) for task in tasks]
    sizes = [1000 * base] + [1000] * (T - 1)
    np.testing.assert_allclose(cm.class_incremental_per_step(R, sizes), curve, atol=0.005, rtol=0)
    # abs 0.01: cifarb50.log's last "Average Accuracy" reads 83.32, its curve's mean 83.3267 (the line is cut short)
    assert cm.class_incremental_average(R, sizes) == pytest.approx(average, abs=0.01)
    assert cm.class_incremental_last(R, sizes) == pytest.approx(curve[-1], abs=0.005)


# ----- X-TAIL streams --------------------------------------------------------------------------------------------


def test_few_shot_rows():
    labels = [0] * 5 + [1] * 2 + [2] * 4
    rows = few_shot_rows(labels, 3, seed=0)
    assert Counter(labels[i] for i in rows) == {0: 3, 1: 2, 2: 3}  # a class with fewer keeps all of its rows
    assert rows.tolist() == sorted(rows.tolist()) == few_shot_rows(labels, 3, seed=0).tolist()
    assert any(few_shot_rows(labels, 3, seed=s).tolist() != rows.tolist() for s in range(1, 6))


def test_xtail_bundled_stream(shared_data_root):
    stream = build_stream("xtail-bundled", max_eval_per_task=20, tasks=("dtd10", "rsscn7", "mnist"))
    assert stream.name == "xtail-bundled" and stream.task_names == ["dtd10", "rsscn7", "mnist"]
    for task, classes in zip(stream, (10, 7, 10), strict=True):
        assert Counter(_labels(task.train)) == dict.fromkeys(range(classes), 16)  # 16 shots per class
        assert task.train_templates == task.eval_templates == list(XTAIL_TEMPLATES)
    assert len(seen_class_names(stream.tasks, stream[0])) == 27
    full = build_stream("xtail-bundled", max_eval_per_task=5, shots_per_class=2, templates="dataset")
    assert full.task_names == ["caltech101", "dtd10", "rsscn7", "mnist", "gtsrb"]
    assert len(full[0].train) == 2 * 102 and len(full[0].eval_templates) > 1
    for options, message in (({"shots_per_class": 0}, "shots_per_class"), ({"templates": "own"}, "templates"),
                             ({"tasks": ("dtd10", "cifar100")}, "tasks")):
        with pytest.raises(ValueError, match=message):
            build_stream("xtail-bundled", **options)


@pytest.fixture
def xtail_hub(local_hub, shared_data_root):
    images = _cifar_images(shared_data_root, 20)
    local_hub.commits = {}
    for name, sizes in (("Aircraft", {"train": 12, "test": 6}), ("SUN397", {"test": 30})):
        names = [f"{name.lower()} class {k}" for k in range(3)]
        local_hub.commits[name] = _push(local_hub.store, MTIL_REPOS[name], _wds_files(
            images, names, sizes, templates=(f"itap of a {{c}}, a kind of {name}.",)))
    return local_hub


def test_xtail_stream_from_the_local_hub(xtail_hub, tmp_path: Path):
    """The Hub stream reads the MTIL repos at the commits given, keeps `shots_per_class` per class and puts every
    class through X-TAIL's one template (never a domain's own); CIFAR100 is not an X-TAIL domain."""
    assert "CIFAR100" not in XTAIL_DATASETS and len(XTAIL_DATASETS) == 10
    stream = xtail_stream(["SUN397", "Aircraft"], shots_per_class=2, revision=xtail_hub.commits, seed=1,
                          cache_dir=tmp_path / "datasets")
    assert stream.name == "xtail" and stream.task_names == ["SUN397", "Aircraft"]
    for task in stream:
        assert Counter(_labels(task.train)) == {0: 2, 1: 2, 2: 2}
        assert task.train_templates == task.eval_templates == list(XTAIL_TEMPLATES)
        assert (task.dataset_id, task.dataset_revision) == (MTIL_REPOS[task.name], xtail_hub.commits[task.name])
    assert len(stream[0].eval) == 6  # SUN397's single split, 20 % of each class held out
    with pytest.raises(ValueError, match="shots_per_class"):
        xtail_stream(["Aircraft"], shots_per_class=1.5)


# ----- class-incremental streams ---------------------------------------------------------------------------------


def test_class_orders():
    """Continual-CLIP's CIFAR-100 order (MoE-Adapters' class_orders/cifar100.yaml) and PyCIL's seed-1993 shuffle."""
    assert sorted(CIFAR100_CLIP_ORDER) == list(range(100)) and CIFAR100_CLIP_ORDER[:5] == (87, 0, 52, 58, 44)
    assert seed_1993_order(range(100))[:8] == [68, 56, 78, 8, 23, 84, 90, 65]
    assert seed_1993_order([10, 20, 30]) == [[10, 20, 30][i] for i in np.random.RandomState(1993).permutation(3)]


def test_cil_caltech101_bundled(shared_data_root):
    stream = build_stream("cil-caltech101-bundled", max_train_per_task=8, max_eval_per_task=8)
    assert stream.name == "cil-caltech101-B0-Inc10" and len(stream) == 10
    names = [name for task in stream for name in task.class_names]
    assert len(names) == len(set(names)) == 100 and not set(CALTECH101_LEFT_OUT) & set(names)
    b50 = build_stream("cil-caltech101-bundled", setting="B50-Inc10", class_order="dataset", max_eval_per_task=4)
    assert [len(task.class_names) for task in b50] == [50] + [10] * 5
    assert b50[0].class_names[:2] == ["off-center face", "leopard"]
    for setting, message in (("B0-Inc7", "does not divide"), ("Inc10", "setting must be")):
        with pytest.raises(ValueError, match=message):
            build_stream("cil-caltech101-bundled", setting=setting)


def test_cil_hub_streams_pin_their_commit(local_hub, shared_data_root, tmp_path: Path):
    """CIFAR-100 B50-Inc10 from a stand-in of its repo at the commit given, in Continual-CLIP's order; a branch
    name, or ImageNet-R without a revision, is refused before anything is downloaded."""
    images = _cifar_images(shared_data_root, 20)
    names = [f"class {k}" for k in range(100)]
    commit = _push(local_hub.store, CIFAR100_REPO, _wds_files(images, names, {"train": 200, "test": 100},
                                                              per_shard=100))
    stream = build_stream("cil-cifar100", setting="B50-Inc10", revision=commit, cache_dir=str(tmp_path / "d"))
    assert stream.name == "cifar100-B50-Inc10" and [len(task.class_names) for task in stream] == [50] + [10] * 5
    assert stream[0].class_names[:3] == ["class 87", "class 0", "class 52"]
    assert stream[1].class_names == [names[k] for k in CIFAR100_CLIP_ORDER[50:60]]
    assert stream[0].train_templates == ["a bad photo of a {c}."]
    assert {(task.dataset_id, task.dataset_revision) for task in stream} == {(CIFAR100_REPO, commit)}  # .eval_results
    asked = len(local_hub.request_log)
    for name, options in (("cil-cifar100", {"revision": "main"}), ("cil-imagenet-r", {})):
        with pytest.raises(ValueError, match="full 40-character commit SHA"):
            build_stream(name, **options)
    assert len(local_hub.request_log) == asked
    assert IMAGENET_R_REPO == "clip-benchmark/wds_imagenet-r"


def test_stream_values_are_refused_before_anything_is_built(tmp_path, capsys):
    """`hf-ccl train` exits 2 (refused by the config's checks, nothing built or downloaded) on a Hub stream without
    a pinned commit, a setting that is not B<b>-Inc<n>, or a bad X-TAIL option, naming the option."""
    from hf_ccl.cli import main

    cases = [("cil-imagenet-r", [], "revision must be the full 40-character commit SHA"),
             ("cil-cifar100-b0inc10", ["stream_args.revision=main"], "revision must be the full"),
             ("cil-caltech101-bundled", ["stream_args.setting=10-10"], "setting must be"),
             ("xtail-bundled", ["stream_args.shots_per_class=0"], "shots_per_class"),
             ("xtail", ["stream_args.templates=own"], "templates must be one of")]
    for recipe, overrides, message in cases:
        assert main(["train", "--config", recipe, f"output_dir={tmp_path / recipe}", "model.pretrained=null",
                     *overrides]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / recipe).exists()


# ----- recipes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe, headline", [("xtail-bundled", "all_accuracy"),
                                              ("cil-caltech101-bundled", "seen_accuracy")])
def test_the_protocol_recipes_run_from_the_command_line(tmp_path, capsys, recipe, headline):
    """recipes/configs/<recipe>.yaml through `hf-ccl train` (what `accelerate launch recipes/train.py` runs) on two
    tasks and a tiny random CLIP: the matrix's headline is the protocol's, and results.md has its metrics."""
    from hf_ccl.cli import main
    from hf_ccl.evaluation.matrix import ResultsMatrix

    tasks = "tasks: [dtd10, rsscn7]" if recipe == "xtail-bundled" else "setting: B50-Inc50"
    overrides = [
        f"output_dir={tmp_path}", "progress=false", "training.max_steps=2", "training.per_device_train_batch_size=8",
        f"stream_args={{max_train_per_task: 16, max_eval_per_task: 8, {tasks}}}", "model.pretrained=null",
        "model.config={hidden_size: 32, num_layers: 1, num_heads: 2, image_size: 32, patch_size: 8, projection_dim: 32}",
    ]
    assert main(["train", "--config", recipe, *overrides]) == 0
    results = ResultsMatrix.load(tmp_path)
    assert results.headline_metrics == [headline, headline] and results.num_trained == 2
    markdown = (tmp_path / "results.md").read_text()
    card = (tmp_path / "task-0" / "README.md").read_text()
    state = json.loads((tmp_path / "task-0" / "continual_state.json").read_text())
    classes = {entry["task"]: entry["classes"] for entry in state["evaluation"]}
    if recipe == "xtail-bundled":  # unseen domains are scored too: the whole matrix is filled
        assert not np.isnan(results.headline()).any() and "mtil_transfer" in markdown
        union = len({name for task in build_stream(recipe, tasks=["dtd10", "rsscn7"]) for name in task.class_names})
        assert classes == {"dtd10": union, "rsscn7": union} and "every class of every task of the stream" in card
        assert f"| {100 / union:.2f} |" in card  # chance among the union, not among a domain's own classes
        assert results.rows[0].metrics["rsscn7"]["all_accuracy"] <= results.rows[0].metrics["rsscn7"]["accuracy"]
    else:
        assert "class_incremental_average" in markdown and not math.isnan(results.summary()["class_incremental_last"])
        assert list(classes.values()) == [50, 100]  # after task 0: the 50 seen, and the second task's own with them
        assert "every class seen so far" in card
    capsys.readouterr()


@pytest.mark.slow  # ~60 s on 2 busy cores: a launch of two processes
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["xtail-bundled", "cil-caltech101-bundled"])
def test_the_protocol_recipes_run_under_accelerate_launch_on_two_processes(tmp_path, recipe):
    """`accelerate launch --multi_gpu --num_processes 2 recipes/train.py --config <recipe>` on two tasks and a tiny
    random CLIP: one run, scored by the protocol's headline on the main process."""
    from test_distributed import TRAIN_SCRIPT, launch_two_processes

    from hf_ccl.evaluation.matrix import ResultsMatrix

    tasks = "tasks: [dtd10, rsscn7]" if recipe == "xtail-bundled" else "setting: B50-Inc50"
    launch_two_processes(
        TRAIN_SCRIPT, "--config", recipe, f"output_dir={tmp_path}", "progress=false", "training.max_steps=2",
        "training.per_device_train_batch_size=4", f"stream_args={{max_train_per_task: 16, max_eval_per_task: 8, {tasks}}}",
        "model.pretrained=null",
        "model.config={hidden_size: 32, num_layers: 1, num_heads: 2, image_size: 32, patch_size: 8, projection_dim: 32}")
    results = ResultsMatrix.load(tmp_path)
    assert results.num_trained == 2 and not np.isnan(np.tril(results.headline())).any()
    assert results.headline_metrics[0] == ("all_accuracy" if recipe == "xtail-bundled" else "seen_accuracy")
