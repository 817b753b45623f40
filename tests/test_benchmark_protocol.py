"""benchmarks/protocol.py, the protocol every benchmark script shares: orders, seeds and folders from the command
line, chance and majority rates, standard errors, paired verdicts, plasticity and Transfer (hand-computed)."""

from __future__ import annotations

import argparse
import io
import math
import sys
import tempfile
from pathlib import Path

import pytest
from datasets import Dataset, Features, Value
from datasets import Image as ImageFeature
from PIL import Image as PILImage

from hf_ccl.data import Task, TaskStream, stream_from_datasets
from hf_ccl.evaluation.continual_metrics import mtil_transfer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import protocol  # noqa: E402  (benchmarks/ is not a package)

# ---------------------------------------------------------------- command line and orders


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    protocol.add_stream_arguments(parser, default_output="results/x", **kwargs)
    return parser


def test_stream_arguments_defaults_and_a_fresh_runs_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = _parser().parse_args([]), _parser().parse_args([])
    assert first.order == ["I", "II", "random"] and first.seeds == [0, 1, 2] and first.tasks is None
    assert first.output == Path("results/x")
    assert first.runs_dir != second.runs_dir and first.runs_dir.is_dir() and second.runs_dir.is_dir()
    assert first.runs_dir.parent == tmp_path and first.runs_dir.name.startswith("hf_ccl_bench_")
    given = _parser().parse_args(["--runs-dir", str(tmp_path / "mine"), "--order", "random,I", "--tasks", "b,a",
                                  "--seeds", "4", "--output", str(tmp_path / "out/name")])
    assert given.runs_dir == tmp_path / "mine" and len(list(tmp_path.iterdir())) == 2  # no third temp folder
    assert given.order == ["random", "I"] and given.tasks == ["b", "a"] and given.seeds == [4]
    assert protocol.results_path(given.output, ".md") == tmp_path / "out/name.md" and (tmp_path / "out").is_dir()
    no_orders = _parser(orders=(), default_seeds="0")
    assert not hasattr(no_orders.parse_args([]), "order")


