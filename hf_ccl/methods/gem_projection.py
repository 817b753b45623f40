"""The gradient projections of GEM and A-GEM, as pure functions on flat gradient vectors (no model, no data).

GEM (Lopez-Paz & Ranzato, "Gradient Episodic Memory for Continual Learning", NeurIPS 2017). With g the current
gradient and g_k the gradient of task k's loss on its episodic memory, the step uses the closest gradient that does
not increase any old loss (Eq. 10; Eq. 11 is the first-order form of its constraint):

    min_g̃ ½‖g − g̃‖²   s.t. ⟨g̃, g_k⟩ ≥ 0 for all k < t,                                         (Eqs. 10–11)

solved through its dual, G = [g_1; …; g_{t−1}] (rows):

    min_v ½ vᵀ G Gᵀ v + (G g)ᵀ v   s.t. v ≥ 0,     g̃ = Gᵀ v* + g.                            (Eqs. 12–13)

As the official code (`project2cone2`, github.com/facebookresearch/GradientEpisodicMemory) `gem_project` solves
min_v ½ vᵀ(G Gᵀ + εI)v + (G g)ᵀ v s.t. v ≥ γ, γ = `margin` (the official `memory_strength`, the paper's "small
constant added to v*" biasing towards backward transfer; CMCL's margin 0.5) and ε = `eps`. Callers project only
when some ⟨g, g_k⟩ < 0. Then G g̃ = r − εv with r = (GGᵀ + εI)v + Gg ≥ 0 the QP's KKT multipliers, so
⟨g̃, g_k⟩ ≥ −ε v_k: the constraints hold up to ε v_k (exactly with ε → 0). No quadprog: `solve_box_qp` is an exact
active-set solver in float64.

A-GEM (Chaudhry et al., "Efficient Lifelong Learning with A-GEM", ICLR 2019) keeps a single constraint, on the
gradient g_ref of a random memory batch:

    g̃ = g − (gᵀ g_ref / g_refᵀ g_ref) g_ref   if gᵀ g_ref < 0, else g.                          (Eq. 11)

Inner products (G Gᵀ, G g) are read from the gradients in place, a block of `CHUNK` coordinates at a time: each
block in the gradients' precision (at least float32: BLAS dot and matrix products), the blocks summed in float64 (a
full CLIP's gradient is never copied, to float64 or otherwise); the QP is solved in float64. The projected vector is
one fused pass in the gradient's precision (at least float32).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

#: Coordinates per block of the inner products: each block's sum in the vectors' precision (float32 BLAS), the
#: blocks' sums in float64.
CHUNK = 1 << 20


# ----- the QP (GEM Eq. 12) ----------------------------------------------------------------------------------------
def box_qp_residual(Q: torch.Tensor, c: torch.Tensor, lower: torch.Tensor | float, v: torch.Tensor) -> float:
    """‖min(v − lower, Qv + c)‖∞: the natural KKT residual of min ½vᵀQv + cᵀv s.t. v ≥ lower (0 iff optimal)."""
    Q, c, v = Q.double(), c.double(), v.double()
    lower = torch.as_tensor(lower, dtype=torch.float64, device=v.device).expand_as(v)
    if v.numel() == 0:
        return 0.0
    return float(torch.minimum(v - lower, Q @ v + c).abs().max())


def solve_box_qp(
    Q: torch.Tensor,
    c: torch.Tensor,
    lower: torch.Tensor | float = 0.0,
    tol: float = 1e-10,
    max_iter: int | None = None,
) -> torch.Tensor:
    """Exact solution of min_v ½ vᵀQv + cᵀv s.t. v ≥ lower, Q symmetric positive definite [t, t] (float64, CPU).

    With u = v − lower this is min ½ uᵀQu + bᵀu, u ≥ 0, b = c + Q·lower, solved by the active-set method of Lawson &
    Hanson (NNLS, "Solving Least Squares Problems", 1974, ch. 23) on the quadratic: finite, each step an exact
    solve on the free set. Stops when the KKT residual (`box_qp_residual`) is below `tol` times the problem's scale
    (max |Q|, |c|); a few sweeps of exact cyclic coordinate descent polish any round-off left.
    """
    if Q.ndim != 2 or Q.shape[0] != Q.shape[1] or c.shape != (Q.shape[0],):
        raise ValueError(f"QP needs Q [t, t] and c [t], got {tuple(Q.shape)} and {tuple(c.shape)}")
    Q = Q.detach().to("cpu", torch.float64)
    c = c.detach().to("cpu", torch.float64)
    t = c.numel()
    low = torch.as_tensor(lower, dtype=torch.float64).to("cpu").expand(t).clone()
    if t == 0:
        return low
    if not (torch.isfinite(Q).all() and torch.isfinite(c).all()):
        raise ValueError("QP with non-finite entries (a non-finite gradient?)")
    Q = (Q + Q.T) / 2
    b = c + Q @ low
    scale = max(
        float(Q.abs().max()), float(c.abs().max()), float(b.abs().max()), torch.finfo(torch.float64).tiny
    )
    threshold = tol * scale
    u = torch.zeros(t, dtype=torch.float64)
    free = torch.zeros(t, dtype=torch.bool)
    for _ in range(max_iter or 3 * t + 10):
        w = -(Q @ u + b)  # the negative gradient; positive entries at u = 0 violate KKT
        w_bound = w.masked_fill(free, -math.inf)
        j = int(torch.argmax(w_bound))
        if float(w_bound[j]) <= threshold:
            break
        free[j] = True
        for _ in range(t + 1):  # each pass that does not end the loop returns at least one index to its bound
            index = free.nonzero().squeeze(1)
            s = torch.zeros_like(u)
            s[index] = torch.linalg.solve(Q[index][:, index], -b[index])
            if bool((s[index] > 0).all()):
                u = s
                break
            # Step from u towards s until the first free coordinate reaches its bound.
            blocked = index[s[index] <= 0]
            gap = u[blocked] - s[blocked]
            ratios = torch.where(gap > 0, u[blocked] / gap.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
            k = int(torch.argmin(ratios))
            u = u + ratios[k].clamp(0.0, 1.0) * (s - u)
            u[blocked[k]] = 0.0
            free &= u > 0
            u[~free] = 0.0
    # Polish: exact coordinate minimisation, v_i ← max(0, u_i − (Qu + b)_i / Q_ii), until KKT holds to `tol`.
    for _ in range(100):
        if box_qp_residual(Q, b, 0.0, u) <= threshold:
            break
        for i in range(t):
            u[i] = max(0.0, float(u[i] - (Q[i] @ u + b[i]) / Q[i, i]))
    residual = box_qp_residual(Q, b, 0.0, u)
    if residual > threshold:
        logger.warning("GEM's QP stopped at KKT residual %.3g (tolerance %.3g)", residual, threshold)
    return u + low


# ----- inner products of long vectors, a block at a time -------------------------------------------------------
def _work(x: torch.Tensor) -> torch.Tensor:
    """`x` in at least float32 (a bf16/fp16 block is widened; float32 and float64 are used as they are)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _rows(vectors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    rows = list(vectors)
    if not rows or any(v.ndim != 1 or v.numel() != rows[0].numel() for v in rows):
        raise ValueError(f"need 1-D vectors of one length, got shapes {[tuple(v.shape) for v in rows]}")
    return rows


def gram(vectors: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The Gram matrix [k, k] (float64, on the first vector's device) of k vectors of one length (a list, or the rows
    of a [k, P] tensor), read in place (no copy): each block of `CHUNK` coordinates in the vectors' own precision (at
    least float32), the blocks summed in float64. A vector with a non-finite entry (or a squared norm beyond its
    precision) has a non-finite diagonal entry."""
    rows = _rows(vectors)
    k, device = len(rows), rows[0].device
    out = torch.zeros(k, k, dtype=torch.float64, device=device)
    for start in range(0, rows[0].numel(), CHUNK):
        blocks = [_work(v[start : start + CHUNK].to(device)) for v in rows]
        for i in range(k):
            for j in range(i, k):
                out[i, j] += torch.dot(blocks[i], blocks[j].to(blocks[i].dtype)).double()
    return torch.triu(out) + torch.triu(out, 1).T


def gem_products(G: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G Gᵀ [t, t], G g [t], gᵀg []) in float64 on G's device, from G [t, P] and g [P] read in place (matrix
    products per block of `CHUNK` coordinates in their precision, at least float32; blocks summed in float64)."""
    if G.ndim != 2 or g.ndim != 1 or G.shape[1] != g.numel():
        raise ValueError(f"need G [t, P] and g [P], got {tuple(G.shape)} and {tuple(g.shape)}")
    t = G.shape[0]
    GGt = torch.zeros(t, t, dtype=torch.float64, device=G.device)
    Gg = torch.zeros(t, dtype=torch.float64, device=G.device)
    gg = torch.zeros((), dtype=torch.float64, device=G.device)
    for start in range(0, g.numel(), CHUNK):
        rows = _work(G[:, start : start + CHUNK])
        block = _work(g[start : start + CHUNK].to(G.device)).to(rows.dtype)
        GGt += (rows @ rows.T).double()
        Gg += (rows @ block).double()
        gg += torch.dot(block, block).double()
    return GGt, Gg, gg


def dots(G: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """⟨g_k, g⟩ for every row g_k of G [t, P], float64 [t] (`gem_products`)."""
    return gem_products(G, g)[1]


def combine(g: torch.Tensor, G: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """g + Gᵀv (= g + Σ_k v_k g_k) in one pass, in g's dtype (at least float32 inside) and device; written into
    `out` (a buffer of g's shape, dtype and device that does not overlap g) where given and g is float32 or float64."""
    work = _work(g)
    matrix, weights = _work(G.to(g.device)).T.to(work.dtype), v.to(g.device, work.dtype)
    if out is not None and work is g:
        return torch.addmv(work, matrix, weights, out=out)
    return torch.addmv(work, matrix, weights).to(g.dtype)


def gem_dual(GGt: torch.Tensor, Gg: torch.Tensor, margin: float = 0.5, eps: float = 1e-3, tol: float = 1e-10
             ) -> torch.Tensor:
    """v* of GEM's dual (Eq. 12, official `project2cone2`): min ½vᵀ(GGᵀ + εI)v + (Gg)ᵀv s.t. v ≥ margin, from the
    inner products (float64, on the CPU)."""
    Q = GGt.double().cpu() + eps * torch.eye(GGt.shape[0], dtype=torch.float64)
    return solve_box_qp(Q, Gg.double().cpu(), margin, tol)


def gem_project(
    g: torch.Tensor, G: torch.Tensor, margin: float = 0.5, eps: float = 1e-3, tol: float = 1e-10
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEM's projection (Eqs. 12–13, official `project2cone2`): v* of min ½vᵀ(GGᵀ + εI)v + (Gg)ᵀv, v ≥ margin,
    and g̃ = Gᵀv* + g (returned in g's dtype and device, with v* in float64 on the CPU)."""
    GGt, Gg, _ = gem_products(G, g)
    v = gem_dual(GGt, Gg, margin, eps, tol)
    return combine(g, G, v), v


def agem_project(
    g: torch.Tensor, g_ref: torch.Tensor, products: tuple[float, float] | None = None
) -> tuple[torch.Tensor, bool]:
    """A-GEM Eq. 11: g − (gᵀg_ref / g_refᵀg_ref) g_ref when gᵀg_ref < 0 (inner products as `gram`, or the given
    `products` = (gᵀg_ref, g_refᵀg_ref)); and whether it projected. `g` itself is returned when it did not."""
    if g.shape != g_ref.shape or g.ndim != 1:
        raise ValueError(f"need g and g_ref of one shape [P], got {tuple(g.shape)} and {tuple(g_ref.shape)}")
    if products is None:
        Q = gram([g, g_ref])
        products = (float(Q[0, 1]), float(Q[1, 1]))
    alpha = agem_coefficient(*products)
    if alpha is None:
        return g, False
    work = _work(g)
    projected = work.add(_work(g_ref.to(g.device)).to(work.dtype), alpha=alpha)
    return projected.to(g.dtype), True


def agem_coefficient(dot: float, norm2: float) -> float | None:
    """−gᵀg_ref / g_refᵀg_ref from `dot` = gᵀg_ref and `norm2` = g_refᵀg_ref, or None where A-GEM leaves g alone
    (gᵀg_ref ≥ 0, or g_ref = 0)."""
    if norm2 == 0.0 or dot >= 0.0:
        return None
    return -dot / norm2


# ----- flat gradients of a list of parameters --------------------------------------------------------------------
def flat_grad(params: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The parameters' `.grad` as one vector (zeros for a missing grad; a sparse grad densified), written into `out`
    where given (a buffer of the right size, reused from step to step)."""
    parts = []
    for p in params:
        grad = p.grad
        if grad is None:
            grad = torch.zeros_like(p)
        elif grad.is_sparse:
            grad = grad.to_dense()
        parts.append(grad.reshape(-1))
    if not parts:
        return torch.zeros(0)
    return torch.cat(parts, out=out) if out is not None else torch.cat(parts)


def add_to_grads_(params: Sequence[torch.Tensor], flat: torch.Tensor, alpha: float) -> bool:
    """`p.grad += alpha · flat` (flat cut into the parameters' shapes) in place, in one pass, where every grad is a
    dense tensor of its parameter's shape and of `flat`'s dtype (float32 or float64): the same values as
    `write_flat_grad(params, flat_grad(params) + alpha · flat)`, without the flat copy and its write-back. Returns
    False, touching nothing, where a grad is missing, sparse or of another shape or dtype."""
    grads = [p.grad for p in params]
    if flat.dtype not in (torch.float32, torch.float64) or sum(p.numel() for p in params) != flat.numel():
        return False
    if any(g is None or g.is_sparse or g.shape != p.shape or g.dtype != flat.dtype or g.device != flat.device
           for g, p in zip(grads, params, strict=True)):
        return False
    for grad, part, p in zip(grads, flat.split([p.numel() for p in params]), params, strict=True):
        if grad is not None:  # (checked above) the kernel of `Tensor.add`, as the flat computation uses
            grad.add_(part.view_as(p), alpha=alpha)
    return True


def write_flat_grad(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector back into the parameters' `.grad` (in their dtype). A parameter without a grad keeps none
    when its part of `flat` is all zero (an optimizer skips a parameter whose grad is None, not one that is 0); a
    sparse grad is replaced by the dense value."""
    total = sum(p.numel() for p in params)
    if total != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} entries, the parameters {total}")
    offset = 0
    for p in params:
        value = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
        offset += p.numel()
        if p.grad is None:
            if bool(value.any()):
                p.grad = value.clone()
        elif p.grad.is_sparse or p.grad.shape != p.shape:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
