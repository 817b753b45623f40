"""`evaluate` module `forgetting` of hf_ccl: average forgetting: each earlier task's drop from its best score to its final score. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("forgetting"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class Forgetting(modules.MatrixMetric):
    description = "Average forgetting: each earlier task's drop from its best score to its final score."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "forgetting": modules.of_matrix(cm.forgetting),
    }
