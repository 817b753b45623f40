"""Continual-learning summaries of a task-by-task results matrix.

Notation: `R[i, j]` is the metric on task j's eval set after training on task i (0-based, T x T, higher is better);
`b[j]` is the score of the model before any continual training (the initial or "pretrained" model) on task j.

Conventions:
- Scores are percentages in [0, 100]; `scale="fraction"` reads fractions in [0, 1] (the summaries are then fractions
  too). With the default `scale=None` a matrix whose every value lies in [0, 1] is refused, and so is any infinite or
  out-of-range value, naming its cells (`hf_ccl.evaluation.checks`).
- NaN marks a cell that was not evaluated (`eval_every`, the upper triangle of a class-incremental run): a summary
  that reads a NaN cell is NaN, with a `NotEvaluatedWarning` naming the NaN cells.
- With T = 1 every metric that compares two training steps (forgetting, backward/forward transfer, the TiC
  triangle metrics and ZSCL's MTIL Transfer) is NaN; `summarize` keeps those keys (with NaN) so that its keys do not
  depend on T.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from .checks import NotEvaluatedWarning, check_scores, warn_not_evaluated

ArrayLike = np.ndarray | Sequence[Sequence[float]]
NAN = float("nan")


def as_square(R: ArrayLike) -> np.ndarray:
    """`R` as a float array of shape (T, T), T >= 1."""
    matrix = np.asarray(R, dtype=float)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"results matrix must be square T x T with T >= 1, got shape {matrix.shape}")
    return matrix


def _as_baseline(b: np.ndarray | Sequence[float], T: int) -> np.ndarray:
    baseline = np.asarray(b, dtype=float).reshape(-1)
    if baseline.shape != (T,):
        raise ValueError(f"initial scores b must have length {T}, got {baseline.shape[0]}")
    return baseline


def _checked(R: ArrayLike, scale: str | None, b: np.ndarray | None = None) -> np.ndarray:
    """`R` as a square float array, its values (and `b`'s) checked (`hf_ccl.evaluation.checks.check_scores`)."""
    matrix = as_square(R)
    check_scores(matrix, b, scale)
    return matrix


def _reported(name: str, value: float, matrix: np.ndarray, b: np.ndarray | None = None) -> float:
    """`value` as a float, with a `NotEvaluatedWarning` (at the caller's caller) when NaN cells made it NaN."""
    value = float(value)
    if math.isnan(value):
        warn_not_evaluated([name], matrix, b, stacklevel=4)
    return value


def final_average(R: ArrayLike, *, scale: str | None = None) -> float:
    """Average performance after the last task: (1/T) Σ_j R[T-1, j].

    The headline of most CL papers (CTP Tab. 1 "final performance"; TiC-CLIP Tab. 2 for static tasks).
    """
    matrix = _checked(R, scale)
    return _reported("final_average", matrix[-1].mean(), matrix)


def average_incremental(R: ArrayLike, *, scale: str | None = None) -> float:
    """Average incremental performance: (1/T) Σ_i [ (1/(i+1)) Σ_{j<=i} R[i, j] ].

    The mean over steps of the average on the tasks seen so far (CLL-CLIP's Average Recall AR_j averaged over j;
    CTP's "average incremental performance"; Rebuffi et al. 2017, iCaRL).
    """
    matrix = _checked(R, scale)
    seen_means = [matrix[i, : i + 1].mean() for i in range(matrix.shape[0])]
    return _reported("average_incremental", np.mean(seen_means), matrix)


def forgetting(R: ArrayLike, *, scale: str | None = None) -> float:
    """Average forgetting: (1/(T-1)) Σ_{j<T-1} max_{i∈[j, T-2]} (R[i, j] − R[T-1, j]).

    Chaudhry et al. 2018, "Riemannian Walk for Incremental Learning" (ECCV); the definition of the CTP spec
    (specs/ctp.md) and CLL-CLIP's F_T (specs/cllclip.md section 7, max over steps after task j was learned).
    Higher means more forgetting; negative values mean the old tasks improved. NaN when T = 1.
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    if T < 2:
        return NAN
    drops = [matrix[j : T - 1, j].max() - matrix[T - 1, j] for j in range(T - 1)]
    return _reported("forgetting", np.mean(drops), matrix)


def backward_transfer(R: ArrayLike, *, scale: str | None = None) -> float:
    """Backward transfer: (1/(T-1)) Σ_{j<T-1} (R[T-1, j] − R[j, j]).

    Lopez-Paz & Ranzato 2017, "Gradient Episodic Memory for Continual Learning" (NeurIPS), BWT.
    Negative values mean forgetting. NaN when T = 1.
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    if T < 2:
        return NAN
    return _reported("backward_transfer", np.mean([matrix[T - 1, j] - matrix[j, j] for j in range(T - 1)]), matrix)


def forward_transfer(R: ArrayLike, b: np.ndarray | Sequence[float], *, scale: str | None = None) -> float:
    """Forward transfer: (1/(T-1)) Σ_{j>=1} (R[j-1, j] − b[j]), with b the initial model's scores.

    Lopez-Paz & Ranzato 2017, "Gradient Episodic Memory for Continual Learning" (NeurIPS), FWT: how much training
    on the tasks before j helps task j before it is trained on. NaN when T = 1.
    """
    matrix = as_square(R)
    T = matrix.shape[0]
    baseline = _as_baseline(b, T)
    check_scores(matrix, baseline, scale)
    if T < 2:
        return NAN
    return _reported("forward_transfer", np.mean([matrix[j - 1, j] - baseline[j] for j in range(1, T)]), matrix,
                     baseline)


def _triangle_divisor(T: int) -> float:
    return T * (T - 1) / 2


def tic_in_domain(R: ArrayLike, *, scale: str | None = None) -> float:
    """TiC-CLIP in-domain performance: ID = (1/T) Σ_i R[i, i].

    Garg et al. 2024, "TiC-CLIP: Continual Training of CLIP Models" (ICLR), §2.2 and App. F (specs/ticclip.md §3).
    """
    matrix = _checked(R, scale)
    return _reported("tic_id", np.trace(matrix) / matrix.shape[0], matrix)


def tic_backward(R: ArrayLike, *, scale: str | None = None) -> float:
    """TiC-CLIP backward transfer: BWT = Σ_{i>j} R[i, j] / (T(T−1)/2), the flat mean of the strict lower triangle.

    Garg et al. 2024 (TiC-CLIP), App. F (specs/ticclip.md §3). A score level, not a difference. NaN when T = 1.
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    if T < 2:
        return NAN
    return _reported("tic_bwt", matrix[np.tril_indices(T, k=-1)].sum() / _triangle_divisor(T), matrix)


def tic_forward(R: ArrayLike, *, scale: str | None = None) -> float:
    """TiC-CLIP forward transfer: FWT = Σ_{i<j} R[i, j] / (T(T−1)/2), the flat mean of the strict upper triangle.

    Garg et al. 2024 (TiC-CLIP), App. F (specs/ticclip.md §3). NaN when T = 1.
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    if T < 2:
        return NAN
    return _reported("tic_fwt", matrix[np.triu_indices(T, k=1)].sum() / _triangle_divisor(T), matrix)


def tic_relative_backward(R: ArrayLike, *, scale: str | None = None) -> float:
    """TiC-CLIP relative BWT: Σ_{i>j} (R[i, j] − R[i, i]) / (T(T−1)/2), each row minus its own diagonal.

    Garg et al. 2024 (TiC-CLIP), App. F, Tab. 20 (specs/ticclip.md §3). NaN when T = 1.
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    if T < 2:
        return NAN
    rows, cols = np.tril_indices(T, k=-1)
    return _reported("tic_rel_bwt", (matrix[rows, cols] - matrix[rows, rows]).sum() / _triangle_divisor(T), matrix)


def tic_relative_forward(R: ArrayLike, *, scale: str | None = None) -> float:
    """TiC-CLIP relative FWT: Σ_{i<j} (R[i, j] − R[i, i]) / (T(T−1)/2), each row minus its own diagonal.

    Garg et al. 2024 (TiC-CLIP), App. F, Tab. 20 (specs/ticclip.md §3). Satisfies
    ((BWT − relBWT) + (FWT − relFWT)) / 2 == ID. NaN when T = 1.
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    if T < 2:
        return NAN
    rows, cols = np.triu_indices(T, k=1)
    return _reported("tic_rel_fwt", (matrix[rows, cols] - matrix[rows, rows]).sum() / _triangle_divisor(T), matrix)


def summarize(
    R: ArrayLike, b: np.ndarray | Sequence[float] | None = None, sizes: np.ndarray | Sequence[float] | None = None,
    *, scale: str | None = None,
) -> dict[str, float]:
    """Every summary of `R` in one dict.

    Keys: `final_average`, `average_incremental`, `forgetting`, `backward_transfer`, `tic_id`, `tic_bwt`, `tic_fwt`,
    `tic_rel_bwt`, `tic_rel_fwt`, `mtil_transfer`, `mtil_average`, `mtil_last`; only when the initial-model scores
    `b` are given, `forward_transfer` and `initial_average` (mean of b); only when the eval sizes `sizes` are given
    (a class-incremental matrix, scored among the classes seen so far), `class_incremental_average` and
    `class_incremental_last`. With T = 1 the keys that need two steps are present with NaN. `R` and `b` are checked
    together (`scale`, module docstring); one `NotEvaluatedWarning` names the keys that NaN cells made NaN.
    """
    matrix = as_square(R)
    T = matrix.shape[0]
    baseline = None if b is None else _as_baseline(b, T)
    scale = check_scores(matrix, baseline, scale)
    with warnings.catch_warnings():  # one warning for the whole summary, below
        warnings.simplefilter("ignore", NotEvaluatedWarning)
        summary = {
            "final_average": final_average(matrix, scale=scale),
            "average_incremental": average_incremental(matrix, scale=scale),
            "forgetting": forgetting(matrix, scale=scale),
            "backward_transfer": backward_transfer(matrix, scale=scale),
            "tic_id": tic_in_domain(matrix, scale=scale),
            "tic_bwt": tic_backward(matrix, scale=scale),
            "tic_fwt": tic_forward(matrix, scale=scale),
            "tic_rel_bwt": tic_relative_backward(matrix, scale=scale),
            "tic_rel_fwt": tic_relative_forward(matrix, scale=scale),
            "mtil_transfer": mtil_transfer(matrix, scale=scale),
            "mtil_average": mtil_average(matrix, scale=scale),
            "mtil_last": mtil_last(matrix, scale=scale),
        }
        if baseline is not None:
            summary["forward_transfer"] = forward_transfer(matrix, baseline, scale=scale)
            summary["initial_average"] = float(baseline.mean())
        if sizes is not None:
            summary["class_incremental_average"] = class_incremental_average(matrix, sizes, scale=scale)
            summary["class_incremental_last"] = class_incremental_last(matrix, sizes, scale=scale)
    warn_undefined(summary, matrix, baseline)
    return summary


#: The summaries that compare two training steps: NaN when T = 1, whatever the cells.
TWO_STEP_KEYS = frozenset({"forgetting", "backward_transfer", "forward_transfer", "tic_bwt", "tic_fwt", "tic_rel_bwt",
                           "tic_rel_fwt", "mtil_transfer"})


def warn_undefined(summary: dict[str, float], R: np.ndarray, b: np.ndarray | None = None) -> None:
    """One `NotEvaluatedWarning` (at the caller's caller) naming the keys of `summary` that NaN cells of `R` (or
    `b`) made NaN (not those NaN by the T = 1 convention) and those cells."""
    T = R.shape[0]
    undefined = [key for key, value in summary.items() if math.isnan(value) and not (T < 2 and key in TWO_STEP_KEYS)]
    warn_not_evaluated(undefined, R, b, stacklevel=4)


# ---------------------------------------------------------------------------------------------------------------
# MTIL (multi-domain task-incremental learning) metrics of ZSCL.
#
# Source: Zheng et al. 2023, "Preventing Zero-Shot Transfer Degradation in Continual Learning of Vision-Language
# Models" (ICCV), released code github.com/Thunderbeee/ZSCL at b96e714, `mtil/results.ipynb` cell 0,
# `statistics(arr)`: `avg = arr.mean(axis=0)`, `last = arr[-1, :]`,
# `transfer = [mean(arr[j, i] for j in range(i)) for i in range(1, 11)]`, each printed as its mean over datasets.
# Its matrices (`mtil/results/t3_*.npy`, 132 accuracies that `visualize` reshapes to 11 x 12) have one row per
# training step and no zero-shot row (the CIFAR10 column is dropped before the statistics), so
# the initial model's scores b enter none of the three; the "Zero-shot" row of ZSCL Tab. 3 (notebook cell 5) is the
# same statistics of b repeated on every row: `mtil_*(np.tile(b, (T, 1)))`.
# ---------------------------------------------------------------------------------------------------------------


def mtil_per_task(R: ArrayLike, *, scale: str | None = None) -> dict[str, np.ndarray]:
    """ZSCL's per-dataset Transfer, Avg and Last, each an array of length T.

    transfer[j] = (1/j) Σ_{i<j} R[i, j] (the models trained before task j, on task j; NaN for j = 0);
    average[j] = (1/T) Σ_i R[i, j] (every training step, before and after task j; no zero-shot row);
    last[j] = R[T-1, j].
    ZSCL `mtil/results.ipynb` cell 0, `statistics` (the "transfer: / avg: / last:" rows printed with ` & `).
    """
    matrix = _checked(R, scale)
    T = matrix.shape[0]
    transfer = np.array([NAN] + [matrix[:j, j].mean() for j in range(1, T)])
    return {"transfer": transfer, "average": matrix.mean(axis=0), "last": matrix[-1].copy()}


def mtil_transfer(R: ArrayLike, *, scale: str | None = None) -> float:
    """ZSCL "Transfer": (1/(T-1)) Σ_{j>=1} [ (1/j) Σ_{i<j} R[i, j] ], zero-shot transfer to not-yet-trained tasks.

    A mean over datasets 1..T-1 of column means of the strict upper triangle, so column j weighs 1/(T-1) whatever
    its height (unlike `tic_forward`, the flat mean of the same cells). ZSCL `mtil/results.ipynb` cell 0,
    `transfer = np.array([np.mean([arr[j, i] for j in range(i)]) for i in range(1, 11)])`, then `transfer.mean()`.
    NaN when T = 1.
    """
    matrix = _checked(R, scale)
    if matrix.shape[0] < 2:
        return NAN
    return _reported("mtil_transfer", mtil_per_task(matrix, scale=scale or "percent")["transfer"][1:].mean(), matrix)


def mtil_average(R: ArrayLike, *, scale: str | None = None) -> float:
    """ZSCL "Avg.": (1/T) Σ_j [ (1/T) Σ_i R[i, j] ], the mean over datasets of each dataset's mean over all T steps.

    Every training step counts, before and after task j is trained; the initial model does not (ZSCL's matrices
    have no zero-shot row). With no NaN this is the mean of all T² cells. ZSCL `mtil/results.ipynb` cell 0,
    `avg = arr.mean(axis=0)`, then `avg.mean()`.
    """
    matrix = _checked(R, scale)
    return _reported("mtil_average", mtil_per_task(matrix, scale=scale or "percent")["average"].mean(), matrix)


def mtil_last(R: ArrayLike, *, scale: str | None = None) -> float:
    """ZSCL "Last": (1/T) Σ_j R[T-1, j], the final model on every dataset (equal to `final_average`).

    ZSCL `mtil/results.ipynb` cell 0, `last = np.array(arr[-1, :])`, then `last.mean()`.
    """
    matrix = _checked(R, scale)
    return _reported("mtil_last", matrix[-1].mean(), matrix)


# ---------------------------------------------------------------------------------------------------------------
# Class-incremental accuracy over all seen examples (iCaRL protocol, as in Continual-CLIP / MoE-Adapters `cil/`).
# ---------------------------------------------------------------------------------------------------------------


def _as_sizes(sizes: np.ndarray | Sequence[float], T: int) -> np.ndarray:
    counts = np.asarray(sizes, dtype=float).reshape(-1)
    if counts.shape != (T,):
        raise ValueError(f"sizes must have length {T}, got {counts.shape[0]}")
    if not np.all(np.isfinite(counts)) or np.any(counts <= 0):
        raise ValueError(f"sizes must be positive example counts, got {counts.tolist()}")
    return counts


def class_incremental_per_step(
    R: ArrayLike, sizes: np.ndarray | Sequence[float], *, scale: str | None = None
) -> np.ndarray:
    """Accuracy after step i on all eval examples of tasks 0..i: A_i = Σ_{j<=i} n_j R[i, j] / Σ_{j<=i} n_j.

    `sizes[j]` = n_j, the number of eval examples of task j; with R[i, j] the accuracy on task j's examples this is
    the accuracy on their union (continuum's `Logger.accuracy` on `eval_dataset[:task_id + 1]`, MoE-Adapters
    `cil/main.py` l. 55-62, the per-step "acc" of `cil/experiments/class/*/metrics.json`). Only the lower
    triangle with the diagonal is read.
    """
    matrix = _checked(R, scale)
    counts = _as_sizes(sizes, matrix.shape[0])
    return np.array(
        [(matrix[i, : i + 1] * counts[: i + 1]).sum() / counts[: i + 1].sum() for i in range(matrix.shape[0])]
    )


def class_incremental_average(
    R: ArrayLike, sizes: np.ndarray | Sequence[float], *, scale: str | None = None
) -> float:
    """Average incremental accuracy: (1/T) Σ_i A_i, with A_i of `class_incremental_per_step`.

    Rebuffi et al. 2017, "iCaRL: Incremental Classifier and Representation Learning" (CVPR); MoE-Adapters `cil/main.py`
    l. 78, `'avg': round(statistics.mean(acc_list), 2)` (continuum `Logger.average_incremental_accuracy`).
    The size-weighted counterpart of `average_incremental`; equal to it when all sizes are equal.
    """
    matrix = _checked(R, scale)
    per_step = class_incremental_per_step(matrix, sizes, scale=scale or "percent")
    return _reported("class_incremental_average", per_step.mean(), matrix)


def class_incremental_last(
    R: ArrayLike, sizes: np.ndarray | Sequence[float], *, scale: str | None = None
) -> float:
    """Accuracy after the last step on all eval examples: A_{T-1} = Σ_j n_j R[T-1, j] / Σ_j n_j.

    MoE-Adapters `cil/main.py` l. 77, `'last': round(acc_list[-1], 2)`. Equal to `final_average` when all sizes
    are equal.
    """
    matrix = _checked(R, scale)
    per_step = class_incremental_per_step(matrix, sizes, scale=scale or "percent")
    return _reported("class_incremental_last", per_step[-1], matrix)
