"""Mod-X's spatial-disorder diagnostics: how a CLIP's embedding space moves between two checkpoints.

Ni et al., Mod-X (ICML 2023) §3.2, Fig. 2-3, Tab. 1, Fig. 8, 10, 11, Tab. 5 (../shared/specs/modx.md §3). All angles are
in degrees, arccos of the cosine of L2-normalised embeddings (clamped to [-1, 1]), computed in float64.

- Intra-modal rotation (§3.2.1): the Self-Angle relationship Matrix SAM[a, b] = angle(x_a, x_b) within one modality
  barely changes between checkpoints (|SAM_i - SAM_j| over pairs a < b, bins of 5 degrees), while the Rotation Angle
  Matrix RAM[a] = angle(x_i^a, x_j^a) of the same sample under the two checkpoints is large: the space rotates but
  keeps its topology.
- Inter-modal deviation (§3.2.2, Fig. 3 / 11): the vision and text RAM distributions differ, i.e. the two spaces
  do not rotate together. The paper gives no scalar; the mean and median RAM per modality and their gaps are
  reported as suggested in the spec.
- Inter-modal angle variation (B.2, Fig. 10, Tab. 5, "ImAV"): |angle(V_i^a, L_i^a) - angle(V_j^a, L_j^a)| over the
  samples the reference checkpoint retrieves correctly (image-to-text top-1 on the eval pool; spec §10.15).

Text embeddings use each image's first caption (spec §10.15). Meant for captioned eval sets; on class-template
tasks many texts are identical, which makes the text statistics less informative.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from ..callbacks import StreamControl, StreamState, TaskCallback
from ..distributed import is_main_process
from ..files import write_text_atomic
from .encode import encode_images, encode_texts
from .evaluator import iter_column
from .retrieval import captions_to_text_to_image, hit_rate, image_to_text_rank_counts

if TYPE_CHECKING:
    from ..arguments import ContinualArguments

logger = logging.getLogger(__name__)

#: Inner bin edges in degrees; bins are [0, e0], (e0, e1], ..., (e_last, 180] (Fig. 2c, Tab. 1, Tab. 5).
SAM_EDGES: tuple[float, ...] = (5.0, 10.0, 15.0, 20.0)
RAM_EDGES: tuple[float, ...] = (15.0, 20.0, 25.0, 30.0)
IMAV_EDGES: tuple[float, ...] = (5.0, 10.0, 15.0, 20.0)


# ----- angles and histograms ---------------------------------------------------------------------------------
def _unit(embeds: torch.Tensor) -> torch.Tensor:
    if embeds.dim() != 2:
        raise ValueError(f"expected [N, D] embeddings, got shape {tuple(embeds.shape)}")
    return torch.nn.functional.normalize(embeds.detach().to(torch.float64), dim=-1)


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"the two embedding sets must hold the same samples, got {a.shape[0]} and {b.shape[0]} rows")


def angle_degrees(cosine: torch.Tensor) -> torch.Tensor:
    """arccos(clamp(cosine, -1, 1)) in degrees."""
    return torch.rad2deg(torch.arccos(cosine.clamp(-1.0, 1.0)))


def bin_labels(edges: Sequence[float]) -> list[str]:
    """Names of the bins of `edges`: "[0,5]", "(5,10]", ..., "(20,180]"."""
    bounds = [0.0, *edges, 180.0]
    labels = [f"({_num(lo)},{_num(hi)}]" for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    labels[0] = "[" + labels[0][1:]
    return labels


def _num(value: float) -> str:
    return f"{value:g}"


def bin_counts(angles: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    """Counts per bin (int64, len(edges) + 1): [0, e0], (e0, e1], ..., (e_last, 180]."""
    boundaries = torch.tensor(list(edges), dtype=torch.float64, device=angles.device)
    buckets = torch.bucketize(angles.to(torch.float64).reshape(-1), boundaries, right=False)
    return torch.bincount(buckets, minlength=len(edges) + 1).cpu()


def angle_histogram(angles: torch.Tensor, edges: Sequence[float]) -> list[float]:
    """Percent of `angles` in each bin of `edges` (NaN for every bin when there are no angles)."""
    counts = bin_counts(angles, edges)
    total = int(counts.sum())
    if total == 0:
        return [math.nan] * (len(edges) + 1)
    return (100.0 * counts.to(torch.float64) / total).tolist()


def self_angle_matrix(embeds: torch.Tensor) -> torch.Tensor:
    """SAM[a, b] = angle(x_a, x_b) within one modality ([N, N], §3.2.1, Fig. 2a)."""
    unit = _unit(embeds)
    return angle_degrees(unit @ unit.t())


def sam_change(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|SAM(a) - SAM(b)| over the pairs i < j, flattened ([N(N-1)/2]; Fig. 2 "SAM_{i-j} = |SAM_i - SAM_j|").
    Holds N^2 values: for large N use `sam_change_histogram`, which works blockwise."""
    _check_pair(a, b)
    rows, cols = torch.triu_indices(a.shape[0], a.shape[0], offset=1, device=a.device)
    return (self_angle_matrix(a) - self_angle_matrix(b)).abs()[rows, cols]


