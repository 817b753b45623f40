"""Pure tensor functions of CTP (Zhu et al., ICCV 2023, arXiv 2308.07146; spec: ../shared/specs/ctp.md).

Equation numbers are the paper's. Every function works on plain tensors, so each can be checked by hand:
the compatible momentum update (Eq. 3), the FIFO feature queue (Sec. 4.2), the momentum contrast against the
batch's momentum features plus the queue (Eq. 4), and the topology-preservation divergence between the current and
the previous-task similarity distributions (Eq. 6-9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..losses import soft_targets

#: Value written over excluded entries of a similarity matrix before dividing by tau (P Sec. 4.3, "e.g. -1000").
#: Finite on purpose: -1000 / 0.07 underflows to probability 0 without the NaN that -inf gives in `F.kl_div`.
EXCLUDED_SIMILARITY = -1000.0

DIVERGENCES = ("cross_entropy", "kl")


def momentum_update(
    theta_c: torch.Tensor,
    theta_t: torch.Tensor,
    theta_prev: torch.Tensor | None,
    m: float,
    previous_share: float = 0.5,
) -> torch.Tensor:
    """Compatible momentum update (Eq. 3), returned as a new tensor:

        theta_c <- m * theta_c + (1 - m)/2 * theta_{t-1} + (1 - m)/2 * theta_t.

    `previous_share` is the part of (1 - m) given to theta_{t-1}: 0.5 is Eq. 3, 0 is "only theta^t" (a plain EMA of
    the current model) and 1 is "only theta^{t-1}" (Tab. 3 ablations). With no previous-task model (`theta_prev`
    None, the first task) it is the plain EMA theta_c <- m * theta_c + (1 - m) * theta_t (App. E.1, m = 0.995).
    """
    if theta_prev is None or previous_share == 0.0:
        return m * theta_c + (1.0 - m) * theta_t
    return m * theta_c + (1.0 - m) * previous_share * theta_prev + (1.0 - m) * (1.0 - previous_share) * theta_t


@torch.no_grad()
def momentum_update_(
    theta_c: list[torch.Tensor],
    theta_t: list[torch.Tensor],
    theta_prev: list[torch.Tensor] | None,
    m: float,
    previous_share: float = 0.5,
) -> None:
    """`momentum_update` applied in place to lists of tensors with fused `torch._foreach_*` kernels (the hot path:
    one pass per term over all parameters, no temporaries)."""
    torch._foreach_mul_(theta_c, m)
    if theta_prev is None or previous_share == 0.0:
        torch._foreach_add_(theta_c, theta_t, alpha=1.0 - m)
        return
    torch._foreach_add_(theta_c, theta_prev, alpha=(1.0 - m) * previous_share)
    if previous_share < 1.0:
        torch._foreach_add_(theta_c, theta_t, alpha=(1.0 - m) * (1.0 - previous_share))


def enqueue(queue: torch.Tensor, pointer: int, items: torch.Tensor) -> tuple[torch.Tensor, int]:
    """FIFO queue of momentum features (Sec. 4.2) as a ring buffer: write `items` [n, ...] at rows `pointer`,
    `pointer + 1`, ... (wrapping around the K rows of `queue`) and return the new queue and pointer.

    The oldest entries are overwritten first; when n > K only the last K items are kept. K need not be a multiple of
    the batch (the official code asserts it is; the ring buffer makes that unnecessary).
    """
    size = queue.shape[0]
    if size == 0:
        return queue, 0
    items = items.detach().to(device=queue.device, dtype=queue.dtype)
    if items.shape[0] > size:
        pointer = (pointer + items.shape[0] - size) % size
        items = items[-size:]
    rows = (pointer + torch.arange(items.shape[0], device=queue.device)) % size
    return queue.index_copy(0, rows, items), int((pointer + items.shape[0]) % size)


def queue_positive_mask(
    text_hash: torch.Tensor, image_hash: torch.Tensor, queue_text_hash: torch.Tensor, queue_image_hash: torch.Tensor
) -> torch.Tensor:
    """Boolean [N, K]: batch pair i and queued pair k are positives when they share the text or the image.

    The queue extension of `hf_ccl.losses.positive_mask` (DESIGN.md, "Positives in a batch"): a queued momentum
    feature of the same caption (a class template) or of the same image is not a negative. Queue rows never filled
    hold hash 0 and match nothing in practice (hashes are 64-bit).
    """
    same_text = text_hash[:, None] == queue_text_hash[None, :]
    same_image = image_hash[:, None] == queue_image_hash[None, :]
    return same_text | same_image


def momentum_contrast_loss(
    queries: torch.Tensor,
    batch_keys: torch.Tensor,
    queue_keys: torch.Tensor | None,
    temperature: float,
    positives: torch.Tensor | None = None,
    queue_positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """One direction of the compatible momentum contrast (Eq. 4), e.g. L^c_i2t:

        L = -(1/B) sum_i log( exp(s(I_i, Q_i)/tau) / sum_{j=1..N_Q} exp(s(I_i, Q_j)/tau) ),

    with the contrast set Q = [batch_keys; queue_keys] (N_Q = B + K: this batch's momentum features first, then
    the queue) and queries the current model's normalised features [B, D] (keys [*, D], detached by the caller).
    Targets: column i of row i when `positives` is None (the paper); otherwise uniform over the row's positives,
    `positives` [B, B] over the batch keys and `queue_positives` [B, K] over the queue (no queued positive if None).
    """
    keys = batch_keys if queue_keys is None or queue_keys.shape[0] == 0 else torch.cat([batch_keys, queue_keys])
    logits = queries.float() @ keys.float().t() / temperature
    if positives is None:
        return F.cross_entropy(logits, torch.arange(queries.shape[0], device=queries.device))
    if keys.shape[0] > batch_keys.shape[0]:
        if queue_positives is None:
            queue_positives = positives.new_zeros(positives.shape[0], keys.shape[0] - batch_keys.shape[0])
        positives = torch.cat([positives, queue_positives.to(positives.device)], dim=1)
    return -(soft_targets(positives) * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


def exclude_entries(similarity: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
    """Eq. 8's s-hat: the similarity with excluded entries (the diagonal: each sample with itself) set to -1000."""
    return similarity if exclude is None else similarity.masked_fill(exclude, EXCLUDED_SIMILARITY)


