"""Zero-shot classification: class embeddings from prompt-template ensembles, and top-K accuracy.

The recipe of CLIP and the DataComp / CLIP_benchmark evaluation (specs/ticclip.md section 3): each class embedding is
the L2-normalised mean of the L2-normalised embeddings of its prompts ("a photo of a {label}.", ...); an image is
assigned the class of highest cosine similarity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..data.templates import format_template
from .checks import check_finite_embeddings
from .encode import encode_texts
from .retrieval import hit_rate, similarity_scores, single_positive_rank_counts

DEFAULT_TEMPLATES = ("a photo of a {label}.",)
TextEncoder = Callable[[list[str]], torch.Tensor]


def _text_encoder(
    model_or_fn: torch.nn.Module | TextEncoder, tokenizer: Any, batch_size: int, max_length: int | None
) -> TextEncoder:
    """A function `list[str] -> [n, d]` from a CLIP model plus tokenizer, or the given function itself."""
    if isinstance(model_or_fn, torch.nn.Module):
        if tokenizer is None:
            raise ValueError("zero_shot_classifier needs a tokenizer when given a model")
        model = model_or_fn
        return lambda texts: encode_texts(
            model, tokenizer, texts, batch_size=batch_size, max_length=max_length
        )
    if callable(model_or_fn):
        return model_or_fn
    raise TypeError(f"expected a CLIP model or a text-encoding function, got {type(model_or_fn).__name__}")


def zero_shot_classifier(
    model_or_fn: torch.nn.Module | TextEncoder,
    class_names: Sequence[str],
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    tokenizer: Any = None,
    *,
    batch_size: int = 512,
    max_length: int | None = None,
) -> torch.Tensor:
    """Class embeddings `[C, d]`: for each class, the normalised mean of its normalised template embeddings.

    `model_or_fn` is either a CLIP model (with `tokenizer`) or a function mapping a list of texts to `[n, d]`
    embeddings. All `C x M` prompts are encoded in batches of `batch_size`.
    """
    if not class_names:
        raise ValueError("zero_shot_classifier needs at least one class name")
    if not templates:
        raise ValueError("zero_shot_classifier needs at least one template")
    encode = _text_encoder(model_or_fn, tokenizer, batch_size, max_length)
    prompts = [format_template(template, name) for name in class_names for template in templates]
    embeds = torch.cat([encode(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)])
    embeds = F.normalize(embeds.float(), dim=-1).reshape(len(class_names), len(templates), -1)
    return F.normalize(embeds.mean(dim=1), dim=-1)


def zero_shot_accuracy(
    image_embeds: torch.Tensor,
    labels: torch.Tensor | Sequence[int],
    class_embeds: torch.Tensor,
    ks: Sequence[int] = (1, 5),
) -> dict[str, float]:
    """Top-K zero-shot accuracy in percent: `accuracy` (top-1, always) and `top{K}_accuracy` for each 1 < K < C.

    Both embedding sets are L2-normalised here. As in `recall_at_k`, ties count in expectation (`hit_rate`): an image
    whose true class ties with c other classes at the top is right with probability 1/(c+1), so a model whose class
    embeddings collapse scores chance, not 100%. Embeddings with NaN or infinite values (a diverged model) are
    refused (`NonFiniteEmbeddingError`, naming the rows): they would compare as ties or as nothing at all.
    """
    images, classes = image_embeds.float(), class_embeds.float()
    check_finite_embeddings(images, "image_embeds")
    check_finite_embeddings(classes, "class_embeds")
    images = F.normalize(images, dim=-1)
    classes = F.normalize(classes, dim=-1).to(images.device)
    return accuracy_from_scores(similarity_scores(images, classes), labels, ks)


def accuracy_from_scores(
    scores: torch.Tensor, labels: torch.Tensor | Sequence[int], ks: Sequence[int] = (1, 5)
) -> dict[str, float]:
    """Top-K accuracy in percent of class scores [N, C] (higher is better): `accuracy` and `top{K}_accuracy` for each
    1 < K < C, ties counted in expectation as in `zero_shot_accuracy`. Non-finite scores are refused."""
    scores = scores.float()
    check_finite_embeddings(scores, "class scores")
    labels = torch.as_tensor(labels, dtype=torch.long, device=scores.device).reshape(-1)
    if labels.numel() != scores.shape[0]:
        raise ValueError(f"{labels.numel()} labels for {scores.shape[0]} images")
    if scores.shape[0] == 0:
        raise ValueError("zero_shot_accuracy needs at least one image")
    n_classes = scores.shape[1]
    if int(labels.min()) < 0 or int(labels.max()) >= n_classes:
        raise ValueError(
            f"labels must lie in [0, {n_classes}); got min {int(labels.min())}, max {int(labels.max())}"
        )
    true_score = scores.gather(1, labels.unsqueeze(1))
    counts = single_positive_rank_counts(scores, true_score)
    metrics = {"accuracy": 100.0 * hit_rate(counts, 1).mean().item()}
    for k in ks:
        if 1 < k < n_classes:
            metrics[f"top{k}_accuracy"] = 100.0 * hit_rate(counts, k).mean().item()
    return metrics
