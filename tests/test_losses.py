"""The contrastive loss: hand-computed values, the multi-positive mask, equality with transformers' clip_loss."""

import math

import torch
from transformers.models.clip.modeling_clip import image_text_contrastive_loss

from hf_ccl.losses import clip_contrastive_loss, positive_mask, soft_targets


def test_two_by_two_by_hand():
    # S = [[2, 0], [1, 3]]: image rows, text columns.
    logits = torch.tensor([[2.0, 0.0], [1.0, 3.0]])
    image_loss = (-math.log(math.exp(2) / (math.exp(2) + 1)) - math.log(math.exp(3) / (math.exp(1) + math.exp(3)))) / 2
    text_loss = (-math.log(math.exp(2) / (math.exp(2) + math.exp(1))) - math.log(math.exp(3) / (1 + math.exp(3)))) / 2
    assert math.isclose(clip_contrastive_loss(logits).item(), (image_loss + text_loss) / 2, rel_tol=1e-6)


def test_equals_transformers_clip_loss_and_unique_mask_is_diagonal():
    torch.manual_seed(0)
    logits = torch.randn(7, 7) * 5
    reference = image_text_contrastive_loss(logits.t())  # transformers takes logits_per_text
    assert torch.allclose(clip_contrastive_loss(logits), reference, atol=1e-6)
    mask = positive_mask(torch.arange(7), torch.arange(7) + 100)
    assert torch.equal(mask, torch.eye(7, dtype=torch.bool))
    assert torch.allclose(clip_contrastive_loss(logits, mask), reference, atol=1e-6)


def test_duplicate_texts_are_positives_by_hand():
    # Examples 0 and 1 share a caption: row 0 has positives {0, 1}, row 2 only {2}.
    mask = positive_mask(torch.tensor([5, 5, 9]), torch.tensor([0, 1, 2]))
    assert mask.tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    assert torch.allclose(soft_targets(mask)[0], torch.tensor([0.5, 0.5, 0.0]))
    logits = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    log_z01 = math.log(2 * math.e + 1)  # rows 0 and 1 (and columns 0 and 1): logsumexp of [1, 1, 0]
    log_z2 = math.log(2 + math.exp(2))  # row and column 2: logsumexp of [0, 0, 2]
    one_direction = (2 * (log_z01 - 1) + (log_z2 - 2)) / 3  # targets 1/2 on two entries of logit 1
    assert math.isclose(clip_contrastive_loss(logits, mask).item(), one_direction, rel_tol=1e-6)


def test_same_image_is_positive():
    mask = positive_mask(torch.tensor([1, 2, 3]), torch.tensor([7, 7, 8]))
    assert mask[0, 1] and mask[1, 0] and not mask[0, 2]
