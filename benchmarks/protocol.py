"""The protocol every benchmark script shares: orders and seeds, chance and majority rates, standard errors, claim
verdicts from paired differences, plasticity and Transfer over chosen tasks.

What each number is:
- a **score** (accuracy or Recall@K, %) on n eval rows has binomial standard error `sqrt(p (1 - p) / n)` in
  percentage points: the uncertainty from the finite eval set alone (runs that share the eval set share it);
- **chance** = 100 / K for K classes (a uniform guess); **majority** = the largest class's share of the eval rows
  (a constant guess). A classification score means something only above both;
- a **verdict** on a claim "a > b" is read from the differences a_i - b_i of runs paired by (order, seed): their
  mean and Student-t confidence interval (see `paired_verdict`);
- **plasticity** = mean of R[t, t] (accuracy right after training each task), beside forgetting, so that "forgets
  little" and "learns little" are told apart;
- **Transfer** as ZSCL defines it (`hf_ccl.evaluation.continual_metrics.mtil_transfer`), and `transfer_over` the
  same restricted to chosen tasks (e.g. those where the starting model is above the majority rate).

Scripts import it as `from protocol import ...` (benchmarks/ is not a package; its folder is on `sys.path` when a
script in it runs).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hf_ccl.callbacks import TaskCallback

RANDOM = "random"
GIVEN = "given"
#: The `--runs-dir` default as argparse shows it; replaced by a fresh temporary folder when the option is not given.
FRESH_RUNS_DIR = "(a fresh temporary folder per process)"
HOLDS, DOES_NOT_HOLD, NOT_SEPARABLE = "holds", "does not hold", "not separable at this scale"
VERDICT_NOTE = (
    "Verdict on a claim \"a > b\": differences a - b paired by (order, seed), their mean and Student-t confidence "
    "interval. holds: the interval lies above 0 and the mean above the margin; does not hold: the interval lies "
    "below 0, or (margin > 0) inside (-margin, margin), an effect too small to matter; otherwise, or with fewer than "
    "2 pairs, not separable at this scale."
)
BASELINE_NOTE = (
    "chance = 100/K for K classes; majority = the largest class's share of the eval rows (a constant guess); "
    "± = binomial standard error of a score on the task's n eval rows, sqrt(p(1-p)/n) (for a retrieval score, "
    "n queries; approximate for R_mean, a mean of several recalls)."
)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise argparse.ArgumentTypeError(f"names repeat: {', '.join(repeated)}")
    return names


def parse_seeds(text: str) -> list[int]:
    """`"0,1,2"` -> [0, 1, 2] (integers, each once); an argparse error otherwise."""
    try:
        seeds = [int(seed) for seed in _names(text)]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {text!r}") from error
    return seeds


def _runs_dir(text: str) -> Path:
    if text == FRESH_RUNS_DIR:
        return Path(tempfile.mkdtemp(prefix="hf_ccl_bench_"))
    return Path(text).expanduser()


def add_stream_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_output: str,
    orders: Sequence[str] = ("I", "II", RANDOM),
    default_seeds: str = "0,1,2",
    tasks_help: str | None = None,
) -> None:
    """Add `--order` (when `orders` is not empty), `--tasks`, `--seeds`, `--output` and `--runs-dir` to `parser`.

    Parsed: `args.order` (list of order names, default all of `orders`; 'random' = a seeded permutation of the task
    list, a different one per seed, see `task_orders`), `args.tasks` (task keys in the order given, or None),
    `args.seeds` (list of ints), `args.output` (a Path: the prefix of the results files, `results_path`),
    `args.runs_dir` (a Path where runs write their `output_dir`; by default a fresh `tempfile.mkdtemp` folder, made
    only when the option is not given). `tasks_help` says what a task is for the script's stream.
    """
    if orders:
        valid = list(orders)

        def order_list(text: str) -> list[str]:
            names = _names(text)
            unknown = [name for name in names if name not in valid]
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown order(s) {unknown}; valid: {', '.join(valid)}")
            return names

        parser.add_argument(
            "--order", type=order_list, default=",".join(valid),
            help=f"comma-separated orders of the tasks, each run with every seed (default: all of {', '.join(valid)})"
                 f"; '{RANDOM}' is a permutation of the task list drawn from the seed (another one per seed)"
                 + (f"; with --tasks the fixed orders give way to the given list (order name '{GIVEN}')"
                    if RANDOM in valid else ""),
        )
    parser.add_argument(
        "--tasks", type=_names, default=None,
        help=tasks_help or "comma-separated task keys, trained in the order given (default: the stream's own tasks)",
    )
    parser.add_argument("--seeds", type=parse_seeds, default=default_seeds,
                        help=f"comma-separated seeds (model init, data order); default {default_seeds}")
    parser.add_argument("--output", type=Path, default=default_output,
                        help="path prefix of the results files (.md, .json, .png are added); default %(default)s")
    parser.add_argument("--runs-dir", type=_runs_dir, default=FRESH_RUNS_DIR,
                        help="folder the runs write their output_dir under; default: %(default)s")


def results_path(prefix: str | Path, suffix: str) -> Path:
    """`prefix` + `suffix` (`results/mtil` + `.md`), its folder made; a dot in the prefix's name is kept."""
    path = Path(f"{prefix}{suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def task_orders(
    orders: Sequence[str], fixed: Mapping[str, Sequence[str]], tasks: Sequence[str] | None, seed: int
) -> dict[str, list[str]]:
    """Order name -> task keys, for one seed.

    A name of `fixed` gives that fixed order; with `tasks` given, the fixed orders asked for give way to one order
    named 'given' holding `tasks` as given. 'random' is `np.random.default_rng(seed).permutation` of `tasks` (or of
    `fixed['I']`, else the first fixed order), drawn again from the same generator while it equals another order
    asked for (a repeated run would count twice in a paired verdict), unless no other permutation exists. Any other
    name is a ValueError naming the valid ones.
    """
    valid = [*fixed, RANDOM]
    unknown = [name for name in orders if name not in valid]
    if unknown:
        raise ValueError(f"unknown order(s) {unknown}; valid: {', '.join(valid)}")
    if not fixed and tasks is None:
        raise ValueError("task_orders needs a fixed order or a task list")
    base = list(tasks) if tasks is not None else list(fixed.get("I", next(iter(fixed.values()))))
    named = {(GIVEN if tasks is not None else name): list(tasks if tasks is not None else fixed[name])
             for name in orders if name != RANDOM}
    result = {}
    for name in dict.fromkeys(orders):
        key = name if name == RANDOM or tasks is None else GIVEN
        if key == RANDOM:
            rng, taken = np.random.default_rng(seed), [tuple(order) for order in named.values()]
            drawn = [base[i] for i in rng.permutation(len(base))]
            while tuple(drawn) in taken and len(set(taken)) < math.factorial(len(base)):
                drawn = [base[i] for i in rng.permutation(len(base))]
            result[RANDOM] = drawn
        else:
            result[key] = named[key]
    return result


