"""Loss functions as plain functions on tensors (easy to test, easy to reuse across methods)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def positive_mask(text_hash: torch.Tensor, image_hash: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [N, N] mask of image-text pairs that are positives: same text or same image (DESIGN.md).

    Row i is an image, column j a text; (i, j) is positive when text j equals text i or image j is image i.
    With unique texts and images it is the identity, and every loss below reduces to its diagonal form.
    """
    mask = text_hash[:, None] == text_hash[None, :]
    if image_hash is not None:
        mask = mask | (image_hash[:, None] == image_hash[None, :])
    return mask


def soft_targets(mask: torch.Tensor) -> torch.Tensor:
    """Row-normalised targets: uniform over each row's positives."""
    mask = mask.to(torch.float32)
    return mask / mask.sum(dim=1, keepdim=True).clamp_min(1.0)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_j targets[i, j] * log softmax(logits[i])_j."""
    return -(targets * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1).mean()


def clip_contrastive_loss(logits_per_image: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, Fig. 3):

        L = 1/2 [ CE(S, y) + CE(S^T, y) ],   S = exp(t) * norm(I) norm(T)^T,

    with y the diagonal when `mask` is None (identical to `transformers`' `clip_loss`) and otherwise the
    multi-positive targets y_ij = mask_ij / sum_k mask_ik (uniform over the positives of each row and column).
    """
    if mask is None:
        labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
        image_loss = F.cross_entropy(logits_per_image.float(), labels)
        text_loss = F.cross_entropy(logits_per_image.t().float(), labels)
    else:
        image_loss = soft_cross_entropy(logits_per_image, soft_targets(mask))
        text_loss = soft_cross_entropy(logits_per_image.t(), soft_targets(mask.t()))
    return (image_loss + text_loss) / 2.0


def sigmoid_contrastive_loss(
    logits_per_image: torch.Tensor, mask: torch.Tensor | None = None, num_rows: int | None = None
) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss (Zhai et al. 2023, Eq. 1 / Algorithm 1):

        L = -1/|B| sum_i sum_j log sigmoid(z_ij * (t x_i . y_j + b)),   z_ij = 1 for a positive pair, else -1,

    on `logits_per_image` = t x_i . y_j + b (image rows, text columns). Positives are the diagonal when `mask` is
    None (then it equals `SiglipModel`'s own loss) and the mask's pairs otherwise (duplicate texts or images).
    `logits_per_image` may hold only some rows of the batch (one process's images against every text): `num_rows` is
    then |B|, the number of images in the whole batch (default: the rows given).
    """
    logits = logits_per_image.float()
    if mask is None:
        mask = torch.eye(logits.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    signs = mask.to(logits.dtype) * 2.0 - 1.0
    rows = logits.shape[0] if num_rows is None else num_rows
    return -F.logsigmoid(signs * logits).sum() / rows
