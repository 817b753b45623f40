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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import datasets
import evaluate
import numpy as np
import torch

#: Every `compute` option of any hf_ccl module (what `evaluate.combine` may pass to a module that does not use it).
KNOWN_OPTIONS = frozenset({"image_embeds", "class_embeds", "ks", "text_ids", "chunk_size", "initial", "sizes"})
CITATION_HF_CCL = "hf_ccl: continual learning for CLIP-style models, the Hugging Face way."
MATRIX_INPUTS = """
Args:
    predictions: the results matrix, one list per row: row i holds every task's score (percent) after training
        task i (T rows of T scores).
    initial: the initial model's score on each task (forward_transfer; optional for continual_metrics).
    sizes: the number of eval examples of each task (class_incremental; optional for continual_metrics).
Returns: a dict of floats (NaN where a metric is undefined, e.g. forgetting with T = 1).
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


class EmbeddingMetric(HFCCLMetric):
    """Queries' embeddings (`predictions`) and what each belongs to (`references`)."""

    features = datasets.Features({"predictions": datasets.Sequence(datasets.Value("float32")),
                                  "references": datasets.Value("int64")})


class MatrixMetric(HFCCLMetric):
    """A results matrix, one row per `predictions` entry; `metrics` maps each output key to its plain function of
    (R, initial, sizes)."""

    features = datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64"))})
    metrics: ClassVar[dict[str, Callable[..., float]]] = {}
    needs: ClassVar[tuple[str, ...]] = ()

    def _compute(self, predictions: Sequence[Sequence[float]], initial: Sequence[float] | None = None,
                 sizes: Sequence[float] | None = None, **options: Any) -> dict[str, float]:
        check_options(self.name, options)
        given = {"initial": initial, "sizes": sizes}
        missing = [name for name in self.needs if given[name] is None]
        if missing:
            raise ValueError(f"{self.name} needs {', '.join(missing)} (compute(predictions=..., {missing[0]}=...))")
        matrix = as_matrix(predictions)
        return {key: float(function(matrix, initial=initial, sizes=sizes)) for key, function in self.metrics.items()}


def as_tensor(rows: Sequence[Sequence[float]] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Rows of floats (what `evaluate` hands over: lists or a numpy array) as a float32 tensor."""
    return torch.as_tensor(np.asarray([list(row) for row in rows] if len(rows) else [], dtype=np.float32))


def as_index(values: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Integer indices (labels, image indices) as an int64 tensor."""
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


def as_matrix(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """A results matrix given row by row, as a float array."""
    return np.asarray([list(row) for row in rows], dtype=float)