def topology_loss(
    similarity: torch.Tensor,
    reference_similarity: torch.Tensor,
    temperature: float,
    exclude: torch.Tensor | None = None,
    divergence: str = "cross_entropy",
) -> torch.Tensor:
    """One term of topology preservation (Eq. 6-9), e.g. H(P^{i2t}_{theta_{t-1}}, P^{i2t}_{theta_t}):

        P(a)[b] = exp(s(a, b)/tau) / sum_b' exp(s(a, b')/tau)                         (Eq. 6; Eq. 8 with s-hat)

    the row-softmax of the cosine similarities, for the current model (`similarity`, with gradients) and the
    previous-task model (`reference_similarity`, the target). Entries in `exclude` are set to -1000 in both before
    dividing by tau (Eq. 8, "apical dominance"), so the target puts exactly 0 on them. Averaged over rows.

    `divergence`: "cross_entropy" is the paper's H(P_ref, P) (Eq. 7, 9); "kl" the official code's
    KL(P_ref || P) (`nn.KLDivLoss(reduction="batchmean")`), smaller by the target's entropy, same gradient.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    log_probs = F.log_softmax(exclude_entries(similarity.float(), exclude) / temperature, dim=-1)
    target = F.softmax(exclude_entries(reference_similarity.detach().float(), exclude) / temperature, dim=-1)
    if divergence == "kl":
        return F.kl_div(log_probs, target, reduction="batchmean")
    return -(target * log_probs).sum(dim=-1).mean()


def same_item_mask(hashes: torch.Tensor | None, size: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean [N, N]: entries whose two items are the same sample (Eq. 8's diagonal). With `hashes` (one int per
    item) every pair of identical items counts, not only the diagonal: two copies of one image (or caption) have
    similarity 1 under both models, the "apical dominance" Eq. 8 removes. Without hashes: the identity."""
    if hashes is None:
        return torch.eye(size, dtype=torch.bool, device=device)
    return hashes[:, None] == hashes[None, :]
