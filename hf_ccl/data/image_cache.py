"""A preprocessing cache: every training image decoded, resized and centre-cropped once, stored as uint8 pixels.

`CLIPCollator` spends most of its time decoding images and running the image processor's resize and crop, every
epoch, on the CPU. `cached_pixels_dataset(dataset, image_processor)` does that once (`Dataset.map` with
`num_proc` workers) and stores the result with `datasets` under a key made of the source dataset's fingerprint and
the processor's resize settings, so a second run (or a later task training on the same data) reuses it. The
`image` column is replaced by `pixels`: `Array3D((height, width, 3), "uint8")`, raw HWC bytes, read back
zero-copy as numpy with no decoding. (An `Image` feature would store encoded PNG/JPEG: PNG decoding costs again
much of what is saved, JPEG is lossy.) At 224 px that is 147 KiB per image on disk.

The collator then only converts the cached pixels to `pixel_values` through a per-channel lookup table computed by
the processor itself (`pixel_lookup`: its rescale and normalisation of each of the 256 byte values), so the values
fed to the model are exactly those of the non-cached path: the cache holds the processor's own uint8 intermediate
after resize and crop, and rescale/normalise act on each pixel alone. Training applies no random augmentation
(the collator's preprocessing is deterministic), which is what makes a cache of resized images exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..validation import ConfigError
from .images import decode_image
from .streaming import is_streaming
from .workers import usable_cores

#: The column the cache stores pixels in (uint8, HWC), replacing `image`.
PIXELS_COLUMN = "pixels"
#: Bumped when what is stored changes, so old caches are not reused.
CACHE_VERSION = 1
#: Processor settings that act after resize and crop (applied by `pixel_lookup` at batch time, not stored).
_AFTER_CROP = frozenset({"do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std"})
#: Rows per map batch, and fewest rows worth one more build process.
_MAP_BATCH = 64
_ROWS_PER_PROCESS = 256


def default_cache_dir() -> Path:
    """Where caches go by default: `hf_ccl-image-cache/` in the `datasets` cache (`HF_DATASETS_CACHE`)."""
    from datasets import config

    return Path(config.HF_DATASETS_CACHE) / "hf_ccl-image-cache"


def output_size(image_processor: Any) -> tuple[int, int]:
    """(height, width) of every image the processor outputs; a processor whose output size depends on the image
    (no centre crop and a resize that keeps the aspect ratio) cannot be cached and raises `ValueError`."""
    if getattr(image_processor, "do_center_crop", False):
        crop = dict(getattr(image_processor, "crop_size", None) or {})
        if crop.get("height") and crop.get("width"):
            return int(crop["height"]), int(crop["width"])
    size = dict(getattr(image_processor, "size", None) or {})
    if getattr(image_processor, "do_resize", False) and size.get("height") and size.get("width"):
        return int(size["height"]), int(size["width"])
    raise ValueError(
        f"image_cache stores images of one fixed size, but {type(image_processor).__name__} (do_center_crop="
        f"{getattr(image_processor, 'do_center_crop', None)}, crop_size={getattr(image_processor, 'crop_size', None)}, "
        f"size={getattr(image_processor, 'size', None)}) outputs images of varying size: turn image_cache off or "
        "use a processor that centre-crops"
    )


def cache_settings(image_processor: Any) -> dict[str, Any]:
    """What the stored pixels depend on: the processor's class and its settings up to the crop (JSON values)."""
    output_size(image_processor)  # refuses what cannot be cached
    if not callable(getattr(image_processor, "to_dict", None)):
        raise ValueError(f"image_cache needs a transformers image processor, got {type(image_processor).__name__}")
    settings = {key: value for key, value in image_processor.to_dict().items() if key not in _AFTER_CROP}
    settings["class"] = type(image_processor).__name__
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def cache_key(dataset: Any, image_processor: Any) -> str:
    """A key naming the cache of `dataset` (its `datasets` fingerprint, rows and columns) under `image_processor`."""
    described = {
        "version": CACHE_VERSION,
        "fingerprint": dataset._fingerprint,
        "rows": len(dataset),
        "columns": list(dataset.column_names),
        "processor": cache_settings(image_processor),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def _preprocess(images: list[Any], image_ids: list[str], image_processor: Any) -> dict[str, list[np.ndarray]]:
    decoded = [decode_image(value, str(image_id)) for value, image_id in zip(images, image_ids, strict=True)]
    arrays = image_processor(images=decoded, do_rescale=False, do_normalize=False, return_tensors=None)
    return {PIXELS_COLUMN: [np.ascontiguousarray(np.moveaxis(a, 0, -1)) for a in arrays["pixel_values"]]}


def cached_pixels_dataset(
    dataset: Any, image_processor: Any, cache_dir: str | Path | None = None, num_proc: int | None = None
) -> Any:
    """`dataset` (canonical rows with an `image` column) with `image` replaced by the processor's resized and
    cropped uint8 pixels (`PIXELS_COLUMN`), read from `cache_dir` (default `default_cache_dir()`) when a cache of
    the same data and settings is there, else built with `num_proc` processes (default: the usable cores, at most
    one per 256 rows) and saved there first. The result is formatted so `pixels` come back as numpy arrays."""
    from datasets import Array3D, Dataset, Features

    if is_streaming(dataset) or not isinstance(dataset, Dataset):
        raise ValueError(f"image_cache needs a map-style datasets.Dataset, got {type(dataset).__name__}")
    if "image" not in dataset.column_names:
        raise ValueError(f"image_cache caches the 'image' column; the dataset has {dataset.column_names}")
    if num_proc is not None and num_proc < 1:
        raise ValueError(f"num_proc must be >= 1 or None, got {num_proc}")
    height, width = output_size(image_processor)
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / cache_key(
        dataset, image_processor)
    if not (folder / "dataset_info.json").is_file():
        procs = num_proc or max(1, min(usable_cores(), len(dataset) // _ROWS_PER_PROCESS))
        features = Features({**{k: v for k, v in dataset.features.items() if k != "image"},
                             PIXELS_COLUMN: Array3D((height, width, 3), "uint8")})
        work = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            built = dataset.map(
                _preprocess, batched=True, batch_size=_MAP_BATCH, input_columns=["image", "image_id"],
                fn_kwargs={"image_processor": image_processor}, remove_columns=["image"], features=features,
                num_proc=procs if procs > 1 else None, cache_file_name=str(work / "map.arrow"),
                new_fingerprint=folder.name, desc=f"Caching images at {height}x{width}",
            )
            built.save_to_disk(str(work / "data"))
            del built
            try:
                os.replace(work / "data", folder)  # atomic: a reader sees no cache or a whole one
            except OSError:
                if not (folder / "dataset_info.json").is_file():  # not another process's cache: a real failure
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    cached = Dataset.load_from_disk(str(folder))
    # (numpy formatting widens integers to int64 unless told the dtype: 8x the bytes per batch)
    cached.set_format("numpy", columns=[PIXELS_COLUMN], output_all_columns=True, dtype=np.uint8)
    return cached


# ----- batch time ----------------------------------------------------------------------------------------------
def pixel_lookup(image_processor: Any) -> torch.Tensor:
    """float32 [3, 256]: what the processor's rescale and normalisation (as configured) make of each byte value in
    each channel, computed by the processor itself on a ramp image, so the lookup equals its arithmetic."""
    ramp = np.tile(np.arange(256, dtype=np.uint8)[None, None, :], (3, 1, 1))  # CHW, 1 x 256
    values = image_processor(images=[ramp], do_resize=False, do_center_crop=False, return_tensors="np",
                             input_data_format="channels_first")["pixel_values"]
    return torch.from_numpy(np.ascontiguousarray(values[0, :, 0, :], dtype=np.float32))


def pixels_to_tensor(pixels: Sequence[Any], lookup: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """`pixel_values` [B, 3, H, W] float32 from cached uint8 HWC pixels (numpy arrays, tensors or nested lists)
    through `lookup` (`pixel_lookup`); pixels of another size than `size` (a cache built for another processor)
    raise `ValueError`."""
    stacked = np.stack([np.asarray(p, dtype=np.uint8) for p in pixels])
    if tuple(stacked.shape[1:]) != (*size, 3):
        raise ValueError(f"cached pixels of shape {tuple(stacked.shape[1:])} do not match the image processor's "
                         f"output {(*size, 3)}: the cache was built for other processor settings")
    channels_first = np.ascontiguousarray(stacked.transpose(0, 3, 1, 2))  # (np.take on contiguous uint8 indices is
    table = lookup.numpy()                                                 # the fastest gather measured: ~u8->f32)
    out = np.empty(channels_first.shape, dtype=np.float32)
    for channel in range(3):
        np.take(table[channel], channels_first[:, channel], out=out[:, channel])
    return torch.from_numpy(out)


# ----- checks before a run -------------------------------------------------------------------------------------
def check_image_cache(stream: Any, image_processor: Any, image_cache: bool | str | None) -> None:
    """`ContinualArguments.image_cache` against the stream and processor, before anything is built: it needs
    image-text tasks with map-style train splits and a processor with one output size."""
    if image_cache in (None, False):
        return
    clip_tasks = [task for task in stream if task.kind_spec.has_images]
    if not clip_tasks:
        raise ConfigError(f"image_cache: stream {stream.name!r} has only pair tasks (trained on cached features); "
                          "there are no images to cache: remove image_cache", "image_cache")
    streaming = [task.name for task in clip_tasks if is_streaming(task.train)]
    if streaming:
        raise ConfigError(f"image_cache: task(s) {streaming} train on a stream (an IterableDataset is read once, in "
                          "order): a cache needs map-style datasets; remove image_cache", "image_cache")
    try:
        cache_settings(image_processor)
    except ValueError as error:
        raise ConfigError(str(error), "image_cache") from error
