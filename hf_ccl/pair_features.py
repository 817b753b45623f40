"""Frozen modality encoders and the cached features of pair tasks (CMCL's setting, spec cmcl.md §2.1): what turns
a modality's raw values into the features z*_m its learner head (`hf_ccl.heads`) reads.

CMCL keeps the pretrained "binding" encoders frozen and trains only the heads, so the paper pre-extracts and caches
the features; here that is a data transform, `encode_pair_stream`: each pair task's train and eval splits become
datasets of two float columns (`features_a`, `features_b`), encoded once per run, before any task trains.

An encoder is anything with a `dim` and an `encode(values) -> Tensor[n, dim]`: a CLIP tower (`CLIPImageEncoder`,
`CLIPTextEncoder`; several text modalities may share one), a precomputed feature column (`PrecomputedEncoder`),
or any callable, e.g. an audio or depth model (`CallableEncoder`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset

from .data.task import ModelPart, Task, TaskStream
from .evaluation.encode import encode_images, encode_texts

if TYPE_CHECKING:
    from .modeling import ContinualDualEncoder

#: The columns of an encoded pair task's splits: row i of both is pair i.
FEATURE_COLUMNS = ("features_a", "features_b")


@runtime_checkable
class ModalityEncoder(Protocol):
    """A frozen encoder: `encode(values)` → float32 [len(values), dim] on the CPU, no gradients."""

    dim: int

    def encode(self, values: Sequence[Any]) -> torch.Tensor: ...


def _finish(features: torch.Tensor, dim: int, normalize: bool, what: str) -> torch.Tensor:
    features = features.detach().float().cpu()
    if features.ndim != 2 or features.shape[1] != dim:
        raise ValueError(f"{what} returned shape {tuple(features.shape)}, expected [n, {dim}]")
    if not torch.isfinite(features).all():
        raise ValueError(f"{what} returned NaN or infinite features")
    return F.normalize(features, dim=-1) if normalize else features


class CLIPImageEncoder:
    """CLIP's vision tower and `visual_projection`, frozen: z* = normalize(P_v pool(x)) (spec §2.6), the input
    `fold_into_clip` assumes."""

    def __init__(self, clip: ContinualDualEncoder, image_processor: Any, batch_size: int = 256, normalize: bool = True):
        self.clip, self.image_processor = clip, image_processor
        self.batch_size, self.normalize = batch_size, normalize
        self.dim = int(clip.embed_dim)

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        features = encode_images(self.clip, self.image_processor, values, batch_size=self.batch_size)
        return _finish(features, self.dim, self.normalize, "CLIPImageEncoder")


class CLIPTextEncoder:
    """CLIP's text tower and `text_projection`, frozen: z* = normalize(P_t pool(tokens)). A cell holding a list of
    captions is read as its first caption."""

    def __init__(
        self,
        clip: ContinualDualEncoder,
        tokenizer: Any,
        batch_size: int = 512,
        max_length: int | None = None,
        normalize: bool = True,
    ):
        self.clip, self.tokenizer = clip, tokenizer
        self.batch_size, self.max_length, self.normalize = batch_size, max_length, normalize
        self.dim = int(clip.embed_dim)

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        texts = []
        for i, value in enumerate(values):
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if not isinstance(value, str):
                raise ValueError(f"CLIPTextEncoder: row {i} holds {type(value).__name__}, expected a string")
            texts.append(value)
        features = encode_texts(
            self.clip, self.tokenizer, texts, batch_size=self.batch_size, max_length=self.max_length
        )
        return _finish(features, self.dim, self.normalize, "CLIPTextEncoder")


class PrecomputedEncoder:
    """Values are already feature vectors (e.g. a column of audio embeddings computed offline)."""

    def __init__(self, dim: int, normalize: bool = False):
        self.dim, self.normalize = dim, normalize

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        features = torch.as_tensor(np.asarray(list(values), dtype=np.float32))
        return _finish(features.reshape(len(features), -1), self.dim, self.normalize, "PrecomputedEncoder")


class CallableEncoder:
    """Any frozen model as a function of a list of raw values, e.g. an audio or depth encoder; it runs under
    `torch.no_grad()` in batches of `batch_size`."""

    def __init__(
        self,
        function: Callable[[list[Any]], torch.Tensor],
        dim: int,
        batch_size: int = 256,
        normalize: bool = True,
    ):
        self.function, self.dim, self.batch_size, self.normalize = function, dim, batch_size, normalize

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        values = list(values)
        with torch.no_grad():
            chunks = [
                torch.as_tensor(self.function(values[i : i + self.batch_size]))
                for i in range(0, len(values), self.batch_size)
            ]
        features = torch.cat(chunks) if chunks else torch.empty(0, self.dim)
        return _finish(features, self.dim, self.normalize, "CallableEncoder")


def pair_encoders(
    clip: ContinualDualEncoder,
    image_processor: Any,
    tokenizer: Any,
    modalities: Sequence[str],
    *,
    image_modalities: Sequence[str] = ("image",),
    precomputed_modalities: Sequence[str] = (),
    given: Mapping[str, ModalityEncoder] | None = None,
    max_length: int | None = None,
) -> dict[str, ModalityEncoder]:
    """An encoder for each of `modalities`: a `given` one, else a `PrecomputedEncoder` (unnormalised) for the
    `precomputed_modalities`, else CLIP's frozen vision tower for the `image_modalities` and its text tower for the
    rest (one shared encoder per tower; each modality still gets its own head)."""
    given = dict(given or {})
    dim = int(clip.embed_dim)
    image, text = CLIPImageEncoder(clip, image_processor), CLIPTextEncoder(clip, tokenizer, max_length=max_length)
    encoders: dict[str, ModalityEncoder] = {}
    for modality in modalities:
        if modality in given:
            encoders[modality] = given[modality]
        elif modality in precomputed_modalities:
            encoders[modality] = PrecomputedEncoder(dim)
        else:
            encoders[modality] = image if modality in image_modalities else text
    for modality, encoder in encoders.items():
        if not isinstance(encoder, ModalityEncoder):
            raise TypeError(f"the encoder of modality {modality!r} has no `dim` and `encode(values)`")
        if int(encoder.dim) != dim:
            raise ValueError(f"the encoder of modality {modality!r} gives {encoder.dim}-d features; the learner heads "
                             f"on this CLIP are {dim}-d (its projection_dim)")
    return encoders


def is_encoded(task: Task) -> bool:
    return task.columns == FEATURE_COLUMNS


def encode_pair_task(task: Task, encoders: Mapping[str, ModalityEncoder]) -> Task:
    """`task` with both splits replaced by their frozen features (`FEATURE_COLUMNS`, torch format)."""
    if task.kind_spec.trains is not ModelPart.LEARNER_HEADS or is_encoded(task):
        return task
    assert task.modalities is not None and task.columns is not None  # a pair task names both
    splits = {}
    for split_name in ("train", "eval"):
        split = getattr(task, split_name)
        encoded = {}
        for column_out, modality, column in zip(FEATURE_COLUMNS, task.modalities, task.columns, strict=True):
            try:
                features = encoders[modality].encode(split[column])
            except ValueError as error:
                raise ValueError(f"task {task.name!r} {split_name}/{modality}: {error}") from error
            if features.shape[0] != len(split):
                raise ValueError(f"task {task.name!r} {split_name}/{modality}: the encoder returned "
                                 f"{features.shape[0]} rows for {len(split)}")
            encoded[column_out] = features.numpy()
        splits[split_name] = Dataset.from_dict(encoded).with_format("torch")
    return replace(task, train=splits["train"], eval=splits["eval"], columns=FEATURE_COLUMNS)


def encode_pair_stream(stream: TaskStream, encoders: Mapping[str, ModalityEncoder]) -> TaskStream:
    """The stream with every pair task encoded (`encode_pair_task`); other tasks are kept as they are."""
    missing = [m for m in stream.modalities if m not in encoders]
    if missing:
        raise ValueError(f"no encoder for modality(ies) {missing}; encoders given for {sorted(encoders)}")
    return replace(stream, tasks=[encode_pair_task(task, encoders) for task in stream])


class PairFeatureCollator:
    """Stacks a pair task's feature rows into a batch for `ContinualDualEncoder.forward`: `features_a`,
    `features_b` [n, d] and the task's two modality names."""

    def __init__(self, modalities: tuple[str, str]):
        self.modalities = modalities

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {
            column: torch.stack([torch.as_tensor(row[column], dtype=torch.float32) for row in rows])
            for column in FEATURE_COLUMNS
        }
        batch["modality_a"], batch["modality_b"] = self.modalities
        return batch

    def state_dict(self) -> dict[str, Any]:
        """No sampler state (a pair row is one fixed pair); for the collator interface of `CLIPCollator`."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see `state_dict`)."""
