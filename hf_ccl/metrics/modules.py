"""The base classes of hf_ccl's `evaluate` metric modules: each module (a folder `hf_ccl/metrics/<name>/` with
`<name>.py` and its card `README.md`, loaded with `evaluate.load(hf_ccl.metrics.path(name))`) wraps one plain function
of `hf_ccl.evaluation`; nothing is computed twice.

Inputs:
- retrieval and zero-shot modules take embeddings row by row: `predictions` are the query embeddings (captions for
  `recall_at_k`, images for `zero_shot_accuracy`) and `references` what each one belongs to (its image's index, its
  class), with the other side (`image_embeds`, `class_embeds`) given to `compute`;
- results-matrix modules take the matrix row by row as `predictions` (row i: every task's score after training task
  i), with the initial model's scores `initial` and the eval sizes `sizes` given to `compute` where a metric needs them.

`evaluate.combine` passes every keyword to every module, so a module accepts the options of its siblings and ignores
them; a keyword no hf_ccl module knows is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import datasets
import evaluate
import numpy as np
import torch

import hf_ccl.evaluation.continual_metrics as cm
from hf_ccl.evaluation.checks import NotEvaluatedWarning, check_finite_embeddings, check_scores

#: Every `compute` option of any hf_ccl module (what `evaluate.combine` may pass to a module that does not use it).
KNOWN_OPTIONS = frozenset({"image_embeds", "class_embeds", "ks", "text_ids", "chunk_size", "initial", "sizes", "scale"})
CITATION_HF_CCL = "hf_ccl: continual learning for CLIP-style models, the Hugging Face way."
MATRIX_INPUTS = """
Args:
    predictions: the results matrix, one list per row: row i holds every task's score (percent) after training
        task i (T rows of T scores).
    initial: the initial model's score on each task (forward_transfer; optional for continual_metrics).
    sizes: the number of eval examples of each task (class_incremental; optional for continual_metrics).
    scale: None (default: percent, and a matrix whose every score lies in [0, 1] is refused as fractions),
        "percent" (scores in [0, 100]) or "fraction" (scores in [0, 1]; the results are then fractions too).
