"""hf_ccl's metrics as `evaluate` modules, shipped inside the package and loadable offline:

    import evaluate, hf_ccl.metrics
    recall = evaluate.load(hf_ccl.metrics.path("recall_at_k"))
    both = evaluate.combine([hf_ccl.metrics.load("mtil"), hf_ccl.metrics.load("forgetting")])

Each module wraps one plain function of `hf_ccl.evaluation` (see its card, `hf_ccl/metrics/<name>/README.md`, for the
formula and its source); `hf_ccl/metrics/modules.py` holds what they share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent
#: Every metric module, by name.
METRIC_MODULES = (
    "recall_at_k", "zero_shot_accuracy", "continual_metrics", "final_average", "average_incremental", "forgetting",
    "backward_transfer", "forward_transfer", "tic", "mtil", "class_incremental",
)


def path(name: str) -> str:
    """The folder of metric module `name`, for `evaluate.load` (no network: a local module)."""
    if name not in METRIC_MODULES:
        raise ValueError(f"Unknown hf_ccl metric {name!r}; available: {', '.join(METRIC_MODULES)}")
    return str(ROOT / name)


def load(name: str, **kwargs: Any) -> Any:
    """`evaluate.load(path(name), **kwargs)`."""
    import evaluate

    return evaluate.load(path(name), **kwargs)
