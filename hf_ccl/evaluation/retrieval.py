"""Image-text retrieval Recall@K with several captions per image, computed in chunks.

Definitions (specs/cllclip.md section 7, the usual Flickr/COCO protocol):

- image -> text: an image is a hit at K if ANY of its captions is among the K texts scoring highest for it;
- text -> image: a caption is a hit at K if its own image is among the K images scoring highest for it;
- `R_mean` is the mean of the six recalls (i2t and t2i at K = 1, 5, 10), all in percent.

Memory grows linearly with the eval set: the similarity matrix is never materialised in full. Each chunk of
`chunk_size` queries is scored against every candidate (a `chunk_size x N` block), and the rank of the best
positive is found by counting the candidates that score *strictly higher* than it, with no sort.

Ties are resolved in the query's favour: a negative scoring exactly as high as the best positive does not push it
down. (A full sort would place tied items in an arbitrary order; counting strict wins gives the same ranks for the
same scores whatever the chunk size or device.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

DEFAULT_KS = (1, 5, 10)
EXACT_FLOAT_COUNT = 2**24  # float32 counts 0/1 entries exactly below this


def _prepare(embeds: torch.Tensor, name: str) -> torch.Tensor:
    """Check a 2-D finite embedding matrix and return it L2-normalised in float32."""
    if embeds.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n, d), got shape {tuple(embeds.shape)}")
    embeds = embeds.float()
    if not torch.isfinite(embeds).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return F.normalize(embeds, dim=-1)


def _check_inputs(
    image_embeds: torch.Tensor, text_embeds: torch.Tensor, text_to_image: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Validate shapes and the caption -> image map; return the map as a long tensor on the texts' device."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if image_embeds.shape[1] != text_embeds.shape[1]:
        raise ValueError(
            f"embedding sizes differ: images {image_embeds.shape[1]}, texts {text_embeds.shape[1]}"
        )
    text_to_image = torch.as_tensor(text_to_image, dtype=torch.long, device=text_embeds.device).reshape(-1)
    if text_to_image.numel() != text_embeds.shape[0]:
        raise ValueError(
            f"text_to_image has {text_to_image.numel()} entries for {text_embeds.shape[0]} texts"
        )
    n_images = image_embeds.shape[0]
    if n_images == 0 or text_to_image.numel() == 0:
        raise ValueError("recall needs at least one image and one text")
    if int(text_to_image.min()) < 0 or int(text_to_image.max()) >= n_images:
        raise ValueError(f"text_to_image holds indices outside [0, {n_images})")
    captions_per_image = torch.bincount(text_to_image, minlength=n_images)
    if bool((captions_per_image == 0).any()):
        missing = int((captions_per_image == 0).sum())
        raise ValueError(f"{missing} image(s) have no caption; every image needs at least one")
    return text_to_image


def _count_greater(sims: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Per row, the number of entries strictly greater than `threshold` (`[rows, 1]`); overwrites `sims`.

    The comparison is written into `sims` itself (as 1.0 / 0.0) and summed in float32, which is exact for fewer than
    2**24 columns; this avoids a boolean block and the int64 copy that summing a boolean tensor makes.
    """
    if sims.shape[1] >= EXACT_FLOAT_COUNT:
        return (sims > threshold).sum(dim=1)
    torch.gt(sims, threshold, out=sims)
    return sims.sum(dim=1).long()


