"""`evaluate` module `tic` of hf_ccl: tiC-CLIP's in-domain, backward and forward transfer, and their relative forms. See README.md (the module card) for the formula
and its source; computed by `hf_ccl.evaluation.continual_metrics` (no second implementation).

    >>> import evaluate, hf_ccl.metrics
    >>> metric = evaluate.load(hf_ccl.metrics.path("tic"))
    >>> metric.compute(predictions=R_rows)
"""

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics.modules as modules


class Tic(modules.MatrixMetric):  # evaluate names a module after its class: "TiC" would load as "ti_c"
    description = "TiC-CLIP's in-domain, backward and forward transfer, and their relative forms."
    inputs_description = modules.MATRIX_INPUTS
    needs = ()
    metrics = {
        "tic_id": modules.of_matrix(cm.tic_in_domain),
        "tic_bwt": modules.of_matrix(cm.tic_backward),
        "tic_fwt": modules.of_matrix(cm.tic_forward),
        "tic_rel_bwt": modules.of_matrix(cm.tic_relative_backward),
        "tic_rel_fwt": modules.of_matrix(cm.tic_relative_forward),
    }
