"""Checks of what the metrics are given: embeddings must be finite; score matrices finite (NaN only where a cell
was not evaluated) and on one scale.

**Scale of a results matrix.** Scores are percentages in [0, 100] (what the evaluator writes). `scale="fraction"`
reads them in [0, 1]; every summary is linear in the scores, so its value is then a fraction too (forgetting 0.2,
not 20). With the default `scale=None`, a matrix (with its initial scores) whose every finite value lies in [0, 1]
is refused: fractions given as percentages would read as near-zero scores. Say `scale="percent"` for percentages that
are all that small (a weak model's Recall@1 on a large eval set), `scale="fraction"` for fractions.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

SCALES = {"percent": 100.0, "fraction": 1.0}
SHOWN = 5  # offending rows or cells named in a message


class NonFiniteEmbeddingError(ValueError):
    """Embeddings with NaN or infinite values (a diverged model): no metric can be computed from them."""


class NotEvaluatedWarning(UserWarning):
    """A summary is NaN because it reads cells marked not evaluated (NaN)."""


def _listed(items: Sequence[str], total: int) -> str:
    return ", ".join(items) + (f", ... ({total} in all)" if total > len(items) else "")


def check_finite_embeddings(embeds: torch.Tensor, name: str) -> None:
    """Raise `NonFiniteEmbeddingError` naming the rows of `embeds` (`[n, d]`) that hold NaN or infinite values."""
    bad = ~torch.isfinite(embeds).all(dim=-1) if embeds.ndim == 2 else ~torch.isfinite(embeds)
    if not bool(bad.any()):
        return
    rows = bad.reshape(-1).nonzero().reshape(-1)
    shown = [str(int(row)) for row in rows[:SHOWN]]
    raise NonFiniteEmbeddingError(
        f"{name}: {rows.numel()} of {bad.numel()} rows hold NaN or infinite values "
        f"(row {_listed(shown, rows.numel())}); "
        "the model that produced them is not finite (diverged?), so no score can be computed"
    )


def _cells(mask: np.ndarray, values: np.ndarray, label: str, with_values: bool = True) -> tuple[list[str], int]:
    """The first `SHOWN` cells where `mask` holds, as "R[i, j] = value", and how many there are."""
    where = np.argwhere(mask)
    names = [f"{label}[{', '.join(str(int(i)) for i in index)}]"
             + (f" = {values[tuple(index)]:g}" if with_values else "") for index in where[:SHOWN]]
    return names, len(where)


def check_scores(R: np.ndarray, b: np.ndarray | None = None, scale: str | None = None) -> str:
    """Check a results matrix `R` (and initial scores `b`): no infinite value, every finite value in [0, 100] (or
    [0, 1] with `scale="fraction"`), and with `scale=None` not every value in [0, 1] (module docstring). NaN marks a
    cell that was not evaluated and passes. Returns the scale ("percent" or "fraction")."""
    if scale is not None and scale not in SCALES:
        raise ValueError(f"scale must be 'percent', 'fraction' or None (percent; all values in [0, 1] refused), "
                         f"got {scale!r}")
    top = SCALES[scale or "percent"]
    arrays = [("R", R)] + ([] if b is None else [("b", b)])
    for label, values in arrays:
        infinite = np.isinf(values)
        if infinite.any():
            cells, total = _cells(infinite, values, label)
            raise ValueError("scores must be finite (NaN marks a cell that was not evaluated): "
                             + _listed(cells, total))
        outside = np.isfinite(values) & ((values < 0) | (values > top))
        if outside.any():
            cells, total = _cells(outside, values, label)
            raise ValueError(f"scores must lie in [0, {top:g}] ({scale or 'percent'}): {_listed(cells, total)}"
                             + ("; for fractions in [0, 1] pass scale='fraction'" if top == 1.0 else ""))
    finite = np.concatenate([values[np.isfinite(values)] for _, values in arrays])
    if scale is None and finite.size and float(finite.max()) <= 1.0:
        raise ValueError(
            "every score lies in [0, 1]: scores are percentages (0-100). Multiply fractions by 100 or pass "
            "scale='fraction' (the summaries are then fractions too); pass scale='percent' if these are percentages "
            "that all happen to be at most 1"
        )
    return scale or "percent"


def warn_not_evaluated(
    names: Sequence[str], R: np.ndarray, b: np.ndarray | None = None, stacklevel: int = 3
) -> None:
    """A `NotEvaluatedWarning` that the summaries `names` are NaN because they read NaN cells of `R` (or `b`),
    naming those cells; nothing when `names` is empty or there is no NaN cell."""
    cells: list[str] = []
    total = 0
    for label, values in [("R", R)] + ([] if b is None else [("b", b)]):
        found, count = _cells(np.isnan(values), values, label, with_values=False)
        cells += found
        total += count
    if names and total:
        verb = "is NaN: it reads" if len(names) == 1 else "are NaN: they read"
        warnings.warn(f"{', '.join(names)} {verb} cells marked not evaluated (NaN): {_listed(cells[:SHOWN], total)}",
                      NotEvaluatedWarning, stacklevel=stacklevel)