def reorder(stream: Any, names: Sequence[str]) -> Any:
    """A `TaskStream` holding the tasks `names` of `stream`, in that order (a stream whose builder takes no order
    or task list). Each task keeps its rows: a task's subsamples are keyed by its name, not its place."""
    tasks = {task.name: task for task in stream}
    unknown = [name for name in names if name not in tasks]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown} of stream {stream.name!r}; valid: {', '.join(tasks)}")
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise ValueError(f"tasks name a task twice: {', '.join(repeated)}")
    return replace(stream, tasks=[tasks[name] for name in names])


# ----------------------------------------------------------------------------------------------------------------
# Chance, majority, standard errors
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TaskBaseline:
    """What a classification score on a task's eval split is to be read against (percentages; NaN for a task
    scored by retrieval)."""

    task: str
    n: int  # eval rows
    n_classes: int  # classes the task is scored among (0 for retrieval)
    chance: float  # 100 / n_classes: a uniform guess
    majority: float  # the largest class's share of the eval rows: a constant guess


def eval_baseline(task: Any) -> TaskBaseline:
    """Chance and majority-class rate of a hf_ccl `Task`'s eval split (labels in its `label` column)."""
    n = len(task.eval)
    if task.kind != "classification":
        return TaskBaseline(task.name, n, 0, math.nan, math.nan)
    labels = task.eval.with_format("arrow")["label"].to_pylist()
    largest = max(Counter(labels).values()) if labels else 0
    return TaskBaseline(task.name, n, len(task.class_names), 100.0 / len(task.class_names),
                        100.0 * largest / n if n else math.nan)


def binomial_se(percent: float, n: int) -> float:
    """Standard error of a proportion `percent` (%) measured on `n` rows, in percentage points: 100 sqrt(p(1-p)/n)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive number of rows, got {n!r}")
    if math.isnan(percent):
        return math.nan
    if not 0.0 <= percent <= 100.0:
        raise ValueError(f"percent must lie in [0, 100], got {percent!r}")
    p = percent / 100.0
    return 100.0 * math.sqrt(p * (1.0 - p) / int(n))


def above_majority(percent: float, baseline: TaskBaseline) -> bool:
    """Whether a score (%) on the task's eval rows beats its majority-class rate by more than 2 binomial SE."""
    return bool(percent - 2 * binomial_se(percent, baseline.n) > baseline.majority)


