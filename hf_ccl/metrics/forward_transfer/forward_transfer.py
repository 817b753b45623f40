"""`evaluate` module `forward_transfer` of hf_ccl: forward transfer (FWT): a task's score just before it is trained minus the initial model's. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("forward_transfer"))
    >>> metric.compute(predictions=R_rows, initial=b)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class ForwardTransfer(modules.MatrixMetric):
    description = "Forward transfer (FWT): a task's score just before it is trained minus the initial model's."
    inputs_description = modules.MATRIX_INPUTS
    needs = ('initial',)
    metrics = {
        "forward_transfer": modules.of_matrix_and_initial(cm.forward_transfer),
    }
