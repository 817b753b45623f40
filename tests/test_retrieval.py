"""Recall@K with several captions per image: hand-computed ranks, chunking, ties in expectation, identical captions
and input checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_ccl.evaluation import retrieval
from hf_ccl.evaluation.retrieval import (
    RankCounts,
    captions_to_text_to_image,
    hit_rate,
    image_to_text_rank_counts,
    recall_at_k,
    text_to_image_rank_counts,
    unique_texts,
)


def image_to_text_ranks(*args, **kwargs) -> torch.Tensor:
    """The 0-based rank of each image's best caption, for inputs without ties."""
    counts = image_to_text_rank_counts(*args, **kwargs)
    assert not counts.tied_negatives.any() and (counts.tied_positives == 1).all()
    return counts.above


def text_to_image_ranks(*args, **kwargs) -> torch.Tensor:
    counts = text_to_image_rank_counts(*args, **kwargs)
    assert not counts.tied_negatives.any() and (counts.tied_positives == 1).all()
    return counts.above

# Cosine similarity of image i (the unit vector e_i) with each caption is the caption's i-th entry; a fourth
# component makes every caption a unit vector, so the table below IS the similarity matrix (rows = captions).
CAPTION_SIMS = [
    # img0  img1  img2     owner
    [0.9, 0.1, 0.0],  # 0
    [0.2, 0.5, 0.3],  # 0
    [0.8, 0.3, 0.1],  # 1
    [0.1, 0.2, 0.4],  # 1
    [0.0, 0.6, 0.5],  # 2
    [0.3, 0.0, 0.2],  # 2
]
OWNERS = [0, 0, 1, 1, 2, 2]
# i2t: best positive of img0 is 0.9 (nothing higher) -> 0; img1 best 0.3, beaten by 0.5 and 0.6 -> 2;
#      img2 best 0.5 (nothing higher) -> 0.
EXPECTED_I2T_RANKS = [0, 2, 0]
# t2i: caption 0 -> 0; caption 1 own 0.2 beaten by 0.5, 0.3 -> 2; captions 2..5 each beaten once -> 1.
EXPECTED_T2I_RANKS = [0, 2, 1, 1, 1, 1]


def _hand_made() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images = torch.eye(4)[:3]
    sims = torch.tensor(CAPTION_SIMS)
    rest = torch.sqrt(1.0 - (sims**2).sum(dim=1, keepdim=True))
    texts = torch.cat([sims, rest], dim=1)
    return images, texts, torch.tensor(OWNERS)


def test_hand_made_ranks() -> None:
    images, texts, owners = _hand_made()
    assert image_to_text_ranks(images, texts, owners).tolist() == EXPECTED_I2T_RANKS
    assert text_to_image_ranks(images, texts, owners).tolist() == EXPECTED_T2I_RANKS


def test_hand_made_recall_values() -> None:
    images, texts, owners = _hand_made()
    metrics = recall_at_k(images, texts, owners, ks=(1, 2, 3))
    expected = {
        "i2t_R@1": 200 / 3,
        "i2t_R@2": 200 / 3,
        "i2t_R@3": 100.0,
        "t2i_R@1": 100 / 6,
        "t2i_R@2": 500 / 6,
        "t2i_R@3": 100.0,
    }
    expected["R_mean"] = sum(expected.values()) / 6  # 72.22...
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-4), key
    assert metrics["R_mean"] == pytest.approx(72.2222, abs=1e-3)