def format_score(percent: float, n: int | None = None, digits: int = 1) -> str:
    """`"41.2 ± 2.8"`: the score and, when `n` is given, its binomial standard error; `"n/a"` for NaN."""
    if percent is None or math.isnan(percent):
        return "n/a"
    if n is None:
        return f"{percent:.{digits}f}"
    return f"{percent:.{digits}f} ± {binomial_se(percent, n):.{digits}f}"


def baseline_cells(baselines: Sequence[TaskBaseline]) -> list[str]:
    """Markdown table lines: task | classes | eval n | chance | majority (retrieval tasks: n/a)."""
    lines = ["| task | classes | eval n | chance | majority |", "|---|---|---|---|---|"]
    for b in baselines:
        classes = str(b.n_classes) if b.n_classes else "n/a (retrieval)"
        lines.append(f"| {b.task} | {classes} | {b.n} | {format_score(b.chance)} | {format_score(b.majority)} |")
    return lines


def score_table(first_column: str, rows: Mapping[str, Mapping[str, float]],
                baselines: Sequence[TaskBaseline]) -> list[str]:
    """Markdown table lines of per-task scores: one column per task of `baselines` (in that order), a first row
    "chance / majority" (classification tasks), then one row per entry of `rows` (label -> task -> score, %), each
    score ± its binomial standard error on the task's eval rows (`format_score`); a task missing from a row: n/a."""
    lines = [f"| {first_column} | " + " | ".join(b.task for b in baselines) + " |",
             "|---" * (len(baselines) + 1) + "|"]
    if any(b.n_classes for b in baselines):
        lines.append("| chance / majority | " + " | ".join(
            f"{format_score(b.chance)} / {format_score(b.majority)}" if b.n_classes else "n/a" for b in baselines
        ) + " |")
    for label, scores in rows.items():
        cells = [format_score(scores.get(b.task, math.nan), b.n) for b in baselines]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Paired verdicts
# ----------------------------------------------------------------------------------------------------------------

# Two-sided Student-t quantiles t_{(1+c)/2, df} for when scipy is not installed (df 1..30, 40, 60, 120, infinity).
_T_DFS = (*range(1, 31), 40, 60, 120, math.inf)
_T_TABLE = {
    0.90: (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
           1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
           1.684, 1.671, 1.658, 1.645),
    0.95: (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
           2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
           2.021, 2.000, 1.980, 1.960),
    0.99: (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055, 3.012, 2.977, 2.947,
           2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750,
           2.704, 2.660, 2.617, 2.576),
}


def t_table_quantile(confidence: float, df: int) -> float:
    """The two-sided Student-t quantile from the table above (linear in 1/df between its rows)."""
    if confidence not in _T_TABLE:
        raise ValueError(f"without scipy, confidence must be one of {sorted(_T_TABLE)}, got {confidence!r}")
    values = _T_TABLE[confidence]
    for i, tabled in enumerate(_T_DFS):
        if df == tabled:
            return values[i]
        if df < tabled:
            lo, hi = _T_DFS[i - 1], tabled
            weight = (1 / lo - 1 / df) / (1 / lo - (0.0 if math.isinf(hi) else 1 / hi))
            return values[i - 1] + weight * (values[i] - values[i - 1])
    return values[-1]