@pytest.mark.parametrize("argv, message", [
    (["--order", "III"], "unknown order(s) ['III']; valid: I, II, random"),
    (["--seeds", "0,x"], "seeds must be comma-separated integers"),
    (["--seeds", "1,1"], "names repeat: 1"),
    (["--tasks", ","], "expected a comma-separated list"),
])
def test_stream_arguments_refuse_bad_values(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_task_orders_fixed_given_and_random() -> None:
    fixed = {"I": ["a", "b", "c", "d", "e"], "II": ["e", "d", "c", "b", "a"]}
    orders = protocol.task_orders(["I", "II", "random"], fixed, None, seed=0)
    assert orders["I"] == fixed["I"] and orders["II"] == fixed["II"]
    randoms = [protocol.task_orders(["random"], fixed, None, seed)["random"] for seed in range(4)]
    assert all(sorted(r) == fixed["I"] for r in randoms) and len({tuple(r) for r in randoms}) > 1
    assert protocol.task_orders(["random"], fixed, None, 2) == {"random": randoms[2]}  # the seed fixes it
    given = protocol.task_orders(["I", "II", "random"], fixed, ["c", "a"], seed=0)
    assert list(given) == ["given", "random"] and given["given"] == ["c", "a"] and sorted(given["random"]) == ["a", "c"]
    two = {"I": ["a", "b"]}  # a random order is never a repeat of a fixed order asked for, if another exists
    assert all(protocol.task_orders(["I", "random"], two, None, seed)["random"] == ["b", "a"] for seed in range(8))
    assert {tuple(protocol.task_orders(["random"], two, None, seed)["random"]) for seed in range(8)} == {
        ("a", "b"), ("b", "a")}
    assert protocol.task_orders(["I", "random"], {"I": ["a"]}, None, 0) == {"I": ["a"], "random": ["a"]}
    with pytest.raises(ValueError, match=r"unknown order\(s\) \['III'\]; valid: I, II, random"):
        protocol.task_orders(["III"], fixed, None, 0)


def test_reorder_a_stream_by_task_names() -> None:
    data = Dataset.from_dict({"label": [0]})
    stream = TaskStream("s", [Task(name, data, data, "classification", ["x"]) for name in "abc"])
    assert protocol.reorder(stream, ["c", "a"]).task_names == ["c", "a"] and stream.task_names == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['z'\] of stream 's'; valid: a, b, c"):
        protocol.reorder(stream, ["z"])
    with pytest.raises(ValueError, match="tasks name a task twice: a"):
        protocol.reorder(stream, ["a", "a"])


# ---------------------------------------------------------------- chance, majority, standard errors


def _png() -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (4, 4), (90, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_eval_baseline_of_a_stratified_eval_subset() -> None:
    labels = [0] * 20 + [1] * 6 + [2] * 4
    features = Features({"image": ImageFeature(), "label": Value("int64")})
    data = Dataset.from_dict({"image": [{"bytes": _png(), "path": None}] * 30, "label": labels}, features=features)
    stream = stream_from_datasets([{"name": "t", "train": data, "eval": data, "label_column": "label",
                                    "class_names": ["a", "b", "c", "d"]}], max_eval_per_task=12)
    baseline = protocol.eval_baseline(stream[0])
    # class d has no row: 12 // 3 classes = 4 rows each; chance is among the 4 classes the task is scored among
    assert (baseline.task, baseline.n, baseline.n_classes) == ("t", 12, 4)
    assert baseline.chance == 25.0 and baseline.majority == pytest.approx(100 / 3)
    captions = Task("c", data, Dataset.from_dict({"texts": [["x"]] * 5}))
    retrieval = protocol.eval_baseline(captions)
    assert retrieval.n == 5 and math.isnan(retrieval.chance) and math.isnan(retrieval.majority)
    assert protocol.baseline_cells([baseline, retrieval]) == [
        "| task | classes | eval n | chance | majority |", "|---|---|---|---|---|",
        "| t | 4 | 12 | 25.0 | 33.3 |", "| c | n/a (retrieval) | 5 | n/a | n/a |"]

    assert protocol.score_table("method", {"er": {"t": 50.0, "c": 10.0}, "x": {"t": 25.0}},
                                [baseline, retrieval]) == [
        "| method | t | c |", "|---|---|---|", "| chance / majority | 25.0 / 33.3 | n/a |",
        "| er | 50.0 ± 14.4 | 10.0 ± 13.4 |", "| x | 25.0 ± 12.5 | n/a |"]  # 100 sqrt(.25 / 12), sqrt(.09 / 5)


def test_binomial_standard_error_and_score_format() -> None:
    assert protocol.binomial_se(50.0, 100) == pytest.approx(5.0)  # 100 sqrt(0.25 / 100)
    assert protocol.binomial_se(41.2, 300) == pytest.approx(100 * math.sqrt(0.412 * 0.588 / 300))  # 2.84
    assert protocol.binomial_se(0.0, 10) == 0.0 and math.isnan(protocol.binomial_se(math.nan, 10))
    assert protocol.format_score(41.2, 300) == "41.2 ± 2.8" and protocol.format_score(41.25) == "41.2"
    assert protocol.format_score(math.nan, 10) == "n/a"
    for bad in ((50.0, 0), (120.0, 10), (50.0, 2.5)):
        with pytest.raises(ValueError):
            protocol.binomial_se(*bad)


# ---------------------------------------------------------------- paired verdicts


def test_paired_interval_matches_a_hand_t_interval() -> None:
    # d = a - b = 2, 3, 2, 3, 1: mean 2.2, sd sqrt(2.8 / 4), se sd / sqrt(5) = 0.37417, t_{0.975, 4} = 2.776
    verdict = protocol.paired_verdict("a > b", [3, 5, 4, 6, 2], [1, 2, 2, 3, 1])
    half = 2.776 * math.sqrt(0.7) / math.sqrt(5)  # 1.0387
    assert verdict.n == 5 and verdict.mean == pytest.approx(2.2)
    assert (verdict.low, verdict.high) == pytest.approx((2.2 - half, 2.2 + half), abs=1e-3)
    assert verdict.verdict == "holds"


@pytest.mark.parametrize("diffs, margin, expected", [
    ([2, 3, 2, 3, 1], 0.0, "holds"),
    ([-2, -3, -2, -3, -1], 0.0, "does not hold"),
    ([1, -1, 2, -2, 0.5], 0.0, "not separable at this scale"),
    ([0.1, 0.2, 0.1, 0.2, 0.15], 0.0, "holds"),  # small but sure
    ([0.1, 0.2, 0.1, 0.2, 0.15], 1.0, "does not hold"),  # the whole interval inside (-1, 1): too small to matter
    ([0.5, 1.5, 0.5, 1.5, 1.0], 1.0, "not separable at this scale"),  # above 0, but not surely above the margin
    ([3.0], 0.0, "not separable at this scale"),  # one pair
    ([2.0, math.nan, 3.0, 2.5], 0.0, "holds"),  # a NaN pair is left out
])
def test_verdict_cases(diffs, margin, expected) -> None:
    verdict = protocol.paired_verdict("x > y", diffs, [0.0] * len(diffs), margin=margin)
    assert verdict.verdict == expected
    assert verdict.n == sum(not math.isnan(d) for d in diffs)


def test_verdict_table_and_refusals() -> None:
    holds = protocol.paired_verdict("zscl > finetune", [3, 5, 4, 6, 2], [1, 2, 2, 3, 1])
    single = protocol.paired_verdict("one > other", [1.0], [0.0])
    assert protocol.verdict_table([holds, single]) == [
        "| claim | mean diff | 95% CI | n pairs | verdict |", "|---|---|---|---|---|",
        "| zscl > finetune | +2.20 | [+1.16, +3.24] | 5 | holds |",
        "| one > other | +1.00 | n/a | 1 | not separable at this scale |"]
    with pytest.raises(ValueError, match="pair up"):
        protocol.paired_verdict("a > b", [1, 2], [1])
    with pytest.raises(ValueError, match="several confidence levels"):
        protocol.verdict_table([holds, protocol.paired_verdict("c", [1, 2], [0, 0], confidence=0.9)])


def test_t_quantiles_from_the_table_match_scipy(monkeypatch) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    for confidence in (0.90, 0.95, 0.99):
        for df in (*range(1, 31), 35, 40, 50, 60, 90, 120, 500, 10_000):
            expected = scipy_stats.t.ppf((1 + confidence) / 2, df)
            assert protocol.t_table_quantile(confidence, df) == pytest.approx(expected, abs=6e-3)
            assert protocol.t_quantile(confidence, df) == pytest.approx(expected)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)  # as if scipy were not installed
    assert protocol.t_quantile(0.95, 4) == 2.776
    with pytest.raises(ValueError, match="without scipy"):
        protocol.t_quantile(0.8, 4)


# ---------------------------------------------------------------- plasticity and Transfer


def test_plasticity_and_transfer_over_columns() -> None:
    R = [[50, 10, 20],
         [60, 70, 30],
         [55, 65, 80]]
    assert protocol.plasticity(R) == pytest.approx((50 + 70 + 80) / 3)
    assert protocol.transfer_over(R, [0, 1, 2]) == pytest.approx((10 + (20 + 30) / 2) / 2) == mtil_transfer(R)
    assert protocol.transfer_over(R, [2]) == pytest.approx(25.0)
    assert math.isnan(protocol.transfer_over(R, [0])) and math.isnan(protocol.transfer_over(R, []))
    with pytest.raises(ValueError, match=r"columns \[3\] are outside the 3 tasks"):
        protocol.transfer_over(R, [3])


def test_above_majority_needs_two_standard_errors():
    baseline = protocol.TaskBaseline("pacs-photo", 255, 7, 100 / 7, 16.9)
    assert not protocol.above_majority(22.0, baseline)  # 22.0 - 2 x 2.59 = 16.8 < 16.9
    assert protocol.above_majority(23.0, baseline)  # 23.0 - 2 x 2.64 = 17.7