def image_to_text_ranks(
    image_embeds: torch.Tensor, text_embeds: torch.Tensor, text_to_image: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """0-based rank of each image's best-scoring caption among all texts (ties in the image's favour).

    Embeddings are L2-normalised here. Peak extra memory: normalised copies of the inputs and one
    `chunk_size x N_txt` float block. The best positive of each image is read from that same block (so rounding can
    never make it lose to itself), by gathering the chunk's own captions, found with a sort of `text_to_image`.
    """
    images = _prepare(image_embeds, "image_embeds")
    texts = _prepare(text_embeds, "text_embeds").to(images.device)
    text_to_image = _check_inputs(images, texts, text_to_image, chunk_size)
    order = torch.argsort(text_to_image, stable=True)  # caption indices grouped by image
    owners_sorted = text_to_image[order]
    ranks = []
    for start in range(0, images.shape[0], chunk_size):
        sims = images[start : start + chunk_size] @ texts.T  # chunk x N_txt
        end = start + sims.shape[0]
        bounds = torch.searchsorted(owners_sorted, torch.tensor([start, end], device=owners_sorted.device))
        own_texts = order[int(bounds[0]) : int(bounds[1])]
        rows = text_to_image[own_texts] - start
        best = torch.full((sims.shape[0],), float("-inf"), device=sims.device)
        best = best.scatter_reduce(0, rows, sims[rows, own_texts], reduce="amax")
        ranks.append(_count_greater(sims, best.unsqueeze(1)))
        del sims  # free the block before the next one is allocated
    return torch.cat(ranks)


def text_to_image_ranks(
    image_embeds: torch.Tensor, text_embeds: torch.Tensor, text_to_image: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """0-based rank of each caption's own image among all images (ties in the caption's favour).

    Embeddings are L2-normalised here. Peak extra memory: normalised copies of the inputs and one
    `chunk_size x N_img` float block.
    """
    images = _prepare(image_embeds, "image_embeds")
    texts = _prepare(text_embeds, "text_embeds").to(images.device)
    text_to_image = _check_inputs(images, texts, text_to_image, chunk_size)
    ranks = []
    for start in range(0, texts.shape[0], chunk_size):
        sims = texts[start : start + chunk_size] @ images.T  # chunk x N_img
        own = text_to_image[start : start + sims.shape[0]].unsqueeze(1)
        positive_score = sims.gather(1, own)
        ranks.append(_count_greater(sims, positive_score))
        del sims  # free the block before the next one is allocated
    return torch.cat(ranks)


def recall_from_ranks(ranks: torch.Tensor, ks: Sequence[int] = DEFAULT_KS) -> dict[int, float]:
    """Recall@K in percent from 0-based ranks: the share of queries with rank < K."""
    return {k: 100.0 * (ranks < k).float().mean().item() for k in ks}


def recall_at_k(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    text_to_image: torch.Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_size: int = 1024,
) -> dict[str, float]:
    """Image->text and text->image Recall@K (percent) and their mean `R_mean`.

    Args:
        image_embeds: `[N_img, d]` image embeddings (normalised here).
        text_embeds: `[N_txt, d]` caption embeddings (normalised here).
        text_to_image: `[N_txt]` index of each caption's image; every image needs at least one caption.
        ks: the cut-offs K.
        chunk_size: queries scored per block; only changes memory and speed, never the result.

    Returns keys `i2t_R@K` and `t2i_R@K` for each K, and `R_mean`, the mean of all of them.
    """
    if not ks or any(int(k) < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks}")
    i2t = recall_from_ranks(image_to_text_ranks(image_embeds, text_embeds, text_to_image, chunk_size), ks)
    t2i = recall_from_ranks(text_to_image_ranks(image_embeds, text_embeds, text_to_image, chunk_size), ks)
    metrics = {f"i2t_R@{k}": value for k, value in i2t.items()}
    metrics.update({f"t2i_R@{k}": value for k, value in t2i.items()})
    metrics["R_mean"] = sum(metrics.values()) / len(metrics)
    return metrics


def captions_to_text_to_image(texts_per_image: Sequence[Sequence[str]]) -> tuple[list[str], torch.Tensor]:
    """Flatten the canonical `texts` column: all captions in order and the image index of each."""
    flat: list[str] = []
    owners: list[int] = []
    for image_index, captions in enumerate(texts_per_image):
        flat.extend(captions)
        owners.extend([image_index] * len(captions))
    return flat, torch.tensor(owners, dtype=torch.long)