def sam_change_histogram(
    a: torch.Tensor, b: torch.Tensor, edges: Sequence[float] = SAM_EDGES, block_size: int = 1024
) -> tuple[list[float], float]:
    """Histogram (percent per bin) and mean of |SAM(a) - SAM(b)| over pairs i < j, computed in row blocks so memory
    stays O(block_size * N)."""
    _check_pair(a, b)
    unit_a, unit_b = _unit(a), _unit(b)
    n = unit_a.shape[0]
    counts = torch.zeros(len(edges) + 1, dtype=torch.int64)
    total = 0.0
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        change = (angle_degrees(unit_a[start:stop] @ unit_a.t()) - angle_degrees(unit_b[start:stop] @ unit_b.t())).abs()
        upper = torch.arange(n, device=change.device)[None, :] > torch.arange(start, stop, device=change.device)[:, None]
        values = change[upper]
        counts += bin_counts(values, edges)
        total += float(values.sum())
    pairs = n * (n - 1) // 2
    if pairs == 0:
        return [math.nan] * (len(edges) + 1), math.nan
    return (100.0 * counts.to(torch.float64) / pairs).tolist(), total / pairs


def rotation_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """RAM[i] = angle(a_i, b_i): how far each sample's embedding turned between two checkpoints ([N], §3.2.1)."""
    _check_pair(a, b)
    return angle_degrees((_unit(a) * _unit(b)).sum(dim=-1))


