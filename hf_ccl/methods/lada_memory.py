"""LADA's label-specific memory: the module attached to the model that scores classes (`EvaluationScorer`), and the
statistics it is built from (K-means centres, per-class Gaussian mixtures). The method is `hf_ccl.methods.lada`,
whose docstring gives the equations and what of the paper could not be read.

Every tensor lives in the model's shared embedding space (dimension D) on normalised image embeddings v = f_I(x) / |.|
of the frozen image tower. A learned class c holds

- its text feature t_c [D] (trained during its own task, frozen afterwards; the paper's t^k_j),
- its memory units W_c = [w_c(1) .. w_c(λ)] [λ, D], initialised at the K-means centres of its training images
  (the paper's "cluster-derived centres W_j^k"; trained during its own task, frozen afterwards),
- its Gaussian components {π_c(l), p_c(l), Σ_c(l)} (the paper's distribution-preserved statistics: weights, the
  centres as prototypes, diagonal covariances), fixed when its task starts.

A class with fewer than λ training images gets as many units as images; `valid` marks the units in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

#: The attribute the memory is attached to the model under (its keys start with it).
ATTRIBUTE = "lada"


def kmeans(features: torch.Tensor, k: int, iterations: int, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's K-means of `features` [N, D] into min(k, N) clusters, seeded k-means++ initialisation: (centres [k', D],
    assignment [N]). An empty cluster keeps its previous centre (a point of it is never lost)."""
    count = features.shape[0]
    k = min(k, count)
    first = int(torch.randint(count, (1,), generator=generator))
    chosen = [first]
    distance = ((features - features[first]) ** 2).sum(-1)
    for _ in range(1, k):
        weights = distance.clamp_min(0)
        if float(weights.sum()) <= 0:  # every point sits on a centre already: take the next unchosen one
            index = next(i for i in range(count) if i not in chosen)
        else:
            index = int(torch.multinomial(weights, 1, generator=generator))
        chosen.append(index)
        distance = torch.minimum(distance, ((features - features[index]) ** 2).sum(-1))
    centres = features[chosen].clone()
    assignment = torch.zeros(count, dtype=torch.long)
    for _ in range(iterations):
        assignment = torch.cdist(features, centres).argmin(dim=1)
        updated = centres.clone()
        for cluster in range(k):
            members = features[assignment == cluster]
            if members.shape[0]:
                updated[cluster] = members.mean(0)
        if torch.equal(updated, centres):
            break
        centres = updated
    return centres, torch.cdist(features, centres).argmin(dim=1)


def gaussian_components(features: torch.Tensor, k: int, iterations: int, generator: torch.Generator,
                        variance_floor: float) -> dict[str, torch.Tensor]:
    """One class's λ = `k` components from its normalised image features [N, D]: `weights` π(l) = n_l / N, `means`
    p(l) (the K-means centres), `variances` Σ(l) (the per-dimension variance of the cluster's members about its centre,
    at least `variance_floor`; a one-member cluster has the floor) and `valid`, padded to k rows."""
    centres, assignment = kmeans(features, k, iterations, generator)
    used, dim = centres.shape[0], features.shape[1]
    weights, means = torch.zeros(k), torch.zeros(k, dim)
    variances, valid = torch.full((k, dim), float(variance_floor)), torch.zeros(k, dtype=torch.bool)
    for cluster in range(used):
        members = features[assignment == cluster]
        weights[cluster] = members.shape[0] / features.shape[0]
        means[cluster] = centres[cluster]
        if members.shape[0] > 1:
            variances[cluster] = ((members - centres[cluster]) ** 2).mean(0).clamp_min(variance_floor)
        valid[cluster] = members.shape[0] > 0
    return {"weights": weights, "means": means, "variances": variances, "valid": valid}


class LADATask(nn.Module):
    """One task's label-specific parameters (its classes' text features and memory units) and statistics."""

    weights: torch.Tensor
    means: torch.Tensor
    variances: torch.Tensor
    valid: torch.Tensor

    def __init__(self, text: torch.Tensor, memory: torch.Tensor, weights: torch.Tensor, means: torch.Tensor,
                 variances: torch.Tensor, valid: torch.Tensor):
        super().__init__()
        self.text = nn.Parameter(text.clone())  # [C, D]
        self.memory = nn.Parameter(memory.clone())  # [C, λ, D]
        self.register_buffer("weights", weights.clone())  # [C, λ]
        self.register_buffer("means", means.clone())  # [C, λ, D]
        self.register_buffer("variances", variances.clone())  # [C, λ, D]
        self.register_buffer("valid", valid.clone())  # [C, λ] bool

    @classmethod
    def empty(cls, classes: int, units: int, dim: int) -> LADATask:
        """A task of the given sizes, zeros everywhere (filled by `load_state_dict`)."""
        return cls(torch.zeros(classes, dim), torch.zeros(classes, units, dim), torch.zeros(classes, units),
                   torch.zeros(classes, units, dim), torch.ones(classes, units, dim),
                   torch.zeros(classes, units, dtype=torch.bool))


