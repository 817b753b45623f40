"""`evaluate` module `final_average` of hf_ccl: average score over all tasks after the last task. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("final_average"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class FinalAverage(modules.MatrixMetric):
    description = "Average score over all tasks after the last task."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "final_average": modules.of_matrix(cm.final_average),
    }