def inter_modal_angles(images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """angle(V^i, L^i) between each image and its own text under one checkpoint ([N])."""
    return rotation_angles(images, texts)


def inter_modal_angle_variation(
    images_ref: torch.Tensor, texts_ref: torch.Tensor, images: torch.Tensor, texts: torch.Tensor
) -> torch.Tensor:
    """ImAV[i] = |angle(V_ref^i, L_ref^i) - angle(V^i, L^i)| ([N], B.2, Fig. 10, Tab. 5)."""
    return (inter_modal_angles(images_ref, texts_ref) - inter_modal_angles(images, texts)).abs()


def inter_modal_deviation(image_rotation: torch.Tensor, text_rotation: torch.Tensor) -> dict[str, float]:
    """Scalars contrasting the vision and text RAM distributions (§3.2.2; the paper gives none, spec §3.5):
    mean and median per modality and the vision-minus-text gaps."""
    values = {
        "image_rotation_mean": _mean(image_rotation),
        "image_rotation_median": _median(image_rotation),
        "text_rotation_mean": _mean(text_rotation),
        "text_rotation_median": _median(text_rotation),
    }
    values["rotation_mean_gap"] = values["image_rotation_mean"] - values["text_rotation_mean"]
    values["rotation_median_gap"] = values["image_rotation_median"] - values["text_rotation_median"]
    return values


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else math.nan


def _median(values: torch.Tensor) -> float:
    return float(values.median()) if values.numel() else math.nan


def i2t_top1_correct(
    images: torch.Tensor, texts: torch.Tensor, text_to_image: torch.Tensor | None = None
) -> torch.Tensor:
    """Per image, whether its best-scoring text (among all `texts`) is one of its own captions, and no other text
    ties with it ([N] bool). `text_to_image` maps each text to its image (default: text i belongs to image i)."""
    if text_to_image is None:
        text_to_image = torch.arange(texts.shape[0])
    counts = image_to_text_rank_counts(images.float(), texts.float(), text_to_image.to(texts.device))
    return hit_rate(counts, 1) == 1.0


# ----- one model pair ----------------------------------------------------------------------------------------
@dataclass
class SpatialDisorder:
    """The diagnostics of one checkpoint against a reference (histograms in percent per bin)."""

    image_sam_change: list[float]
    text_sam_change: list[float]
    image_rotation: list[float]
    text_rotation: list[float]
    inter_modal_variation: list[float]
    scalars: dict[str, float]
    num_samples: int
    num_correct: int
    sam_edges: list[float] = field(default_factory=lambda: list(SAM_EDGES))
    ram_edges: list[float] = field(default_factory=lambda: list(RAM_EDGES))
    imav_edges: list[float] = field(default_factory=lambda: list(IMAV_EDGES))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpatialDisorder:
        return cls(**data)


def spatial_disorder(
    images_ref: torch.Tensor,
    texts_ref: torch.Tensor,
    images: torch.Tensor,
    texts: torch.Tensor,
    correct: torch.Tensor | None = None,
    block_size: int = 1024,
) -> SpatialDisorder:
    """All diagnostics of checkpoint (images, texts) against the reference (images_ref, texts_ref).

    Row i of every tensor is sample i (its image and its text). `correct` ([N] bool) selects the samples the reference
    retrieves correctly for ImAV; None uses every sample.
    """
    for other in (texts_ref, images, texts):
        _check_pair(images_ref, other)
    image_sam, image_sam_mean = sam_change_histogram(images_ref, images, SAM_EDGES, block_size)
    text_sam, text_sam_mean = sam_change_histogram(texts_ref, texts, SAM_EDGES, block_size)
    image_rotation = rotation_angles(images_ref, images)
    text_rotation = rotation_angles(texts_ref, texts)
    variation = inter_modal_angle_variation(images_ref, texts_ref, images, texts)
    if correct is not None:
        variation = variation[correct.to(variation.device, torch.bool)]
    scalars = {
        "image_sam_change_mean": image_sam_mean,
        "text_sam_change_mean": text_sam_mean,
        **inter_modal_deviation(image_rotation, text_rotation),
        "inter_modal_variation_mean": _mean(variation),
        "inter_modal_variation_median": _median(variation),
    }
    return SpatialDisorder(
        image_sam_change=image_sam,
        text_sam_change=text_sam,
        image_rotation=angle_histogram(image_rotation, RAM_EDGES),
        text_rotation=angle_histogram(text_rotation, RAM_EDGES),
        inter_modal_variation=angle_histogram(variation, IMAV_EDGES),
        scalars=scalars,
        num_samples=int(images_ref.shape[0]),
        num_correct=int(variation.shape[0]),
    )


@dataclass
class DisorderEmbeddings:
    """One checkpoint's embeddings of an eval set: images, each image's first caption, and the I2T top-1 hits
    over all captions of the pool."""

    images: torch.Tensor
    texts: torch.Tensor
    correct: torch.Tensor


def embed_for_disorder(
    model: torch.nn.Module,
    images: Iterable[Any],
    texts_per_image: Sequence[Sequence[str]],
    image_processor: Any,
    tokenizer: Any,
    batch_size: int = 256,
    max_length: int | None = None,
) -> DisorderEmbeddings:
    """Embed an eval set (canonical `image` values and `texts` lists) with one checkpoint, on CPU."""
    texts, text_to_image = captions_to_text_to_image(texts_per_image)
    image_embeds = encode_images(model, image_processor, images, batch_size=batch_size, device="cpu")
    text_embeds = encode_texts(model, tokenizer, texts, batch_size=batch_size, max_length=max_length, device="cpu")
    first = torch.tensor(_first_caption_rows(texts_per_image), dtype=torch.long)
    correct = i2t_top1_correct(image_embeds, text_embeds, text_to_image.cpu())
    return DisorderEmbeddings(images=image_embeds, texts=text_embeds[first], correct=correct)


def _first_caption_rows(texts_per_image: Sequence[Sequence[str]]) -> list[int]:
    rows, offset = [], 0
    for captions in texts_per_image:
        rows.append(offset)
        offset += len(captions)
    return rows


def spatial_disorder_between(
    reference_model: torch.nn.Module,
    model: torch.nn.Module,
    dataset: Any,
    image_processor: Any,
    tokenizer: Any,
    batch_size: int = 256,
    max_length: int | None = None,
    reference: DisorderEmbeddings | None = None,
) -> SpatialDisorder:
    """The diagnostics of `model` against `reference_model` (e.g. the model after task k against the initial one)
    on an eval `datasets.Dataset` with canonical `image` and `texts` columns. Pass `reference` (from
    `embed_for_disorder`) to embed the reference once for a series of checkpoints."""
    texts_per_image = list(iter_column(dataset, "texts", batch_size))
    if reference is None:
        reference = embed_for_disorder(
            reference_model, iter_column(dataset, "image", batch_size), texts_per_image, image_processor, tokenizer,
            batch_size, max_length,
        )
    current = embed_for_disorder(
        model, iter_column(dataset, "image", batch_size), texts_per_image, image_processor, tokenizer, batch_size,
        max_length,
    )
    return spatial_disorder(reference.images, reference.texts, current.images, current.texts, reference.correct)


# ----- plot --------------------------------------------------------------------------------------------------
_PANELS = (
    ("image_sam_change", "vision |SAM change| (deg)", "sam_edges"),
    ("text_sam_change", "text |SAM change| (deg)", "sam_edges"),
    ("image_rotation", "vision rotation RAM (deg)", "ram_edges"),
    ("text_rotation", "text rotation RAM (deg)", "ram_edges"),
    ("inter_modal_variation", "inter-modal angle variation (deg)", "imav_edges"),
)


def plot_spatial_disorder(
    results: Mapping[str, SpatialDisorder], path: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Save grouped bar charts of every histogram, one bar per entry of `results` (e.g. "initial -> task 1"),
    to `path`. Needs matplotlib (imported here only)."""
    from matplotlib.figure import Figure  # lazy: matplotlib is optional

    if not results:
        raise ValueError("nothing to plot: `results` is empty")
    labels = list(results)
    figure = Figure(figsize=(4.2 * len(_PANELS), 3.6), layout="constrained")
    axes_row = figure.subplots(1, len(_PANELS))
    width = 0.8 / len(labels)
    for axes, (attribute, name, edges_attribute) in zip(axes_row, _PANELS, strict=True):
        bins = bin_labels(getattr(results[labels[0]], edges_attribute))
        for k, label in enumerate(labels):
            positions = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(bins))]
            axes.bar(positions, getattr(results[label], attribute), width=width, label=label)
        axes.set_xticks(range(len(bins)), bins, rotation=30, ha="right")
        axes.set_ylabel("% of pairs" if "sam" in attribute else "% of samples")
        axes.set_title(name, fontsize=9)
    axes_row[0].legend(fontsize=7)
    figure.suptitle(title or "spatial disorder (Mod-X §3)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


#: Where checkpoints written before the callbacks' state protocol kept the reference embeddings (`disorder_state`).
REFERENCE_FILE = "spatial_disorder_reference.safetensors"
RESULTS_FILE = "spatial_disorder.json"


class SpatialDisorderCallback(TaskCallback):
    """Mod-X's spatial-disorder diagnostics during a run (`diagnostics.spatial_disorder_task`): the initial model's
    embeddings of that task's eval split are the reference, and after every task the current model is compared
    with it. Written to `spatial_disorder.json` (and `.png`) in every checkpoint and the run folder; the reference
    is its state (`state_dict`, with the results), so a resumed run goes on comparing with the same one."""

    state_key = "spatial_disorder"

    def __init__(self) -> None:
        self.reference: DisorderEmbeddings | None = None
        self.results: dict[str, SpatialDisorder] = {}

    def _embed(self, args: ContinualArguments, learner: Any) -> DisorderEmbeddings:
        dataset = learner.stream[args.diagnostics.spatial_disorder_task].eval
        return embed_for_disorder(
            learner.model, iter_column(dataset, "image"), list(iter_column(dataset, "texts")),
            learner.image_processor, learner.tokenizer, args.evaluation.batch_size, learner.max_length,
        )

    def on_stream_begin(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if args.diagnostics.spatial_disorder_task is None:  # (turned off at a resume: what was restored is dropped)
            self.reference, self.results = None, {}
        elif state.resumed_from is None and is_main_process():
            self.reference = self._embed(args, kwargs["learner"])

    def on_task_evaluated(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if self.reference is None:
            return
        current, reference = self._embed(args, kwargs["learner"]), self.reference
        self.results[f"initial -> {state.task_name}"] = spatial_disorder(
            reference.images, reference.texts, current.images, current.texts, reference.correct
        )

    def on_save(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        """The results for readers (`spatial_disorder.json` and `.png`); a resume reads `state_dict`."""
        if not self.results:
            return
        folder = Path(kwargs["folder"])
        payload = {label: result.to_dict() for label, result in self.results.items()}
        write_text_atomic(folder / RESULTS_FILE, json.dumps(payload, indent=2) + "\n")
        plot = folder / "spatial_disorder.png"
        if plot.is_symlink():  # never written through a link planted in the run folder
            plot.unlink()
        try:
            plot_spatial_disorder(self.results, plot)
        except ImportError:
            logger.info("matplotlib is not installed: spatial_disorder.png not written")

    def state_dict(self) -> dict[str, Any]:
        """The reference embeddings (on the main process; None elsewhere or when off) and the results so far."""
        reference = self.reference
        return {"reference": None if reference is None else {
                    "images": reference.images, "texts": reference.texts, "correct": reference.correct},
                "results": {label: result.to_dict() for label, result in self.results.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only the main process measures: elsewhere the state stays empty."""
        if not is_main_process():
            return
        reference = state["reference"]
        self.reference = None if reference is None else DisorderEmbeddings(
            reference["images"], reference["texts"], reference["correct"])
        self.results = {label: SpatialDisorder.from_dict(value) for label, value in state["results"].items()}


def disorder_state(folder: str | Path) -> dict[str, Any]:
    """`SpatialDisorderCallback`'s state from the files of a checkpoint written before the callbacks' state
    protocol (`callback_state.json`): its reference embeddings and results (empty when it had none)."""
    folder = Path(folder)
    if not (folder / REFERENCE_FILE).exists():
        return {"reference": None, "results": {}}
    try:
        tensors = load_file(str(folder / REFERENCE_FILE))
        saved = json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8")) \
            if (folder / RESULTS_FILE).exists() else {}
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"Cannot read the spatial-disorder files in {folder} (truncated or corrupt?): "
                         f"{error}") from error
    return {"reference": {key: tensors[key] for key in ("images", "texts", "correct")}, "results": saved}
