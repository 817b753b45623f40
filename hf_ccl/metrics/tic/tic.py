"""`evaluate` module `tic` of hf_ccl: tiC-CLIP's in-domain, backward and forward transfer, and their relative forms. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("tic"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class TiC(modules.MatrixMetric):
    description = "TiC-CLIP's in-domain, backward and forward transfer, and their relative forms."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "tic_id": lambda R, initial=None, sizes=None: cm.tic_in_domain(R),
        "tic_bwt": lambda R, initial=None, sizes=None: cm.tic_backward(R),
        "tic_fwt": lambda R, initial=None, sizes=None: cm.tic_forward(R),
        "tic_rel_bwt": lambda R, initial=None, sizes=None: cm.tic_relative_backward(R),
        "tic_rel_fwt": lambda R, initial=None, sizes=None: cm.tic_relative_forward(R),
    }
