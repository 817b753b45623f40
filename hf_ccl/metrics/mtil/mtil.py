"""`evaluate` module `mtil` of hf_ccl: zSCL's MTIL Transfer, Avg. and Last. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("mtil"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class MTIL(modules.MatrixMetric):
    description = "ZSCL's MTIL Transfer, Avg. and Last."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "mtil_transfer": modules.of_matrix(cm.mtil_transfer),
        "mtil_average": modules.of_matrix(cm.mtil_average),
        "mtil_last": modules.of_matrix(cm.mtil_last),
    }