def t_quantile(confidence: float, df: int) -> float:
    """Two-sided Student-t quantile t_{(1+confidence)/2, df}: scipy's when installed, else `t_table_quantile`."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    try:
        from scipy.stats import t
    except ImportError:
        return t_table_quantile(confidence, df)
    return float(t.ppf((1.0 + confidence) / 2.0, df))


@dataclass
class Verdict:
    """A claim "a > b" judged from paired differences a - b: mean, confidence interval [low, high], pairs."""

    claim: str
    mean: float
    low: float
    high: float
    n: int
    verdict: str  # HOLDS, DOES_NOT_HOLD or NOT_SEPARABLE
    confidence: float = 0.95
    margin: float = 0.0


def paired_verdict(
    claim: str, a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, margin: float = 0.0
) -> Verdict:
    """Judge the claim "a > b" from runs paired by (order, seed): `a[i]` and `b[i]` come from the same order and seed.

    d_i = a_i - b_i; mean m, interval m ± t_{(1+confidence)/2, n-1} · sd(d) / sqrt(n) (sd with n - 1). Pairs where
    either value is NaN are left out (n counts the others). Verdict:
    - "holds": low > 0 and m > margin;
    - "does not hold": high < 0, or, when margin > 0, the whole interval inside (-margin, margin) (an effect too
      small to matter);
    - otherwise "not separable at this scale"; always so with fewer than 2 pairs.
    """
    if len(a) != len(b):
        raise ValueError(f"{claim!r}: a has {len(a)} values and b {len(b)}; they must pair up by (order, seed)")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin!r}")
    diffs = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    diffs = diffs[~np.isnan(diffs)]
    n = len(diffs)
    mean = float(diffs.mean()) if n else math.nan
    if n < 2:
        return Verdict(claim, mean, math.nan, math.nan, n, NOT_SEPARABLE, confidence, margin)
    half = t_quantile(confidence, n - 1) * float(diffs.std(ddof=1)) / math.sqrt(n)
    low, high = mean - half, mean + half
    if low > 0 and mean > margin:
        verdict = HOLDS
    elif high < 0 or (margin > 0 and -margin < low and high < margin):
        verdict = DOES_NOT_HOLD
    else:
        verdict = NOT_SEPARABLE
    return Verdict(claim, mean, low, high, n, verdict, confidence, margin)


def verdict_table(verdicts: Sequence[Verdict]) -> list[str]:
    """Markdown table lines: claim | mean diff | CI | n pairs | verdict (all verdicts at one confidence)."""
    levels = {v.confidence for v in verdicts}
    if len(levels) > 1:
        raise ValueError(f"verdicts at several confidence levels {sorted(levels)}: one table per level")
    level = f"{100 * levels.pop():g}% CI" if levels else "CI"
    lines = [f"| claim | mean diff | {level} | n pairs | verdict |", "|---|---|---|---|---|"]
    for v in verdicts:
        interval = "n/a" if math.isnan(v.low) else f"[{v.low:+.2f}, {v.high:+.2f}]"
        mean = "n/a" if math.isnan(v.mean) else f"{v.mean:+.2f}"
        lines.append(f"| {v.claim} | {mean} | {interval} | {v.n} | {v.verdict} |")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Plasticity and Transfer
# ----------------------------------------------------------------------------------------------------------------


def _square(R: Any) -> np.ndarray:
    matrix = np.asarray(R, dtype=float)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"results matrix must be square T x T with T >= 1, got shape {matrix.shape}")
    return matrix


def plasticity(R: Any) -> float:
    """Mean of the diagonal R[t, t]: the score on each task right after training it (R: rows = after task t,
    columns = eval task)."""
    return float(np.mean(np.diag(_square(R))))


def transfer_over(R: Any, columns: Sequence[int]) -> float:
    """ZSCL Transfer restricted to the task columns `columns`: the mean over j in `columns`, j >= 1, of the mean of
    R[:j, j] (the models trained before task j, scored on it). NaN when no column j >= 1 is given. With every column
    it equals `hf_ccl.evaluation.continual_metrics.mtil_transfer(R)`."""
    matrix = _square(R)
    T = matrix.shape[0]
    outside = [j for j in columns if not 0 <= j < T]
    if outside:
        raise ValueError(f"columns {outside} are outside the {T} tasks")
    kept = sorted({int(j) for j in columns if j >= 1})
    if not kept:
        return math.nan
    return float(np.mean([matrix[:j, j].mean() for j in kept]))


# ----------------------------------------------------------------------------------------------------------------
# The control column: the starting model's own domain
# ----------------------------------------------------------------------------------------------------------------


def control_task(options: Any) -> Any:
    """Flickr8k English test retrieval on a fixed subset of `options.control_examples` images: the pretraining
    domain of the benchmarks' starting model (`pretrain_start.py`), which the methods should keep."""
    from hf_ccl.data import build_stream

    return build_stream("flickr8k-languages", languages=["en"], max_train_per_task=1,
                        max_eval_per_task=options.control_examples)[0]


class ControlRetrieval(TaskCallback):
    """The control column: the model's retrieval R_mean on `task` after every evaluated task (`scores`)."""

    def __init__(self, task: Any) -> None:
        self.task, self.scores = task, []

    def on_task_evaluated(self, args, state, control, learner=None, **kwargs) -> None:  # noqa: ANN001
        from hf_ccl.evaluation.evaluator import evaluate_task

        self.scores.append(evaluate_task(learner.model, self.task, learner.image_processor,
                                         learner.tokenizer)["R_mean"])
