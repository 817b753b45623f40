"""Image-text retrieval Recall@K with several captions per image, computed in chunks.

Definitions (specs/cllclip.md section 7, the usual Flickr/COCO protocol):

- image -> text: an image is a hit at K if ANY of its captions is among the K texts scoring highest for it;
- text -> image: a caption is a hit at K if its own image is among the K images scoring highest for it;
- `R_mean` is the mean of the six recalls (i2t and t2i at K = 1, 5, 10), all in percent.

Memory grows linearly with the eval set: the similarity matrix is never materialised in full. Each chunk of
`chunk_size` queries is scored against every candidate (a `chunk_size x N` block, computed in float64 and rounded
to float32 so that identical candidates tie whatever the block's shape: `similarity_scores`); for each query the
block gives `RankCounts`: the candidates scoring strictly higher than its best positive, and the negatives and
positives scoring exactly as high, with no sort.

**Ties** are resolved in expectation: a query's recall at K is the probability that a positive lands in the top K
when tied scores are put in a uniformly random order, the mean of what a sort-based protocol gives over its
arbitrary tie orders (`hit_rate`). Without ties this is the usual 0/1 hit. A model whose embeddings collapse (every
score equal) scores chance, not 100%, and the result never depends on the chunk size or the device.

**Identical captions** (the same string on several images, frequent in translated captions) are one text: pass
`text_ids` (`unique_texts`), and that text is a positive of every image it describes, both ways, and one candidate
for image->text. Without `text_ids` every caption is its own text (the protocol above, exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import check_finite_embeddings

DEFAULT_KS = (1, 5, 10)
SCORE_COLUMN_BLOCK = 4096  # candidates scored in float64, and compared, at a time


class RankCounts(NamedTuple):
    """Per query, where its best-scoring positive stands among all candidates."""

    above: torch.Tensor  # candidates scoring strictly higher than the best positive (all negatives)
    tied_negatives: torch.Tensor  # negatives scoring exactly as high as it
    tied_positives: torch.Tensor  # positives scoring exactly as high as it (itself included: >= 1)


def hit_rate(counts: RankCounts, k: int) -> torch.Tensor:
    """Per query, the probability (float64) that a positive is among the top `k` when ties are ordered at random.

    The tied block of n negatives and p positives starts at place `above`; with m = k - above places of it in the
    top k, the query misses iff those m places all hold negatives: P(miss) = prod_{i<m} (n - i) / (n + p - i)
    (0 once m > n). Without ties (n = 0) this is the 0/1 hit `above < k`.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    room = k - counts.above.long()
    negatives = counts.tied_negatives.double()
    total = negatives + counts.tied_positives.double()
    miss = torch.ones_like(negatives)
    for i in range(int(room.max()) if room.numel() else 0):  # room <= k
        factor = (negatives - i).clamp(min=0) / (total - i).clamp(min=1)
        miss = torch.where(room > i, miss * factor, miss)
    return torch.where(room > 0, 1.0 - miss, torch.zeros_like(miss))


def _prepare(embeds: torch.Tensor, name: str) -> torch.Tensor:
    """Check a 2-D finite embedding matrix and return it L2-normalised in float32."""
    if embeds.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n, d), got shape {tuple(embeds.shape)}")
    embeds = embeds.float()
    check_finite_embeddings(embeds, name)
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


def _check_text_ids(text_ids: torch.Tensor | Sequence[int] | None, n_texts: int, device: torch.device) -> torch.Tensor:
    """`text_ids` as a long tensor (default: every caption its own text)."""
    if text_ids is None:
        return torch.arange(n_texts, device=device)
    text_ids = torch.as_tensor(text_ids, dtype=torch.long, device=device).reshape(-1)
    if text_ids.numel() != n_texts:
        raise ValueError(f"text_ids has {text_ids.numel()} entries for {n_texts} texts")
    return text_ids


def similarity_scores(
    queries: torch.Tensor, candidates: torch.Tensor, column_block: int = SCORE_COLUMN_BLOCK
) -> torch.Tensor:
    """`queries @ candidates.T` in float32, computed in float64 and rounded once.

    A float32 matmul's rounding depends on the kernel, and so on the shape of the block and the device: two identical
    candidates can score a few ulps apart in one block and equal in another, which would make ties (and the recall)
    depend on `chunk_size`. In float64 the products of float32 inputs are exact and the sums far below float32's
    resolution, so identical candidates score identically and every block gives the same float32 scores. The float64
    work is done `column_block` candidates at a time, so it adds at most `queries x column_block` doubles of memory.
    """
    queries = queries.double()
    scores = torch.empty(queries.shape[0], candidates.shape[0], dtype=torch.float32, device=queries.device)
    for start in range(0, candidates.shape[0], column_block):
        block = candidates[start : start + column_block].double()
        scores[:, start : start + block.shape[0]] = queries @ block.T
    return scores


