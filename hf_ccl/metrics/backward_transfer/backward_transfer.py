"""`evaluate` module `backward_transfer` of hf_ccl: backward transfer (BWT): final minus just-trained score on earlier tasks. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("backward_transfer"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class BackwardTransfer(modules.MatrixMetric):
    description = "Backward transfer (BWT): final minus just-trained score on earlier tasks."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "backward_transfer": modules.of_matrix(cm.backward_transfer),
    }
