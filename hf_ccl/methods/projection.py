"""The linear algebra of DNS (Dual-sided Null Space; Liu et al., "Continual Multimodal Contrastive Learning",
arXiv 2503.14963), pure functions on tensors. Spec: specs/cmcl.md §2.2–2.3 and §7 (A1, A3, A4).

Conventions. A torch `nn.Linear` weight W has shape [d_out, d_in] and computes y = W x (rows: `x @ W.T`), so the
paper's column-convention learner `z = W z*` *is* `weight` and ∇W is `weight.grad` (spec §2.3). Feature batches
are row matrices X ∈ R^{n×d}.

- Running uncentered covariance (Alg. 1 l.16–18, Thm. 8 = App. B.5):
  C_{<t+1} = (n̄_{t−1}/n̄_t) C_{<t} + (1/n̄_t) Xᵀ X,  n̄_t = n̄_{t−1} + n_t.
  Its column space is the span of every feature seen so far (Thm. 8), so one projector covers all earlier tasks.
- Range projector of a covariance (Sec. 4.1 "truncated SVD, minimum eigenvalue λ_min"; official `get_projector`):
  P = U_k U_kᵀ over the eigenvectors whose eigenvalue passes the threshold (`null_space_projector`).
- Dual-sided null-space projection of a gradient (Thm. 4, Eq. 8 = Eqs. 36/55, A1):
  ΔW = G − P_out G P_in,   G, ΔW ∈ R^{d_out×d_in},
  P_out ∈ R^{d_out×d_out} (projector onto the PARTNER modality's old outputs) multiplies on the LEFT,
  P_in ∈ R^{d_in×d_in} (projector onto the layer's OWN old inputs) multiplies on the RIGHT.
  For any old output z' of the partner and old input x of the layer, z'ᵀ ΔW x = z'ᵀ G x − (P_out z')ᵀ G (P_in x) = 0:
  the old alignment z'ᵀ W x does not move at first order (spec §2.2, "independent check"); vec ΔW =
  (I − P_in ⊗ P_out) vec G is itself an orthogonal projection, so ⟨G, ΔW⟩ = ‖ΔW‖²_F ≥ 0 (Thm. 6, Eqs. 75–82).
"""

from __future__ import annotations

import torch

THRESHOLD_MODES = ("absolute", "relative")


def second_moment(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(Xᵀ X in float64, n) for row vectors `x` [..., d] (leading dimensions are flattened into rows)."""
    rows = x.detach().reshape(-1, x.shape[-1]).double()
    return rows.T @ rows, rows.shape[0]


def merge_second_moment(
    cov: torch.Tensor | None, count: int | float, gram: torch.Tensor, new_count: int | float
) -> tuple[torch.Tensor, int]:
    """Fold a batch's sum of outer products `gram` = Σ x xᵀ over `new_count` rows into the running mean `cov` of
    `count` rows: C ← (n/(n+k)) C + gram/(n+k) (Alg. 1 l.16–18, Thm. 8). Exact: merging batch sums one by one
    gives the covariance of all rows at once. `cov=None` (or `count=0`) starts a new one. Returns (C, n + k)."""
    count, new_count = int(count), int(new_count)
    gram = gram.double()
    total = count + new_count
    if total == 0:
        return (torch.zeros_like(gram) if cov is None else cov), 0
    if cov is None or count == 0:
        return gram / total, total
    return cov.double() * (count / total) + gram.to(cov.device) / total, total


def uncentered_covariance_update(
    cov: torch.Tensor | None, count: int | float, x: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Running uncentered covariance (1/n) Σ x xᵀ of row vectors: merge the rows of `x` [..., d] into `cov`
    ([d, d], the mean over `count` earlier rows; None for none). Returns (C, count) in float64 (Thm. 8)."""
    gram, rows = second_moment(x)
    return merge_second_moment(cov, count, gram.to(cov.device) if cov is not None else gram, rows)


def kept_eigenvalues(eigenvalues: torch.Tensor, threshold: float, mode: str = "absolute") -> torch.Tensor:
    """Boolean mask of the eigenvalues that span the protected subspace.

    - `absolute` (the paper's rule, spec §2.3/A4): λ_i > threshold. Scale-dependent: the paper uses 0.01 for
      ImageBind/UniBind and 1e-4 for LanguageBind features.
    - `relative`: λ_i / λ_max > threshold (normalized eigenvalues; scale-free). An all-zero covariance keeps none.
    Threshold 0 keeps every strictly positive eigenvalue: a full-rank covariance then gives P = I.
    """
    if mode not in THRESHOLD_MODES:
        raise ValueError(f"threshold mode must be one of {list(THRESHOLD_MODES)}, got {mode!r}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if mode == "absolute":
        return eigenvalues > threshold
    top = eigenvalues.max() if eigenvalues.numel() else eigenvalues.new_zeros(())
    if top <= 0:
        return torch.zeros_like(eigenvalues, dtype=torch.bool)
    return eigenvalues / top > threshold


def null_space_projector(
    cov: torch.Tensor, threshold: float, mode: str = "absolute"
) -> tuple[torch.Tensor, int]:
    """The range projector P = U_k U_kᵀ of a symmetric PSD covariance (Sec. 4.1 truncated SVD; spec §2.3), U_k the
    eigenvectors whose eigenvalues pass `threshold` under `mode` (see `kept_eigenvalues`). Its complement I − P is
    the null space into which DNS moves the gradient (Eq. 8). Computed with `eigh` in float64 (equal to the SVD for
    a PSD matrix). Returns (P [d, d] float64, rank k). P = 0 when nothing passes (no projection); P = I when every
    eigenvalue passes (e.g. threshold 0 on a full-rank covariance), which freezes that side."""
    cov = cov.double()
    cov = (cov + cov.T) / 2
    eigenvalues, eigenvectors = torch.linalg.eigh(cov)
    basis = eigenvectors[:, kept_eigenvalues(eigenvalues, threshold, mode)]
    return basis @ basis.T, int(basis.shape[1])


def dual_null_space_projection(
    grad: torch.Tensor, p_out: torch.Tensor | None, p_in: torch.Tensor
) -> torch.Tensor:
    """ΔW = G − P_out G P_in (Thm. 4, Eq. 8; spec A1), for G = `grad` of a Linear weight [d_out, d_in]:
    `p_out` [d_out, d_out] on the left (the partner's old outputs), `p_in` [d_in, d_in] on the right (the layer's
    own old inputs). `p_out=None` stands for P_out = I, the one-sided update G (I − P_in) that the official code
    effectively runs (its output-side threshold 0 keeps every numerically-zero eigenvalue, spec A3). Returns a new
    tensor in `grad`'s dtype; the projectors are used in `grad`'s dtype and device."""
    p_in = p_in.to(device=grad.device, dtype=grad.dtype)
    right = grad @ p_in
    if p_out is None:
        return grad - right
    return grad - p_out.to(device=grad.device, dtype=grad.dtype) @ right
