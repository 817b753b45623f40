"""`evaluate` module `recall_at_k` of hf_ccl: image-to-text and text-to-image Recall@K with several captions per image,
computed by `hf_ccl.evaluation.retrieval.recall_at_k` (no second implementation). See README.md.

    >>> import evaluate, hf_ccl.metrics
    >>> recall = evaluate.load(hf_ccl.metrics.path("recall_at_k"))
    >>> recall.compute(predictions=caption_embeds, references=image_index_of_each_caption, image_embeds=image_embeds)
"""

import hf_ccl.metrics.modules as modules
from hf_ccl.evaluation import retrieval


class RecallAtK(modules.EmbeddingMetric):
    description = "Image-to-text and text-to-image Recall@K (percent), every caption of an image a positive."
    other = "image_embeds"
    names = ("text_embeds", "image_embeds")
    inputs_description = """
Args:
    predictions: one embedding per caption (a list of floats each).
    references: the index (into image_embeds) of each caption's image; every image needs at least one caption.
    image_embeds: one embedding per image.
    ks: the cut-offs K (default 1, 5, 10).
    text_ids: optional, equal for captions that are the same text: one candidate, a positive of every image it
        describes (hf_ccl.evaluation.unique_texts).
    chunk_size: queries scored per block (memory only; never changes the result).
Returns: i2t_R@K and t2i_R@K for each K, and R_mean, their mean (percent; ties count in expectation).
"""

    def _compute(self, predictions, references, image_embeds=None, ks=retrieval.DEFAULT_KS, text_ids=None,
                 chunk_size=1024, **options):
        modules.check_options(self.name, options)
        if image_embeds is None:
            raise ValueError("recall_at_k needs image_embeds (compute(..., image_embeds=...))")
        return retrieval.recall_at_k(modules.as_tensor(image_embeds), modules.as_tensor(predictions),
                                     modules.as_index(references), ks=tuple(ks), chunk_size=chunk_size,
                                     text_ids=None if text_ids is None else modules.as_index(text_ids))
