"""`evaluate` module `continual_metrics` of hf_ccl: every summary of a results matrix at once, as
`hf_ccl.evaluation.continual_metrics.summarize` computes it (the numbers of results.json's `summary`). See README.md.

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("continual_metrics"))
    >>> metric.compute(predictions=R_rows, initial=b)            # sizes=n adds the class-incremental metrics
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class ContinualMetrics(modules.MatrixMetric):
    description = "Every continual-learning summary of a results matrix (hf_ccl.evaluation.continual_metrics)."
    inputs_description = modules.MATRIX_INPUTS

    def _compute(self, predictions, initial=None, sizes=None, scale=None, **options):
        self.check_inputs(predictions, None, initial=initial, sizes=sizes, scale=scale, **options)
        matrix, scale = modules.checked_matrix(predictions, initial, scale)
        return cm.summarize(matrix, initial, sizes, scale=scale)
