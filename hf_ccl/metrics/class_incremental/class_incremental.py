"""`evaluate` module `class_incremental` of hf_ccl: class-incremental average and last accuracy (scores among the classes seen so far). See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("class_incremental"))
    >>> metric.compute(predictions=R_rows, sizes=n)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class ClassIncremental(modules.MatrixMetric):
    description = "Class-incremental average and last accuracy (scores among the classes seen so far)."
    inputs_description = modules.MATRIX_INPUTS
    needs = ('sizes',)
    metrics = {
        "class_incremental_average": modules.of_matrix_and_sizes(cm.class_incremental_average),
        "class_incremental_last": modules.of_matrix_and_sizes(cm.class_incremental_last),
    }
