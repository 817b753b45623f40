"""ResultsMatrix: headline extraction, summaries (full and partial), JSON/markdown round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hf_ccl.evaluation import ResultsMatrix, plot_matrix_heatmap, summarize

TASKS = ["flickr_en", "pacs_sketch", "flickr_de"]
HEADLINES = ["R_mean", "accuracy", "R_mean"]
R = np.array(
    [
        [50.0, 10.0, 20.0],
        [55.0, 60.0, 30.0],
        [30.0, 45.0, 69.0],
    ]
)
B = np.array([5.0, 8.0, 12.0])


def _cell(task_index: int, value: float) -> dict[str, float]:
    if HEADLINES[task_index] == "accuracy":
        return {"accuracy": value, "top5_accuracy": min(100.0, value + 20)}
    return {"i2t_R@1": value / 2, "t2i_R@1": value / 3, "R_mean": value}


def _row(values: np.ndarray) -> dict[str, dict[str, float]]:
    return {task: _cell(j, float(values[j])) for j, task in enumerate(TASKS)}


def _matrix(n_rows: int = 3, initial: bool = True) -> ResultsMatrix:
    matrix = ResultsMatrix(TASKS, HEADLINES)
    if initial:
        matrix.add_row("initial", _row(B))
    for i in range(n_rows):
        matrix.add_row(TASKS[i], _row(R[i]))
    return matrix


def test_headline_and_initial() -> None:
    matrix = _matrix()
    np.testing.assert_array_equal(matrix.headline(), R)
    np.testing.assert_array_equal(matrix.initial_headline(), B)
    np.testing.assert_allclose(matrix.metric("i2t_R@1")[:, 0], R[:, 0] / 2)
    assert math.isnan(matrix.metric("i2t_R@1")[0, 1])  # classification task has no recall


def test_summary_full_matches_summarize() -> None:
    matrix = _matrix()
    assert matrix.summary() == pytest.approx(summarize(R, B))
    assert matrix.summary()["forgetting"] == pytest.approx(20.0)
    assert matrix.summary()["forward_transfer"] == pytest.approx(10.0)


def test_summary_partial_uses_top_left_block() -> None:
    matrix = _matrix(n_rows=2)
    assert matrix.headline().shape == (2, 3)
    summary = matrix.summary()
    assert summary == pytest.approx(summarize(R[:2, :2], B[:2]))
    assert summary["final_average"] == pytest.approx((55 + 60) / 2)
    assert summary["forgetting"] == pytest.approx(-5.0)  # max over rows before the last: 50 - 55
    assert ResultsMatrix(TASKS, HEADLINES).summary() == {}


def test_summary_without_initial_has_no_forward_transfer() -> None:
    assert "forward_transfer" not in _matrix(initial=False).summary()


def test_missing_cells_are_nan() -> None:
    matrix = ResultsMatrix(TASKS, HEADLINES)
    matrix.add_row(TASKS[0], {TASKS[0]: {"R_mean": 40.0}})
    headline = matrix.headline()
    assert headline[0, 0] == 40.0 and np.isnan(headline[0, 1:]).all()


def test_add_row_replaces_same_label_and_validates() -> None:
    matrix = _matrix(n_rows=2)
    matrix.add_row(TASKS[1], _row(R[1] + 1))
    assert matrix.num_trained == 2
    np.testing.assert_array_equal(matrix.headline()[1], R[1] + 1)
    with pytest.raises(ValueError, match="unknown tasks"):
        matrix.add_row("x", {"no_such_task": {"R_mean": 1.0}})
    matrix.add_row(TASKS[2], _row(R[2]))
    with pytest.raises(ValueError, match="trained rows"):
        matrix.add_row("extra", _row(R[2]))
    with pytest.raises(ValueError, match="unique"):
        ResultsMatrix(["a", "a"])


def test_headline_metric_forms() -> None:
    assert ResultsMatrix(["a", "b"]).headline_metrics == ["R_mean", "R_mean"]
    assert ResultsMatrix(["a", "b"], {"a": "accuracy", "b": "R_mean"}).headline_metrics == [
        "accuracy",
        "R_mean",
    ]
    with pytest.raises(ValueError, match="headline metrics"):
        ResultsMatrix(["a", "b"], ["accuracy"])


def test_dict_round_trip_with_nan() -> None:
    matrix = _matrix()
    matrix.rows[0].metrics[TASKS[2]]["R_mean"] = math.nan
    data = matrix.to_dict()
    text = json.dumps(data, allow_nan=False)  # NaN became null
    assert "null" in text
    restored = ResultsMatrix.from_dict(json.loads(text))
    np.testing.assert_array_equal(restored.headline(), matrix.headline())  # NaN == NaN for this assert
    np.testing.assert_array_equal(restored.initial_headline(), B)
    assert restored.task_names == TASKS and restored.headline_metrics == HEADLINES


def test_save_and_load(tmp_path: Path) -> None:
    matrix = _matrix()
    out = matrix.save(tmp_path / "run")
    assert (out / "results.json").is_file() and (out / "results.md").is_file()
    assert not list(out.glob("*.tmp"))
    loaded = ResultsMatrix.load(out)
    np.testing.assert_array_equal(loaded.headline(), R)
    assert loaded.summary() == pytest.approx(matrix.summary())
    assert json.loads((out / "results.json").read_text())["summary"]["forgetting"] == pytest.approx(20.0)
    assert (out / "results.md").read_text() == matrix.to_markdown()


def test_markdown() -> None:
    text = str(_matrix())
    lines = text.splitlines()
    assert (
        "| model \\ eval task | flickr_en (R_mean) | pacs_sketch (accuracy) | flickr_de (R_mean) |" in lines
    )
    assert "| initial | 5.0 | 8.0 | 12.0 |" in lines
    assert "| after flickr_en | 50.0 | 10.0 | 20.0 |" in lines
    assert "| after flickr_de | 30.0 | 45.0 | 69.0 |" in lines
    assert any(line.startswith("| forgetting | 20.00 |") for line in lines)
    assert any(line.startswith("| tic_id | 59.67 |") for line in lines)
    assert "mix headline metrics" in text
    partial = _matrix(n_rows=1).to_markdown()
    assert "first 1 of 3 tasks" in partial
    assert "No trained rows yet." in ResultsMatrix(TASKS).to_markdown()


def test_markdown_shows_missing_as_dash() -> None:
    matrix = ResultsMatrix(["a", "b"])
    matrix.add_row("a", {"a": {"R_mean": 12.345}})
    assert "| after a | 12.3 | - |" in matrix.to_markdown().splitlines()


def test_from_tasks() -> None:
    class FakeTask:
        def __init__(self, name: str, headline_metric: str) -> None:
            self.name, self.headline_metric = name, headline_metric

    matrix = ResultsMatrix.from_tasks([FakeTask("a", "R_mean"), FakeTask("b", "accuracy")])
    assert matrix.task_names == ["a", "b"] and matrix.headline_metrics == ["R_mean", "accuracy"]


def test_plot_heatmap(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = plot_matrix_heatmap(_matrix(n_rows=2), tmp_path / "plots" / "matrix.png")
    assert path.is_file() and path.stat().st_size > 1000
    # drawn once (hf_ccl.evaluation.plots.save_png): the pixels matplotlib's savefig gives, in two draws
    from PIL import Image

    from hf_ccl.evaluation.plots import matrix_heatmap_figure

    matrix_heatmap_figure(_matrix(n_rows=2)).savefig(tmp_path / "savefig.png", dpi=120)
    drawn_once, saved = (np.asarray(Image.open(p).convert("RGBA")) for p in (path, tmp_path / "savefig.png"))
    assert drawn_once.shape == saved.shape and np.array_equal(drawn_once, saved)


def test_heatmap_colour_scale_is_fixed_at_0_to_100() -> None:
    pytest.importorskip("matplotlib")
    from hf_ccl.evaluation.plots import matrix_heatmap_figure

    for n_rows in (1, 2):  # other values, other revisions: the same scale
        (image,) = matrix_heatmap_figure(_matrix(n_rows=n_rows)).axes[0].images
        assert image.get_clim() == (0.0, 100.0)


def test_class_incremental_metrics_need_seen_scores_and_eval_sizes() -> None:
    seen = ResultsMatrix(["a", "b"], "seen_accuracy")
    seen.add_row("a", {"a": {"seen_accuracy": 80.0}, "b": {"seen_accuracy": 0.0}})
    seen.add_row("b", {"a": {"seen_accuracy": 40.0}, "b": {"seen_accuracy": 70.0}})
    assert "class_incremental_average" not in seen.summary()  # no eval sizes recorded
    seen.evaluation = {"examples": {"a": {"rows": 30, "evaluated": 30}, "b": {"rows": 10, "evaluated": 10}}}
    # after a: 80; after b: (30 * 40 + 10 * 70) / 40 = 47.5; Avg = (80 + 47.5) / 2.
    assert seen.summary()["class_incremental_last"] == pytest.approx(47.5)
    assert seen.summary()["class_incremental_average"] == pytest.approx(63.75)
    aware = ResultsMatrix(["a", "b"], "accuracy")
    aware.evaluation = seen.evaluation
    aware.add_row("a", {"a": {"accuracy": 80.0}})
    assert "class_incremental_last" not in aware.summary()  # task-aware scores are not the class-incremental ones
    assert aware.summary()["mtil_last"] == pytest.approx(80.0)