Returns: a dict of floats (NaN where a metric is undefined: forgetting with T = 1, or a metric that reads a cell
marked not evaluated (NaN), with a warning naming the NaN cells). An infinite or out-of-range score is refused,
naming its cell.
"""


def check_options(module: str, options: Mapping[str, Any]) -> None:
    """Refuse a `compute` keyword that no hf_ccl module takes (a typo would otherwise be ignored)."""
    unknown = sorted(set(options) - KNOWN_OPTIONS)
    if unknown:
        raise ValueError(f"{module}: unknown option(s) {unknown}; hf_ccl's metric modules take {sorted(KNOWN_OPTIONS)}")


class HFCCLMetric(evaluate.Metric):
    """Shared `_info`: the module's description, inputs and features, with hf_ccl's citation."""

    description: ClassVar[str] = ""
    inputs_description: ClassVar[str] = ""
    citation: ClassVar[str] = CITATION_HF_CCL
    features: ClassVar[datasets.Features]

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.description, citation=self.citation, inputs_description=self.inputs_description,
            features=self.features, reference_urls=["https://github.com/huggingface/evaluate"],
        )

    def compute(self, *, predictions: Any = None, references: Any = None, **kwargs: Any) -> dict[str, float] | None:
        """`evaluate`'s compute after `check_inputs`: bad inputs are refused before evaluate writes its cache file
        and takes its lock (an error raised inside `_compute` leaves the lock held, and the module's next compute
        waits a second for it)."""
        self.check_inputs(predictions, references, **kwargs)
        return super().compute(predictions=predictions, references=references, **kwargs)

    def check_inputs(self, predictions: Any, references: Any, **options: Any) -> None:
        """Refuse unknown options (predictions None: given earlier through `add_batch`, checked by `_compute`)."""
        check_options(self.name, options)


class EmbeddingMetric(HFCCLMetric):
    """Queries' embeddings (`predictions`) and what each belongs to (`references`); the other side's embeddings
    are the `compute` option `other` (`image_embeds`, `class_embeds`). `names`: what the plain function calls the
    predictions and the other side."""

    features = datasets.Features({"predictions": datasets.Sequence(datasets.Value("float32")),
                                  "references": datasets.Value("int64")})
    other: ClassVar[str] = ""
    names: ClassVar[tuple[str, str]] = ("", "")

    def check_inputs(self, predictions: Any, references: Any, **options: Any) -> None:
        """Unknown options, and embeddings with NaN or infinite rows (`NonFiniteEmbeddingError`, naming them)."""
        super().check_inputs(predictions, references, **options)
        for values, name in ((predictions, self.names[0]), (options.get(self.other), self.names[1])):
            if values is not None and len(values):
                check_finite_embeddings(as_tensor(values), name)


class MatrixMetric(HFCCLMetric):
    """A results matrix, one row per `predictions` entry; `metrics` maps each output key to its plain function of
    (R, initial, sizes, scale). The matrix (with `initial`) is checked once (`hf_ccl.evaluation.checks`)."""

    features = datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64"))})
    metrics: ClassVar[dict[str, Callable[..., float]]] = {}
    needs: ClassVar[tuple[str, ...]] = ()

    def check_inputs(self, predictions: Any, references: Any, **options: Any) -> None:
        """Unknown options, missing `initial` / `sizes`, and the matrix's scores (`checked_matrix`)."""
        super().check_inputs(predictions, references, **options)
        missing = [name for name in self.needs if options.get(name) is None]
        if missing:
            raise ValueError(f"{self.name} needs {', '.join(missing)} (compute(predictions=..., {missing[0]}=...))")
        if predictions is not None:
            checked_matrix(predictions, options.get("initial"), options.get("scale"))

    def _compute(self, predictions: Sequence[Sequence[float]], initial: Sequence[float] | None = None,
                 sizes: Sequence[float] | None = None, scale: str | None = None, **options: Any) -> dict[str, float]:
        self.check_inputs(predictions, None, initial=initial, sizes=sizes, scale=scale, **options)
        matrix, scale = checked_matrix(predictions, initial, scale)
        with warnings.catch_warnings():  # one warning for the module's results, below
            warnings.simplefilter("ignore", NotEvaluatedWarning)
            results = {key: float(function(matrix, initial=initial, sizes=sizes, scale=scale))
                       for key, function in self.metrics.items()}
        cm.warn_undefined(results, matrix, None if initial is None else np.asarray(initial, dtype=float).reshape(-1))
        return results


def of_matrix(function: Callable[..., float]) -> Callable[..., float]:
    """A `MatrixMetric.metrics` entry for `function(R, scale=...)`."""
    return lambda R, initial=None, sizes=None, scale=None: function(R, scale=scale)


def of_matrix_and_initial(function: Callable[..., float]) -> Callable[..., float]:
    """A `MatrixMetric.metrics` entry for `function(R, initial, scale=...)`."""
    return lambda R, initial=None, sizes=None, scale=None: function(R, initial, scale=scale)


def of_matrix_and_sizes(function: Callable[..., float]) -> Callable[..., float]:
    """A `MatrixMetric.metrics` entry for `function(R, sizes, scale=...)`."""
    return lambda R, initial=None, sizes=None, scale=None: function(R, sizes, scale=scale)


def as_tensor(rows: Sequence[Sequence[float]] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Rows of floats (what `evaluate` hands over: lists or a numpy array) as a float32 tensor."""
    return torch.as_tensor(np.asarray([list(row) for row in rows] if len(rows) else [], dtype=np.float32))


def as_index(values: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Integer indices (labels, image indices) as an int64 tensor."""
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


def as_matrix(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """A results matrix given row by row, as a float array."""
    return np.asarray([list(row) for row in rows], dtype=float)


def checked_matrix(rows: Sequence[Sequence[float]], initial: Sequence[float] | None,
                   scale: str | None) -> tuple[np.ndarray, str]:
    """The matrix, square, its scores and the initial ones checked together; and the scale they are on."""
    matrix = cm.as_square(as_matrix(rows))
    baseline = None if initial is None else np.asarray(initial, dtype=float).reshape(-1)
    return matrix, check_scores(matrix, baseline, scale)
