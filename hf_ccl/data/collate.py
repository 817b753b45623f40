"""Batching canonical rows for CLIP: decode and preprocess images, pick and tokenize captions, hash for positives."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..paths import check_default_tokenizer
from .image_cache import PIXELS_COLUMN, output_size, pixel_lookup, pixels_to_tensor
from .images import decode_image

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CLIP_MAX_LENGTH = 77
_HUGE_MAX_LENGTH = 100_000  # tokenizers without a limit report ~1e30
#: Optional integer columns passed through as int64 tensors when present in the rows (missing or None -> -1):
#: `buffer_slot` marks replayed rows and their buffer slot (hf_ccl.methods.replay; -1 for new data).
PASSTHROUGH_INT_COLUMNS = ("buffer_slot",)
#: How a parallel caption is paired with the chosen caption (see `CLIPCollator`).
PARALLEL_PAIRINGS = ("auto", "index", "random")


def stable_hash(text: str) -> int:
    """A stable signed 64-bit hash of a string (blake2b, 8 bytes), equal across processes and runs."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def load_tokenizer(name_or_path: str | Path | None = None, **hub_kwargs: Any) -> Any:
    """Any HF tokenizer (a folder, or a Hub id with `hub_kwargs` such as `revision`), loaded as plain transformers
    loads it (`AutoTokenizer`: a checkpoint is tokenized by hf_ccl as by any other client); default: OpenAI CLIP's BPE
    (`paths.default_tokenizer_source`). Its `model_input_names` include `attention_mask` (batches always carry one;
    each family decides whether its text tower reads it).

    One exception: a SigLIP 2 checkpoint written by hf_ccl before its tokenizer_config.json steered transformers
    (`hf_ccl.processors`) is loaded as the class that file names, the one it was trained with."""
    import transformers

    if name_or_path is None:  # the shared folder's CLIP BPE, else the same one from the Hub (a pip install)
        name_or_path = check_default_tokenizer()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(name_or_path), **hub_kwargs)
    trained_class = _hf_ccl_trained_class(Path(name_or_path))
    if trained_class is not None and not isinstance(tokenizer, trained_class):
        tokenizer = trained_class.from_pretrained(str(name_or_path))
    if "attention_mask" not in tokenizer.model_input_names:
        tokenizer.model_input_names = [*tokenizer.model_input_names, "attention_mask"]
    return tokenizer


def _hf_ccl_trained_class(folder: Path) -> type[PreTrainedTokenizerBase] | None:
    """The tokenizer class a local hf_ccl task checkpoint (one with continual_state.json) names without an `auto_map`,
    else None."""
    import transformers

    config = folder / "tokenizer_config.json"
    if not (folder / "continual_state.json").is_file() or not config.is_file():
        return None
    saved = json.loads(config.read_text(encoding="utf-8"))
    cls = getattr(transformers, str(saved.get("tokenizer_class")), None)
    if "auto_map" in saved or not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        return None
    return cls


