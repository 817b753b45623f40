"""RAIL (Xu et al., NeurIPS 2024): the recursive primal update by hand, absolute memorization (the recursion equals
the joint ridge solution), the dual's block inverse against its closed form (and the official refit), the fusion
rule by hand, the option and combination refusals, and one tiny CLI run (frozen model, unseen tasks exactly
zero-shot, the card's loader scoring exactly as the run)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from hf_ccl.cli import main
from hf_ccl.methods import build_methods
from hf_ccl.methods import rail_math as rm
from hf_ccl.methods.rail import RAILConfig, RAILScorer, RAILState
from hf_ccl.validation import ConfigError


def _one_hot(labels: list[int], classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(labels), classes).double()


def test_primal_update_by_hand_on_a_3x2_toy():
    """λ = 1. Task 1: x1 = [1, 0] of class A. Task 2: x2 = [0, 1] of class B, x3 = [1, 1] of class A.
    M1 = (x1ᵀx1 + I)⁻¹ = diag(1/2, 1), W1 = M1 x1ᵀ[1] = [1/2, 0]ᵀ. Joint: XᵀX + I = [[3, 1], [1, 3]], so
    M2 = [[3, -1], [-1, 3]] / 8; XᵀY = [[2, 0], [1, 1]], W2 = M2 XᵀY = [[5, -1], [1, 3]] / 8."""
    memory, weight = torch.eye(2, dtype=torch.float64), torch.zeros(2, 0, dtype=torch.float64)
    memory, weight = rm.primal_update(memory, weight, torch.tensor([[1.0, 0.0]], dtype=torch.float64),
                                      _one_hot([0], 1))
    torch.testing.assert_close(memory, torch.tensor([[0.5, 0.0], [0.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(weight, torch.tensor([[0.5], [0.0]], dtype=torch.float64))
    second = torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    memory, weight = rm.primal_update(memory, weight, second, _one_hot([1, 0], 2))
    torch.testing.assert_close(memory, torch.tensor([[3.0, -1.0], [-1.0, 3.0]], dtype=torch.float64) / 8)
    torch.testing.assert_close(weight, torch.tensor([[5.0, -1.0], [1.0, 3.0]], dtype=torch.float64) / 8)


@pytest.mark.parametrize("hidden_dim", [0, 48])
def test_primal_recursion_equals_the_joint_ridge_solution(hidden_dim):
    """Absolute memorization, in float64: three tasks (a class met again in the third), fitted one after the other
    in chunks of 5 rows, give the closed-form ridge solution on all the data (with the same hidden layer)."""
    generator = torch.Generator().manual_seed(0)
    state = RAILState(RAILConfig(hidden_dim=hidden_dim, ridge=0.3))
    tasks = [(["a", "b"], 12), (["c", "d", "e"], 9), (["b", "f"], 7)]
    features, labels = [], []
    for names, count in tasks:
        x = torch.randn(count, 16, generator=generator, dtype=torch.float64)
        y = torch.tensor(state.class_index([names[i % len(names)] for i in range(count)]))
        state.fit(x, y, seed=3)
        features.append(torch.nn.functional.normalize(x, dim=-1))
        labels.append(y)
    assert state.class_names == ["a", "b", "c", "d", "e", "f"]
    hidden = None if state.hidden is None else state.hidden.double()
    assert (hidden is None) == (hidden_dim == 0) and (hidden is None or hidden.shape == (16, hidden_dim))
    expanded = rm.expand(torch.cat(features), hidden)
    joint = rm.ridge_solution(expanded, _one_hot(torch.cat(labels).tolist(), 6), 0.3)
    torch.testing.assert_close(state.weight, joint, rtol=1e-9, atol=1e-10)
    eye = torch.eye(expanded.shape[1], dtype=torch.float64)
    torch.testing.assert_close(state.memory, torch.linalg.inv(expanded.T @ expanded + 0.3 * eye), rtol=1e-9,
                               atol=1e-10)
    chunked = rm.primal_update(torch.eye(expanded.shape[1], dtype=torch.float64) / 0.3,
                               torch.zeros(expanded.shape[1], 0, dtype=torch.float64), expanded,
                               _one_hot(torch.cat(labels).tolist(), 6), chunk_size=4)[1]
    torch.testing.assert_close(chunked, joint, rtol=1e-9, atol=1e-10)


def test_rbf_kernel_by_hand():
    left = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    right = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rm.rbf_kernel(left, right, 0.5), torch.tensor([[math.exp(-1.0), 1.0]],
                                                                             dtype=torch.float64))


@pytest.mark.parametrize("solve", ["recursive", "refit"])
def test_dual_equals_kernel_ridge_on_every_feature(solve):
    """Both dual variants (the paper's block inverse, the official re-inversion) give α = (K + λI)⁻¹Y on every
    feature seen, and the scores k(x, X) α; the recursive one keeps M_d = (K + λI)⁻¹ exactly."""
    generator = torch.Generator().manual_seed(1)
    state = RAILState(RAILConfig(form="dual", dual_solve=solve, ridge=0.01, gamma=2.0))
    features, labels = [], []
    for names, count in ((["a", "b"], 10), (["c"], 6), (["a", "d"], 8)):
        x = torch.randn(count, 8, generator=generator, dtype=torch.float64)
        y = torch.tensor(state.class_index([names[i % len(names)] for i in range(count)]))
        state.fit(x, y, seed=0)
        features.append(torch.nn.functional.normalize(x, dim=-1))
        labels.append(y)
    memory = torch.cat(features)
    kernel = rm.rbf_kernel(memory, memory, 2.0)
    alpha = torch.linalg.solve(kernel + 0.01 * torch.eye(len(memory), dtype=torch.float64),
                               _one_hot(torch.cat(labels).tolist(), 4))
    torch.testing.assert_close(state.weight, alpha, rtol=1e-8, atol=1e-9)
    assert (state.inverse is not None) == (solve == "recursive")
    if state.inverse is not None:
        torch.testing.assert_close(state.inverse @ (kernel + 0.01 * torch.eye(len(memory), dtype=torch.float64)),
                                   torch.eye(len(memory), dtype=torch.float64), rtol=0, atol=1e-8)
    query = torch.nn.functional.normalize(torch.randn(3, 8, generator=generator, dtype=torch.float64), dim=-1)
    torch.testing.assert_close(state.scores(query), rm.rbf_kernel(query, memory, 2.0) @ alpha, rtol=1e-8, atol=1e-9)


def test_fusion_by_hand():
    """Row 0's zero-shot top-1 (class 0) is learned: (1 - β) softmax + β adapter. Row 1's (class 1) is not: its
    zero-shot softmax, whatever the adapter says."""
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0]], dtype=torch.float64)
    adapter = torch.tensor([[0.1, 0.0, 0.9], [0.7, 0.0, 0.2]], dtype=torch.float64)
    learned = torch.tensor([True, False, True])
    fused = rm.fuse(logits, adapter, learned, beta=0.5)
    e = math.e
    row0 = [e**2 / (e**2 + 1 + e), 1 / (e**2 + 1 + e), e / (e**2 + 1 + e)]
    row1 = [1 / (2 + e**3), e**3 / (2 + e**3), 1 / (2 + e**3)]
    expected = [[0.5 * p + 0.5 * a for p, a in zip(row0, (0.1, 0.0, 0.9), strict=True)], row1]
    torch.testing.assert_close(fused, torch.tensor(expected, dtype=torch.float64))
    assert fused[0].argmax() == 2 and fused[1].argmax() == 1  # the adapter overturns row 0 only


def test_the_scorer_keys_classes_by_name_and_waits_for_the_first_task():
    state = RAILState(RAILConfig(hidden_dim=0, ridge=1e-6, fusion_weight=1.0))
    scorer = RAILScorer(state)
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    classes = torch.nn.functional.normalize(torch.tensor([[1.0, 0.1], [0.1, 1.0], [1.0, 1.0]]), dim=-1)
    assert scorer.class_scores(images, classes, ["x", "y", "z"]) is None  # cosine until a task is learned
    state.fit(images, torch.tensor(state.class_index(["y", "x"])), seed=0)  # image 0 is a "y", image 1 an "x"
    scores = scorer.class_scores(images, classes, ["x", "y", "z"])
    assert scores is not None and scores.dtype == torch.float32 and scores.shape == (2, 3)
    assert scores.argmax(dim=1).tolist() == [1, 0]  # the regression's (β = 1), against the zero-shot choice
    assert scores[:, 2].abs().max() < 1e-6  # "z" was never learned: no regression score
    swapped = scorer.class_scores(images, classes[[1, 0, 2]], ["y", "x", "z"])
    torch.testing.assert_close(swapped, scores[:, [1, 0, 2]])
    unseen = scorer.class_scores(images, classes[2:], ["z"])  # no learned candidate: the zero-shot softmax
    torch.testing.assert_close(unseen, torch.ones(2, 1))


@pytest.mark.parametrize(("options", "key"), [
    ({"gamma": 0.5}, "method_args.rail.gamma"),
    ({"dual_solve": "refit"}, "method_args.rail.dual_solve"),
    ({"form": "dual", "hidden_dim": 64}, "method_args.rail.hidden_dim"),
    ({"ridge": 0.0}, "method_args.rail.ridge"),
    ({"fusion_weight": 1.5}, "method_args.rail.fusion_weight"),
    ({"hidden_dim": -1}, "method_args.rail.hidden_dim"),
])
def test_options_of_the_other_form_and_out_of_range_are_refused(options, key):
    with pytest.raises(ConfigError) as caught:
        build_methods(["rail"], {"rail": options})
    assert caught.value.key == key and "\n" not in str(caught.value)


def test_rail_runs_alone():
    with pytest.raises(ConfigError, match="never trains the model"):
        build_methods(["rail", "er"])


def test_a_stream_without_class_labels_is_refused_naming_its_task_kinds():
    from hf_ccl.data.task import Task, TaskStream

    captioned = Task(name="captions", train=None, eval=None)  # a retrieval task (no class labels)
    (method,) = build_methods(["rail"])
    with pytest.raises(ConfigError, match=r"every task must be a classification task, the stream has \['retrieval'\]"):
        method.check_stream(TaskStream("s", [captioned]))


def test_a_streaming_train_split_is_refused_naming_the_task():
    from datasets import Dataset

    from hf_ccl.data.task import Task, TaskStream

    rows = Dataset.from_dict({"image": [None], "texts": [["a zero"]], "image_id": ["0"], "label": [0]})
    task = Task(name="streamed", train=rows.to_iterable_dataset(), eval=rows, kind="classification",
                class_names=["zero"])
    (method,) = build_methods(["rail"])
    with pytest.raises(ConfigError, match=r"tasks \['streamed'\] have streaming train splits"):
        method.check_stream(TaskStream("s", [task]))


@pytest.mark.slow
def test_a_stream_without_class_labels_is_refused_before_the_model_is_built(tmp_path, capsys):
    """(The stream's task kinds are known once it is built: exit 1, as every method's `check_stream`.)"""
    code = main(["train", "--config", "flickr8k-random5", "methods=[rail]", f"output_dir={tmp_path / 'run'}",
                 "stream_args.max_train_per_task=8", "stream_args.max_eval_per_task=4"])
    error = capsys.readouterr().err
    assert code == 1 and "hf-ccl: error: rail learns a regression to class labels" in error, error
    assert not (tmp_path / "run").exists()


def _results(folder) -> tuple[list[list[float]], list[float]]:
    """The run's accuracy matrix (row: after task k) and its initial row, from results.json."""
    results = json.loads((folder / "results.json").read_text())
    names = results["task_names"]
    matrix = [[row["metrics"][name]["accuracy"] for name in names] for row in results["rows"]]
    return matrix, [results["initial"]["metrics"][name]["accuracy"] for name in names]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The README's command on the 5 digits tasks, RAIL with a small hidden layer and β = 1."""
    folder = tmp_path_factory.mktemp("rail") / "run"
    code = main(["train", "--config", "digits", "methods=[rail]", f"output_dir={folder}", "progress=false",
                 "model.config.hidden_size=32", "model.config.num_layers=1", "stream_args.max_train_per_task=48",
                 "stream_args.max_eval_per_task=24",
                 "method_args.rail.hidden_dim=256", "method_args.rail.ridge=0.0001", "method_args.rail.fusion_weight=1"])
    assert code == 0
    return folder


def test_the_model_never_trains_and_unseen_tasks_stay_exactly_zero_shot(cli_run):
    weights = [load_file(cli_run / f"task-{k}" / "model.safetensors") for k in range(5)]
    for later in weights[1:]:
        assert all(torch.equal(later[name], tensor) for name, tensor in weights[0].items())
    matrix, initial = _results(cli_run)
    for row, trained in enumerate(matrix):
        for column, value in enumerate(trained):
            if column > row:  # not learned yet: the zero-shot prediction, exactly
                assert value == initial[column], (row, column)
    learned = [matrix[row][column] for row in range(5) for column in range(row + 1)]
    zero_shot = [initial[column] for row in range(5) for column in range(row + 1)]
    assert sum(learned) > sum(zero_shot) + 10 * len(learned), (matrix, initial)
    tasks = json.loads((cli_run / "compute.json").read_text())["tasks"]
    assert [task["trainable_parameters"] for task in tasks] == [0] * 5  # the cost column: no optimizer step


def test_the_cards_loader_scores_exactly_as_the_run(cli_run):
    from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
    from hf_ccl.evaluation import evaluate_task
    from hf_ccl.methods.rail import load_rail_model, rail_scorer

    folder = cli_run / "task-4"
    assert "from hf_ccl.methods.rail import load_rail_model" in (folder / "README.md").read_text(encoding="utf-8")
    model = load_rail_model(folder)
    scorer = rail_scorer(model)
    assert scorer is not None and len(scorer.state.class_names) == 10
    stream = build_stream("digits", max_train_per_task=48, max_eval_per_task=24)
    matrix, _ = _results(cli_run)
    for column, task in [(0, stream.tasks[0]), (4, stream.tasks[4])]:  # the first task learned and the last
        metrics = evaluate_task(model, task, load_image_processor(32), load_tokenizer())
        assert metrics[task.headline_metric] == matrix[4][column]