def test_default_keys_and_r_mean() -> None:
    images, texts, owners = _hand_made()
    metrics = recall_at_k(images, texts, owners)
    assert list(metrics) == ["i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "R_mean"]
    assert metrics["R_mean"] == pytest.approx((200 / 3 + 100 + 100 + 100 / 6 + 100 + 100) / 6, abs=1e-4)


def test_embeddings_are_normalised_inside() -> None:
    images, texts, owners = _hand_made()
    scaled_images = images * torch.tensor([[3.0], [0.2], [7.0]])
    scaled_texts = texts * torch.linspace(0.5, 4.0, texts.shape[0]).unsqueeze(1)
    assert recall_at_k(scaled_images, scaled_texts, owners) == recall_at_k(images, texts, owners)


def _naive_ranks_by_sort(
    images: torch.Tensor, texts: torch.Tensor, owners: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full similarity matrix and a full sort (valid when there are no ties)."""
    images = torch.nn.functional.normalize(images, dim=-1)
    texts = torch.nn.functional.normalize(texts, dim=-1)
    sims = images @ texts.T
    i2t = []
    for i in range(sims.shape[0]):
        order = sims[i].argsort(descending=True)
        i2t.append(min(int((order == t).nonzero()) for t in (owners == i).nonzero().flatten()))
    t2i = []
    for t in range(sims.shape[1]):
        order = sims[:, t].argsort(descending=True)
        t2i.append(int((order == owners[t]).nonzero()))
    return torch.tensor(i2t), torch.tensor(t2i)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 16, 37, 1000])
def test_chunked_equals_full_sort(chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(0)
    n_images = 37
    captions = torch.randint(1, 6, (n_images,), generator=generator)  # 1 to 5 captions per image
    owners = torch.repeat_interleave(torch.arange(n_images), captions)
    owners = owners[torch.randperm(owners.numel(), generator=generator)]  # captions need not be grouped
    images = torch.randn(n_images, 8, generator=generator)
    texts = images[owners] + 1.5 * torch.randn(owners.numel(), 8, generator=generator)
    ref_i2t, ref_t2i = _naive_ranks_by_sort(images, texts, owners)
    assert torch.equal(image_to_text_ranks(images, texts, owners, chunk_size=chunk_size), ref_i2t)
    assert torch.equal(text_to_image_ranks(images, texts, owners, chunk_size=chunk_size), ref_t2i)
    full = recall_at_k(images, texts, owners, chunk_size=10_000)
    assert recall_at_k(images, texts, owners, chunk_size=chunk_size) == full
    assert 0.0 < full["i2t_R@1"] < 100.0 and 0.0 < full["t2i_R@1"] < 100.0


def _hit_rate_by_enumeration(above: int, negatives: int, positives: int, k: int) -> float:
    """The share of all orders of the tied block that put a positive in the top k."""
    block = [False] * negatives + [True] * positives
    orders = list(itertools.permutations(block))
    return sum(any(order[: max(k - above, 0)]) for order in orders) / len(orders)


@pytest.mark.parametrize(("above", "negatives", "positives"), [(0, 0, 1), (0, 2, 2), (1, 3, 1), (2, 1, 3), (4, 2, 1)])
def test_hit_rate_is_the_share_of_random_tie_orders(above: int, negatives: int, positives: int) -> None:
    counts = RankCounts(torch.tensor([above]), torch.tensor([negatives]), torch.tensor([positives]))
    for k in range(1, 8):
        expected = _hit_rate_by_enumeration(above, negatives, positives, k)
        assert hit_rate(counts, k).item() == pytest.approx(expected, abs=1e-12), k
    # By hand: 2 tied negatives and 2 tied positives at the top: the first place holds a positive half the time,
    # and the first two places miss only as (negative, negative): 2/4 * 1/3 = 1/6.
    pair = RankCounts(torch.tensor([0]), torch.tensor([2]), torch.tensor([2]))
    assert hit_rate(pair, 1).item() == pytest.approx(0.5) and hit_rate(pair, 2).item() == pytest.approx(5 / 6)


def test_ties_count_in_expectation() -> None:
    # Two identical images, each with one identical caption: every score ties, each query is a hit at K=1 in half
    # of the tie orders.
    images = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    texts = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    owners = torch.tensor([0, 1])
    counts = image_to_text_rank_counts(images, texts, owners)
    assert counts.above.tolist() == [0, 0] and counts.tied_negatives.tolist() == [1, 1]
    metrics = recall_at_k(images, texts, owners, ks=(1, 2))
    assert metrics == {"i2t_R@1": 50.0, "i2t_R@2": 100.0, "t2i_R@1": 50.0, "t2i_R@2": 100.0, "R_mean": 75.0}


def test_collapsed_embeddings_score_chance_not_100() -> None:
    """A model whose text tower maps everything to one vector cannot tell captions apart: recall is chance."""
    images = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    texts = torch.ones(20, 4)
    owners = torch.arange(10).repeat_interleave(2)
    metrics = recall_at_k(images, texts, owners, ks=(1, 5))
    assert metrics["i2t_R@1"] == pytest.approx(100 * (1 - 18 / 20))  # 2 positives among 20 tied texts
    assert metrics["i2t_R@5"] == pytest.approx(100 * (1 - math.comb(18, 5) / math.comb(20, 5)))


def test_tie_with_a_strictly_better_negative() -> None:
    # Image 0's caption ties with one negative and loses to another.
    images = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    texts = torch.tensor([[0.6, 0.8, 0.0], [0.6, 0.0, 0.8], [0.8, 0.6, 0.0], [0.0, 0.0, 1.0]])
    owners = torch.tensor([0, 1, 1, 2])
    # image 0 scores: caption0 0.6 (own), caption1 0.6 (tie), caption2 0.8 (higher), caption3 0.0
    counts = image_to_text_rank_counts(images, texts, owners)
    assert (counts.above[0].item(), counts.tied_negatives[0].item(), counts.tied_positives[0].item()) == (1, 1, 1)
    assert [hit_rate(counts, k)[0].item() for k in (1, 2, 3)] == [0.0, 0.5, 1.0]


# Identical captions: "a dog" describes images 0 and 1, "a cat" only image 1, "a car" only image 2. Scores
# (rows: distinct texts, columns: images), the text vectors built as in `_hand_made`:
DOG, CAT, CAR = [0.7, 0.6, 0.1], [0.2, 0.5, 0.4], [0.1, 0.3, 0.2]


def test_identical_captions_are_one_text_and_a_positive_of_each_image() -> None:
    images = torch.eye(4)[:3]
    sims = torch.tensor([DOG, DOG, CAT, CAR])  # captions: image 0 "a dog"; image 1 "a dog", "a cat"; image 2 "a car"
    texts = torch.cat([sims, torch.sqrt(1.0 - (sims**2).sum(dim=1, keepdim=True))], dim=1)
    owners = torch.tensor([0, 1, 1, 2])
    distinct, ids = unique_texts(["a dog", "a dog", "a cat", "a car"])
    assert distinct == ["a dog", "a cat", "a car"] and ids.tolist() == [0, 0, 1, 2]
    # i2t over the 3 distinct texts: image 0 best "a dog" 0.7 -> rank 0; image 1 best "a dog" 0.6 -> 0; image 2 own
    # "a car" 0.2 loses to "a cat" 0.4 -> 1. t2i per caption: "a dog" (either occurrence) best image 0 at 0.7 -> 0;
    # "a cat" own 0.5 -> 0; "a car" own 0.2 loses to 0.3 -> 1.
    counts = image_to_text_rank_counts(images, texts, owners, text_ids=ids)
    assert counts.above.tolist() == [0, 0, 1] and not counts.tied_negatives.any()
    counts = text_to_image_rank_counts(images, texts, owners, text_ids=ids)
    assert counts.above.tolist() == [0, 0, 0, 1] and not counts.tied_negatives.any()
    metrics = recall_at_k(images, texts, owners, ks=(1,), text_ids=ids)
    assert metrics["i2t_R@1"] == pytest.approx(200 / 3) and metrics["t2i_R@1"] == pytest.approx(75.0)
    # Without text_ids each "a dog" is a negative of the other image that ties with its own best caption (half a hit
    # each), and the first "a dog" must find image 0 only (0.7: rank 0), the second image 1 only (0.6 < 0.7: rank 1).
    plain = recall_at_k(images, texts, owners, ks=(1,))
    assert plain["i2t_R@1"] == pytest.approx(100 * (0.5 + 0.5 + 0) / 3) and plain["t2i_R@1"] == pytest.approx(50.0)


@pytest.mark.parametrize(("chunk_size", "column_block"), [(1, 4096), (2, 7), (5, 1), (1000, 16)])
def test_ties_and_identical_captions_do_not_depend_on_chunking(monkeypatch, chunk_size: int, column_block: int) -> None:
    generator = torch.Generator().manual_seed(1)
    n_images = 23
    owners = torch.arange(n_images).repeat_interleave(3)
    ids = torch.randint(0, 40, (owners.numel(),), generator=generator)  # many captions shared between images
    vocabulary = torch.randint(-1, 2, (40, 3), generator=generator).float()  # few distinct directions: many ties
    images = torch.randint(-1, 2, (n_images, 3), generator=generator).float() + 0.01
    texts = vocabulary[ids]
    full = recall_at_k(images, texts, owners, chunk_size=10_000, text_ids=ids)
    monkeypatch.setattr(retrieval, "SCORE_COLUMN_BLOCK", column_block)  # candidates scored and counted in blocks
    assert recall_at_k(images, texts, owners, chunk_size=chunk_size, text_ids=ids) == full


def test_single_image() -> None:
    images = torch.randn(1, 4)
    texts = torch.randn(3, 4)
    metrics = recall_at_k(images, texts, torch.zeros(3, dtype=torch.long))
    assert all(value == 100.0 for value in metrics.values())


def test_input_checks() -> None:
    images, texts, owners = _hand_made()
    with pytest.raises(ValueError, match="no caption"):
        recall_at_k(images, texts[:4], owners[:4])
    with pytest.raises(ValueError, match="entries"):
        recall_at_k(images, texts, owners[:5])
    with pytest.raises(ValueError, match="outside"):
        recall_at_k(images, texts, torch.tensor([0, 0, 1, 1, 2, 3]))
    with pytest.raises(ValueError, match="embedding sizes"):
        recall_at_k(images, texts[:, :3], owners)
    with pytest.raises(ValueError, match="NaN"):
        recall_at_k(images, texts.clone().fill_(math.nan), owners)
    with pytest.raises(ValueError, match="chunk_size"):
        recall_at_k(images, texts, owners, chunk_size=0)
    with pytest.raises(ValueError, match="text_ids has 5 entries"):
        recall_at_k(images, texts, owners, text_ids=[0, 1, 2, 3, 4])


def test_half_precision_inputs() -> None:
    images, texts, owners = _hand_made()
    metrics = recall_at_k(images.half(), texts.half(), owners)
    assert metrics["i2t_R@1"] == pytest.approx(200 / 3, abs=1e-4)


def test_captions_to_text_to_image() -> None:
    texts, owners = captions_to_text_to_image([["a", "b"], ["c"], ["d", "e", "f"]])
    assert texts == ["a", "b", "c", "d", "e", "f"]
    assert owners.tolist() == [0, 0, 1, 2, 2, 2]
    assert owners.dtype == torch.long