def load_image_processor(image_size: int, **kwargs: Any) -> Any:
    """A `CLIPImageProcessorPil` (no torchvision needed) resizing the short side to `image_size` and centre-cropping
    to a square; extra `kwargs` (e.g. `image_mean`) go to the constructor."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}, **kwargs
    )


#: How a batch's texts are padded: to its longest text, or to `max_length` (SigLIP pools the last position).
TEXT_PADDINGS = ("longest", "max_length")

def resolve_max_length(tokenizer: Any, max_length: int | None = None) -> int:
    """`max_length`, else the tokenizer's `model_max_length`, clamped to CLIP's 77 when it reports no real limit."""
    if max_length is not None:
        return int(max_length)
    limit = getattr(tokenizer, "model_max_length", None)
    return CLIP_MAX_LENGTH if limit is None or limit > _HUGE_MAX_LENGTH else int(limit)


class CLIPCollator:
    """Turn a list of canonical rows (`image`, `texts`, `image_id`) into CLIP inputs.

    Returns the image processor's outputs (`pixel_values`; SigLIP 2's also `pixel_attention_mask` and
    `spatial_shapes`), `input_ids`, `attention_mask` (padded to the longest caption in the batch, or to `max_length`
    with `padding="max_length"`, truncated to `max_length`) and int64 `text_hash` / `image_hash` (stable hashes of the chosen caption and of `image_id`): two
    examples are positives when either hash matches. In train mode one caption per example is drawn from `texts`
    with the collator's own seeded generator; in eval mode the first caption is used. Integer columns named in
    `PASSTHROUGH_INT_COLUMNS` (e.g. `buffer_slot`) are passed through as int64 tensors when the rows have them.
    With `class_labels` (a function from the drawn captions and the rows' `label`s to class indices,
    `hf_ccl.class_prompts.ClassPrompts.labels`) the batch also gets `class_labels`, the class of each row for the
    cross-entropy loss.

    Rows from an image cache (`hf_ccl.data.image_cache`) carry `pixels` (the processor's resized and cropped uint8
    image) instead of `image`: they are only rescaled and normalised, with the processor's own arithmetic, so the
    `pixel_values` are the same as for the decoded image.

    Caption sampling and DataLoader workers (`num_workers`, the count the DataLoader runs this collator in): in the
    main process the draws are one seeded stream whose position `state_dict` saves, so a run resumed mid-task
    draws exactly what it would have drawn. A worker process gets a copy of the collator and draws from its own
    stream, seeded by `seed`, its worker id and the DataLoader's per-iterator worker seed (so every epoch of
    non-persistent workers draws anew): reproducible for a seeded run with the same worker count, but the workers'
    positions live in the workers and cannot be saved by the main process. A mid-task resume with workers
    therefore restarts the workers' streams (captions are as random, not the same as in an uninterrupted run):
    `load_state_dict` says so in a warning; use `dataloader_num_workers: 0` where a mid-task resume must be exact.

    Parallel captions (a teacher's input, e.g. CLL-CLIP's English x^E beside the task-language x^F): with
    `parallel_text_column="texts_en"` every row must also have that column (a caption list), and the batch gets one
    caption of it per example, tokenized by `parallel_tokenizer` (default: `tokenizer`) with the same padding,
    truncated to the smaller of `max_length` and that tokenizer's own limit, as `parallel_input_ids`,
    `parallel_attention_mask` and `parallel_text_hash`. How it is paired with the caption chosen from `texts`
    (`parallel_pairing`):

    - `"index"`: the caption at the same index (sentence-parallel lists, e.g. MSCOCO_36's translations of each
      English caption, or the English task itself, where `texts_en` is `texts` and x^E = x^F exactly); the two
      lists must then have the same length.
    - `"random"`: one caption drawn from the parallel list with a second seeded generator (the first caption in
      eval mode). This is the approximation for captions that are *not* sentence-parallel but describe the same
      image, e.g. Flickr8k's German (one Multi30k translation of an unknown one of the five English captions) or
      Chinese captions (written independently): the teacher then sees an English caption of the same image, not a
      translation of the student's caption.
    - `"auto"` (default): `"index"` for a row whose two lists have the same length, else `"random"`.

    The parallel draws use their own generator, so the captions drawn from `texts` are the same with or without a
    parallel column, and `state_dict` holds both generators' positions.
    """

    def __init__(
        self,
        image_processor: Any,
        tokenizer: Any,
        *,
        max_length: int | None = None,
        train: bool = True,
        seed: int = 0,
        parallel_text_column: str | None = None,
        parallel_tokenizer: Any = None,
        parallel_pairing: str = "auto",
        num_workers: int = 0,
        padding: str = "longest",
        class_labels: Callable[[Sequence[str], Sequence[int | None]], Sequence[int]] | None = None,
    ) -> None:
        if padding not in TEXT_PADDINGS:
            raise ValueError(f"padding must be one of {list(TEXT_PADDINGS)}, got {padding!r}")
        self.padding = padding
        self.class_labels = class_labels
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        self.num_workers = num_workers
        self.image_processor = image_processor
        self._lookup: torch.Tensor | None = None  # cached pixels -> pixel_values (built at the first cached batch)
        self.tokenizer = tokenizer
        self.max_length = resolve_max_length(tokenizer, max_length)
        self.train = train
        self.seed = seed
        self._rng = random.Random(seed)
        self._worker: tuple[int, int] | None = None  # (worker id, the DataLoader's seed for it) in a worker process
        if parallel_pairing not in PARALLEL_PAIRINGS:
            raise ValueError(f"parallel_pairing must be one of {list(PARALLEL_PAIRINGS)}, got {parallel_pairing!r}")
        if parallel_text_column is None and parallel_tokenizer is not None:
            raise ValueError("parallel_tokenizer needs parallel_text_column (the column it tokenizes)")
        self.parallel_text_column = parallel_text_column
        self.parallel_tokenizer = parallel_tokenizer if parallel_tokenizer is not None else tokenizer
        # The parallel tokenizer's own limit also holds (a teacher with 77 positions under a grown context).
        self.parallel_max_length = min(self.max_length, resolve_max_length(self.parallel_tokenizer))
        self.parallel_pairing = parallel_pairing
        self._parallel_rng = random.Random(f"{seed}/parallel")

    def _generator(self) -> random.Random:
        info = torch.utils.data.get_worker_info()
        worker = None if info is None else (info.id, info.seed)
        if worker != self._worker:
            self._worker = worker
            self._rng = random.Random(self.seed if worker is None else f"{self.seed}/worker{worker[0]}/{worker[1]}")
            self._parallel_rng = random.Random(
                f"{self.seed}/parallel" if worker is None else f"{self.seed}/worker{worker[0]}/{worker[1]}/parallel"
            )
        return self._rng

    def state_dict(self) -> dict[str, Any]:
        """The caption sampler's position, so a run resumed mid-task draws the captions it would have drawn (with
        a parallel column, also the parallel sampler's, under `parallel_rng`)."""
        state = {"seed": self.seed, "worker": self._worker, "num_workers": self.num_workers,
                 "rng": _rng_state(self._rng)}
        if self.parallel_text_column is not None:
            state["parallel_rng"] = _rng_state(self._parallel_rng)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved sampler position (see the class docstring for DataLoader workers)."""
        if self.train and (self.num_workers > 0 or int(state.get("num_workers", 0)) > 0):
            logger.warning(
                "Resuming mid-task with DataLoader workers (dataloader_num_workers=%d now, %d when saved): each "
                "worker draws captions from its own stream, whose position the main process cannot save, so the "
                "resumed task draws different (equally random) captions than an uninterrupted run would. Set "
                "training.dataloader_num_workers: 0 where a mid-task resume must be exact.",
                self.num_workers, int(state.get("num_workers", 0)))
        self.seed = state["seed"]
        worker = state["worker"]  # saved by the main process: None (older versions: an int id, or None)
        self._worker = tuple(worker) if isinstance(worker, (list, tuple)) else None
        _set_rng_state(self._rng, state["rng"])
        if "parallel_rng" in state:
            _set_rng_state(self._parallel_rng, state["parallel_rng"])
        else:  # a state written without a parallel column: the parallel sampler starts from its seed
            self._parallel_rng = random.Random(f"{self.seed}/parallel")

    def choose_texts(self, rows: Sequence[Mapping[str, Any]]) -> list[str]:
        """One caption per row: a seeded random one in train mode, the first in eval mode."""
        return self._choose(rows)[0]

    def _choose(self, rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[int]]:
        """The chosen caption of each row and its index in the row's `texts`."""
        rng = self._generator() if self.train else None
        chosen, indices = [], []
        for row in rows:
            texts = _caption_list(row, "texts")
            index = rng.randrange(len(texts)) if rng is not None else 0
            chosen.append(texts[index])
            indices.append(index)
        return chosen, indices

    def choose_parallel_texts(self, rows: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> list[str]:
        """One caption per row from `parallel_text_column`, paired with the caption chosen at `indices` of `texts`
        by `parallel_pairing` (see the class docstring)."""
        column = self.parallel_text_column
        if column is None:
            raise ValueError("This collator has no parallel_text_column")
        if self.train:
            self._generator()  # (re)seeds the parallel sampler too when running in a new DataLoader worker
        chosen = []
        for row, index in zip(rows, indices, strict=True):
            if column not in row:
                raise ValueError(
                    f"Example {row.get('image_id', '?')} has no {column!r} column (the parallel captions); it has "
                    f"{sorted(row)}"
                )
            parallel = _caption_list(row, column)
            same_length = len(parallel) == len(_caption_list(row, "texts"))
            if self.parallel_pairing == "index" and not same_length:
                raise ValueError(
                    f"Example {row.get('image_id', '?')}: parallel_pairing='index' needs as many {column!r} captions "
                    f"as 'texts' captions, got {len(parallel)} and {len(_caption_list(row, 'texts'))}"
                )
            if self.parallel_pairing == "index" or (self.parallel_pairing == "auto" and same_length):
                chosen.append(parallel[index])
            else:
                chosen.append(parallel[self._parallel_rng.randrange(len(parallel))] if self.train else parallel[0])
        return chosen

    def image_inputs(self, rows: Sequence[Mapping[str, Any]], ids: Sequence[str]) -> dict[str, torch.Tensor]:
        """The image tower's inputs of the rows: what the image processor returns (`pixel_values`; SigLIP 2's also
        its patches' mask and grid) for the decoded images, or (rows of an image cache) `pixel_values` converted from
        their cached uint8 pixels with the same result."""
        cached = [PIXELS_COLUMN in row for row in rows]
        if all(cached):
            if self._lookup is None:
                self._lookup = pixel_lookup(self.image_processor)
            return {"pixel_values": pixels_to_tensor([row[PIXELS_COLUMN] for row in rows], self._lookup,
                                                     output_size(self.image_processor))}
        if any(cached):
            raise ValueError("A batch mixes rows of an image cache ('pixels') with rows holding an 'image': cache "
                             "the whole dataset, or none of it")
        images = [decode_image(row["image"], where) for row, where in zip(rows, ids, strict=True)]
        return dict(self.image_processor(images=images, return_tensors="pt"))

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [str(row.get("image_id", index)) for index, row in enumerate(rows)]
        image_inputs = self.image_inputs(rows, ids)
        texts, indices = self._choose(rows)
        tokens = self.tokenizer(
            texts, padding=self.padding, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        batch = {
            **image_inputs,
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            "text_hash": torch.tensor([stable_hash(text) for text in texts], dtype=torch.int64),
            "image_hash": torch.tensor([stable_hash(image_id) for image_id in ids], dtype=torch.int64),
        }
        if self.class_labels is not None:
            labels = self.class_labels(texts, [row.get("label") for row in rows])
            batch["class_labels"] = torch.tensor(list(labels), dtype=torch.int64)
        if self.parallel_text_column is not None:
            parallel = self.choose_parallel_texts(rows, indices)
            parallel_tokens = self.parallel_tokenizer(
                parallel, padding=self.padding, truncation=True, max_length=self.parallel_max_length, return_tensors="pt"
            )
            batch["parallel_input_ids"] = parallel_tokens["input_ids"]
            batch["parallel_attention_mask"] = parallel_tokens["attention_mask"]
            batch["parallel_text_hash"] = torch.tensor([stable_hash(text) for text in parallel], dtype=torch.int64)
        for column in PASSTHROUGH_INT_COLUMNS:
            if any(column in row for row in rows):
                values = [row.get(column) for row in rows]
                batch[column] = torch.tensor([-1 if v is None else int(v) for v in values], dtype=torch.int64)
        return batch


def _caption_list(row: Mapping[str, Any], column: str) -> list[str]:
    """A row's captions in `column` as a non-empty list (a bare string is one caption)."""
    texts = row[column]
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ValueError(f"Example {row.get('image_id', '?')} has no caption in {column!r}")
    return list(texts)


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rng: random.Random, state: Sequence[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))