def _count_above_and_equal(
    scores: torch.Tensor, threshold: torch.Tensor, column_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the entries strictly greater than `threshold` (`[rows, 1]`) and those equal to it, counted
    `column_block` columns at a time (a boolean comparison, and the int64 copy its sum makes, of that size only)."""
    above = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    equal = torch.zeros_like(above)
    for start in range(0, scores.shape[1], column_block):
        block = scores[:, start : start + column_block]
        above += (block > threshold).sum(dim=1)
        equal += (block == threshold).sum(dim=1)
    return above, equal


def single_positive_rank_counts(scores: torch.Tensor, positive: torch.Tensor) -> RankCounts:
    """`RankCounts` of each row of a full score matrix whose one positive scores `positive` (`[rows, 1]`), an entry of
    that row (zero-shot classes, the diagonal of a pair matrix)."""
    above = (scores > positive).sum(dim=1)
    return RankCounts(above, (scores >= positive).sum(dim=1) - above - 1, torch.ones_like(above))


def _rank_counts(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    positive_query: torch.Tensor,
    positive_candidate: torch.Tensor,
    chunk_size: int,
) -> RankCounts:
    """`RankCounts` of every query against every candidate, given the (query, candidate) pairs that are positive
    (no pair twice; every query has one). Peak extra memory: one `chunk_size x N_candidates` float32 block, and
    `chunk_size x SCORE_COLUMN_BLOCK` float64 / int64 ones while it is scored and counted. Each query's positives are
    read from its own row of the block, so rounding can never make the best positive lose to itself."""
    order = torch.argsort(positive_query, stable=True)  # positive pairs grouped by query
    query_sorted = positive_query[order]
    above, tied_negatives, tied_positives = [], [], []
    for start in range(0, queries.shape[0], chunk_size):
        sims = similarity_scores(queries[start : start + chunk_size], candidates, SCORE_COLUMN_BLOCK)  # chunk x N
        end = start + sims.shape[0]
        bounds = torch.searchsorted(query_sorted, torch.tensor([start, end], device=query_sorted.device))
        pairs = order[int(bounds[0]) : int(bounds[1])]
        rows, columns = positive_query[pairs] - start, positive_candidate[pairs]
        positive_scores = sims[rows, columns]
        best = torch.full((sims.shape[0],), float("-inf"), device=sims.device)
        best = best.scatter_reduce(0, rows, positive_scores, reduce="amax")
        at_best = torch.zeros(sims.shape[0], dtype=torch.long, device=sims.device)
        at_best = at_best.scatter_add(0, rows, (positive_scores == best[rows]).long())
        greater, equal = _count_above_and_equal(sims, best.unsqueeze(1), SCORE_COLUMN_BLOCK)
        above.append(greater)
        tied_negatives.append(equal - at_best)
        tied_positives.append(at_best)
        del sims  # free the block before the next one is allocated
    return RankCounts(torch.cat(above), torch.cat(tied_negatives), torch.cat(tied_positives))


def _unique_pairs(first: torch.Tensor, second: torch.Tensor, n_second: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.unique(first * n_second + second)
    return keys // n_second, keys % n_second


def _retrieval_inputs(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    text_to_image: torch.Tensor,
    chunk_size: int,
    text_ids: torch.Tensor | Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked, normalised images; one row per distinct text (its first caption's); each caption's distinct text;
    and the caption -> image map."""
    images = _prepare(image_embeds, "image_embeds")
    texts = _prepare(text_embeds, "text_embeds").to(images.device)
    text_to_image = _check_inputs(images, texts, text_to_image, chunk_size)
    ids = _check_text_ids(text_ids, texts.shape[0], text_to_image.device)
    _, inverse = torch.unique(ids, return_inverse=True)  # caption -> distinct text
    positions = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), inverse.numel(), device=inverse.device)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")  # distinct text -> its first caption
    return images, texts[first], inverse, text_to_image


def _image_to_text(images: torch.Tensor, texts: torch.Tensor, inverse: torch.Tensor, owners: torch.Tensor,
                   chunk_size: int) -> RankCounts:
    image_rows, text_columns = _unique_pairs(owners, inverse, texts.shape[0])
    return _rank_counts(images, texts, image_rows, text_columns, chunk_size)


