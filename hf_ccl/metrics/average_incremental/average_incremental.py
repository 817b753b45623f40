"""`evaluate` module `average_incremental` of hf_ccl: mean over steps of the average score on the tasks seen so far. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("average_incremental"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class AverageIncremental(modules.MatrixMetric):
    description = "Mean over steps of the average score on the tasks seen so far."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "average_incremental": modules.of_matrix(cm.average_incremental),
    }
