"""The closed-form pieces of RAIL (Xu et al., NeurIPS 2024, arXiv 2406.18868), as pure functions on tensors.

Notation: X [N, D] the frozen CLIP image features of N training images (unit norm), Y [N, C] their one-hot labels over
the C classes learned so far, λ the ridge, W_e [D, H] the randomly initialised hidden layer (RHL).

- Primal (Fig. 5b, Theorem 1): Φ = ReLU(X W_e) (`expand`); W = (ΦᵀΦ + λI)⁻¹ ΦᵀY (`ridge_solution`). Across tasks the
  memory M_p = (Σ ΦᵀΦ + λI)⁻¹ is updated with the Woodbury identity and W recursively (`primal_update`):
      M_p ← M_p − M_p Φᵀ (I + Φ M_p Φᵀ)⁻¹ Φ M_p,        W ← W + M_p Φᵀ (Y − Φ W)
  (the new M_p in the second line), W padded with zero columns for the task's new classes first. The result equals
  the joint ridge solution on every task's data ("absolute memorization"; tests/test_rail.py checks it in float64).
- Dual (Fig. 5c, Theorem 2): kernel ridge regression with the Gaussian kernel k(x, x') = exp(−γ‖x − x'‖²): the
  memory keeps every training feature X, and α = (K + λI)⁻¹ Y (`kernel_ridge_alpha`); scores k(x, X) α. The inverse
  M_d = (K + λI)⁻¹ is grown task by task with the block (Schur complement) inverse (`dual_update`), or re-inverted
  from the stored features as the official `dual_RAIL.py` does (`kernel_ridge_alpha`).
- Fusion (Fig. 5a): an image whose zero-shot top-1 class (among the candidates) is a learned class scores
  (1 − β) softmax(zero-shot logits) + β adapter scores (0 for classes not learned); any other image keeps the
  zero-shot softmax (`fuse`).

The equation text of the paper's Sec. 4 could not be read here (only its abstract and Fig. 5's caption); the forms
above follow Fig. 5 and the official code (github.com/linghan1997/Regression-based-Analytic-Incremental-Learning,
`primal_RAIL.py`, `dual_RAIL.py`, `utils.py`).
"""

from __future__ import annotations

import torch


def expand(features: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Φ = ReLU(X W_e), the randomly initialised hidden layer (`hidden` [D, H]); X itself without one."""
    return features if hidden is None else torch.relu(features @ hidden.to(features.dtype))


def ridge_solution(features: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """The joint ridge solution W = (XᵀX + λI)⁻¹ XᵀY [D, C] (what the recursion must equal)."""
    eye = torch.eye(features.shape[1], dtype=features.dtype, device=features.device)
    return torch.linalg.solve(features.T @ features + ridge * eye, features.T @ targets)


def pad_columns(matrix: torch.Tensor, columns: int) -> torch.Tensor:
    """`matrix` with zero columns appended up to `columns` (the classes a task adds)."""
    extra = columns - matrix.shape[1]
    if extra < 0:
        raise ValueError(f"cannot shrink {matrix.shape[1]} learned classes to {columns}")
    return torch.cat([matrix, matrix.new_zeros(matrix.shape[0], extra)], dim=1) if extra else matrix


def primal_update(memory: torch.Tensor, weight: torch.Tensor, features: torch.Tensor, targets: torch.Tensor,
                  chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Theorem 1's recursive update by one batch of (expanded) `features` [N, H] and one-hot `targets` [N, C]:
    returns the new memory M_p [H, H] and weight W [H, C] (`weight` is padded to C columns first). Applied to
    `chunk_size` rows at a time (each step inverts a chunk x chunk matrix; the result does not depend on it)."""
    weight = pad_columns(weight, targets.shape[1])
    for start in range(0, features.shape[0], chunk_size):
        rows, labels = features[start:start + chunk_size], targets[start:start + chunk_size]
        eye = torch.eye(rows.shape[0], dtype=rows.dtype, device=rows.device)
        projected = rows @ memory  # Φ M_p (M_p is symmetric)
        memory = memory - projected.T @ torch.linalg.solve(eye + projected @ rows.T, projected)
        memory = (memory + memory.T) / 2  # keep it exactly symmetric against rounding
        weight = weight + memory @ rows.T @ (labels - rows @ weight)
    return memory, weight


def rbf_kernel(left: torch.Tensor, right: torch.Tensor, gamma: float) -> torch.Tensor:
    """k(x, x') = exp(−γ‖x − x'‖²) [N, M] between the rows of `left` [N, D] and `right` [M, D]."""
    return torch.exp(-gamma * torch.cdist(left, right).pow(2))


def kernel_ridge_alpha(features: torch.Tensor, targets: torch.Tensor, ridge: float, gamma: float) -> torch.Tensor:
    """The dual solution α = (K + λI)⁻¹ Y [N, C] on every stored feature (the official code re-solves it per task)."""
    kernel = rbf_kernel(features, features, gamma)
    eye = torch.eye(kernel.shape[0], dtype=kernel.dtype, device=kernel.device)
    return torch.linalg.solve(kernel + ridge * eye, targets)


def dual_update(inverse: torch.Tensor, memory: torch.Tensor, features: torch.Tensor, ridge: float, gamma: float
                ) -> torch.Tensor:
    """M_d = (K + λI)⁻¹ over `memory` [N, D] grown by the new `features` [M, D] (block inverse through the Schur
    complement S = (k_nn + λI) − k_nᵀ M_d k_n): the [(N+M), (N+M)] inverse, without re-inverting the old block."""
    if memory.shape[0] == 0:
        kernel = rbf_kernel(features, features, gamma)
        return torch.linalg.inv(kernel + ridge * torch.eye(kernel.shape[0], dtype=kernel.dtype, device=kernel.device))
    cross = rbf_kernel(memory, features, gamma)  # k_n [N, M]
    own = rbf_kernel(features, features, gamma)
    eye = torch.eye(own.shape[0], dtype=own.dtype, device=own.device)
    mapped = inverse @ cross  # M_d k_n [N, M]
    schur_inverse = torch.linalg.inv(own + ridge * eye - cross.T @ mapped)
    top_left = inverse + mapped @ schur_inverse @ mapped.T
    top_right = -mapped @ schur_inverse
    grown = torch.cat([torch.cat([top_left, top_right], dim=1), torch.cat([top_right.T, schur_inverse], dim=1)])
    return (grown + grown.T) / 2


def fuse(zero_shot_logits: torch.Tensor, adapter_scores: torch.Tensor, learned: torch.Tensor, beta: float
         ) -> torch.Tensor:
    """Fig. 5a's fusion: zero-shot logits [N, C] over the candidate classes, the adapter's scores [N, C] (0 in the
    columns of classes not learned), `learned` [C] bool. Rows whose zero-shot top-1 class is learned score
    (1 − β) softmax + β adapter; the others the zero-shot softmax."""
    probabilities = zero_shot_logits.softmax(dim=-1)
    seen = learned[zero_shot_logits.argmax(dim=-1)]
    fused = (1 - beta) * probabilities + beta * adapter_scores
    return torch.where(seen[:, None], fused, probabilities)