def _text_to_image(images: torch.Tensor, texts: torch.Tensor, inverse: torch.Tensor, owners: torch.Tensor,
                   chunk_size: int) -> RankCounts:
    text_rows, image_columns = _unique_pairs(inverse, owners, images.shape[0])
    counts = _rank_counts(texts, images, text_rows, image_columns, chunk_size)
    return RankCounts(*(values[inverse] for values in counts))  # back to one row per caption


def image_to_text_rank_counts(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    text_to_image: torch.Tensor,
    chunk_size: int = 1024,
    text_ids: torch.Tensor | Sequence[int] | None = None,
) -> RankCounts:
    """Per image, where its best-scoring caption stands among all (distinct) texts.

    Embeddings are L2-normalised here. Peak extra memory: normalised copies of the inputs and one
    `chunk_size x N_txt` block.
    """
    inputs = _retrieval_inputs(image_embeds, text_embeds, text_to_image, chunk_size, text_ids)
    return _image_to_text(*inputs, chunk_size)


def text_to_image_rank_counts(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    text_to_image: torch.Tensor,
    chunk_size: int = 1024,
    text_ids: torch.Tensor | Sequence[int] | None = None,
) -> RankCounts:
    """Per caption, where the best-scoring image it describes stands among all images (a caption shared by several
    images, with `text_ids`, describes each of them).

    Embeddings are L2-normalised here. Peak extra memory: normalised copies of the inputs and one
    `chunk_size x N_img` block.
    """
    inputs = _retrieval_inputs(image_embeds, text_embeds, text_to_image, chunk_size, text_ids)
    return _text_to_image(*inputs, chunk_size)


def recall_from_rank_counts(counts: RankCounts, ks: Sequence[int] = DEFAULT_KS) -> dict[int, float]:
    """Recall@K in percent: the mean over queries of `hit_rate` (ties ordered at random, in expectation)."""
    return {k: 100.0 * hit_rate(counts, k).mean().item() for k in ks}


def recall_at_k(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    text_to_image: torch.Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_size: int = 1024,
    text_ids: torch.Tensor | Sequence[int] | None = None,
) -> dict[str, float]:
    """Image->text and text->image Recall@K (percent) and their mean `R_mean`.

    Args:
        image_embeds: `[N_img, d]` image embeddings (normalised here).
        text_embeds: `[N_txt, d]` caption embeddings (normalised here).
        text_to_image: `[N_txt]` index of each caption's image; every image needs at least one caption.
        ks: the cut-offs K.
        chunk_size: queries scored per block; only changes memory and speed, never the result.
        text_ids: `[N_txt]`, equal for captions that are the same text (`unique_texts`): one candidate, a positive of
            each image it describes. Default: every caption is its own text.

    Returns keys `i2t_R@K` and `t2i_R@K` for each K, and `R_mean`, the mean of all of them. Ties count in
    expectation (`hit_rate`).
    """
    if not ks or any(int(k) < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks}")
    inputs = _retrieval_inputs(image_embeds, text_embeds, text_to_image, chunk_size, text_ids)  # checked once
    i2t = recall_from_rank_counts(_image_to_text(*inputs, chunk_size), ks)
    t2i = recall_from_rank_counts(_text_to_image(*inputs, chunk_size), ks)
    metrics = {f"i2t_R@{k}": value for k, value in i2t.items()}
    metrics.update({f"t2i_R@{k}": value for k, value in t2i.items()})
    metrics["R_mean"] = sum(metrics.values()) / len(metrics)
    return metrics


def unique_texts(texts: Sequence[str]) -> tuple[list[str], torch.Tensor]:
    """The distinct strings of `texts` in first-seen order, and each text's index among them (`text_ids`)."""
    index: dict[str, int] = {}
    ids = [index.setdefault(text, len(index)) for text in texts]
    return list(index), torch.tensor(ids, dtype=torch.long)


def captions_to_text_to_image(texts_per_image: Sequence[Sequence[str]]) -> tuple[list[str], torch.Tensor]:
    """Flatten the canonical `texts` column: all captions in order and the image index of each."""
    flat: list[str] = []
    owners: list[int] = []
    for image_index, captions in enumerate(texts_per_image):
        flat.extend(captions)
        owners.extend([image_index] * len(captions))
    return flat, torch.tensor(owners, dtype=torch.long)
