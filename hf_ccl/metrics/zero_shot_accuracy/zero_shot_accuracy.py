"""`evaluate` module `zero_shot_accuracy` of hf_ccl: top-K zero-shot classification accuracy of image embeddings
against class embeddings, computed by `hf_ccl.evaluation.zeroshot.zero_shot_accuracy` (no second implementation).
See README.md.

    >>> import evaluate, hf_ccl.metrics
    >>> accuracy = evaluate.load(hf_ccl.metrics.path("zero_shot_accuracy"))
    >>> accuracy.compute(predictions=image_embeds, references=labels, class_embeds=class_embeds)
"""

import hf_ccl.metrics.modules as modules
from hf_ccl.evaluation import zeroshot


class ZeroShotAccuracy(modules.EmbeddingMetric):
    description = "Zero-shot top-K accuracy (percent) of image embeddings against class embeddings."
    other = "class_embeds"
    names = ("image_embeds", "class_embeds")
    inputs_description = """
Args:
    predictions: one embedding per image (a list of floats each).
    references: each image's class (an index into class_embeds).
    class_embeds: one embedding per class (hf_ccl.evaluation.zero_shot_classifier: the normalised mean of its
        prompt-template embeddings).
    ks: the cut-offs K (default 1, 5; top-K is reported for 1 < K < number of classes).
Returns: accuracy (top-1) and topK_accuracy (percent; ties count in expectation).
"""

    def _compute(self, predictions, references, class_embeds=None, ks=(1, 5), **options):
        modules.check_options(self.name, options)
        if class_embeds is None:
            raise ValueError("zero_shot_accuracy needs class_embeds (compute(..., class_embeds=...))")
        return zeroshot.zero_shot_accuracy(modules.as_tensor(predictions), modules.as_index(references),
                                           modules.as_tensor(class_embeds), ks=tuple(ks))