class LADAMemory(nn.Module):
    """The label-specific memory of every learned task, keyed by class name; an `EvaluationScorer`.

    Scores (the method's docstring, "Scores"): s_c(v) = exp(t) cos(v, t_c) + α Σ_l valid_c(l) exp(-β (1 - v·w_c(l)))
    for a learned class, exp(t) cos(v, e_c) for any other (e_c: the evaluator's zero-shot class embedding)."""

    logit_scale: torch.Tensor

    def __init__(self, alpha: float, beta: float, logit_scale: float):
        super().__init__()
        self.alpha, self.beta = float(alpha), float(beta)
        self.tasks = nn.ModuleList()
        self.class_names: list[list[str]] = []
        self._index: dict[tuple[str, ...], torch.Tensor] = {}  # rows of a list of names, on the memory's device
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))

    # ----- the learned classes ----------------------------------------------------------------------------------
    def add_task(self, names: Sequence[str], task: LADATask) -> None:
        if len(names) != task.text.shape[0]:
            raise ValueError(f"{len(names)} class names for {task.text.shape[0]} text features")
        self.tasks.append(task)
        self.class_names.append(list(names))
        self._index.clear()

    def task(self, index: int) -> LADATask:
        """Task `index`'s parameters and statistics."""
        return cast(LADATask, self.tasks[index])

    def learned(self) -> dict[str, tuple[int, int]]:
        """Each learned class name -> (task, row); a name learned again by a later task is that task's."""
        return {name: (k, row) for k, names in enumerate(self.class_names) for row, name in enumerate(names)}

    def seen_names(self) -> list[str]:
        """Every learned class name once, in the order first learned (the columns of the training loss)."""
        return list(dict.fromkeys(name for names in self.class_names for name in names))

    def gather(self, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(text [C, D], memory [C, λ, D], valid [C, λ]) of learned classes `names`, with gradients to the trainable
        ones (the current task's). The rows are picked by an index kept per list of names (no host copy per step)."""
        key = tuple(names)
        index = self._index.get(key)
        if index is None:
            where = self.learned()
            missing = [name for name in names if name not in where]
            if missing:
                raise KeyError(f"LADA has not learned the classes {missing}")
            offsets = [0]
            for names_of_task in self.class_names:
                offsets.append(offsets[-1] + len(names_of_task))
            index = torch.tensor([offsets[k] + row for k, row in (where[name] for name in names)],
                                 dtype=torch.long).to(self.logit_scale.device)
            self._index[key] = index
        tasks = [self.task(k) for k in range(len(self.tasks))]
        text = torch.cat([task.text for task in tasks])[index]
        memory = torch.cat([task.memory for task in tasks])[index]
        valid = torch.cat([task.valid for task in tasks])[index]
        return text, memory, valid

    # ----- the scores -------------------------------------------------------------------------------------------
    def affinities(self, image_embeds: torch.Tensor, memory: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The label-specific features φ(v) [N, C, λ]: exp(-β (1 - v·w_c(l))) of normalised v, 0 for unused units."""
        dots = torch.einsum("nd,cld->ncl", image_embeds, memory.to(image_embeds.dtype))
        return torch.exp(-self.beta * (1 - dots)) * valid.to(dots.dtype)

    def learned_scores(self, image_embeds: torch.Tensor, names: Sequence[str],
                       text_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Scores [N, C] of normalised image embeddings against learned classes `names` (differentiable);
        `text_rows` (columns, features) replaces those columns' text features (the AdaptFormer's, while it trains)."""
        text, memory, valid = self.gather(names)
        if text_rows is not None:
            text = text.index_copy(0, text_rows[0], text_rows[1].to(text.dtype))
        text = F.normalize(text.to(image_embeds.dtype), dim=-1)
        clip = self.logit_scale.to(image_embeds.dtype) * image_embeds @ text.t()
        return clip + self.alpha * self.affinities(image_embeds, memory, valid).sum(-1)

    def class_scores(self, image_embeds: torch.Tensor, class_embeds: torch.Tensor,
                     class_names: Sequence[str]) -> torch.Tensor | None:
        """`EvaluationScorer`: learned classes by `learned_scores`, the others by the scaled cosine to the evaluator's
        class embeddings; None before any task is learned (the evaluator's cosine similarity)."""
        if not self.tasks:
            return None
        with torch.no_grad():
            device = self.logit_scale.device
            images = F.normalize(image_embeds.float().to(device), dim=-1)
            scores = self.logit_scale.float() * images @ F.normalize(class_embeds.float().to(device), dim=-1).t()
            where = self.learned()
            columns = [index for index, name in enumerate(class_names) if name in where]
            if columns:
                learned = self.learned_scores(images, [class_names[index] for index in columns]).float()
                scores[:, torch.tensor(columns, device=device)] = learned
        return scores.to(image_embeds.device)

    def extra_repr(self) -> str:
        return f"tasks={len(self.tasks)}, classes={len(self.seen_names())}, alpha={self.alpha}, beta={self.beta}"


def lada_memory(model: nn.Module) -> LADAMemory | None:
    """The model's LADA memory, or None."""
    memory = getattr(model, ATTRIBUTE, None)
    return memory if isinstance(memory, LADAMemory) else None
