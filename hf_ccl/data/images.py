"""Image decoding and image paths, with errors that name where the bad image is."""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class CorruptImageError(ValueError):
    """An image that cannot be decoded; the message names dataset, split and row."""


class MissingImageError(ValueError):
    """An image cell with no image, or whose path names no file; the message names the data file and the row."""


@dataclass(frozen=True)
class PathBase:
    """Where the relative image paths of one split resolve (`folder`), and how errors name the split (`origin`).

    `folder` is None when relative paths cannot be resolved; `reason` then says why.
    """

    folder: Path | None
    origin: str
    reason: str = ""


#: Arrow types an image column may hold besides a `datasets.Image` feature: file paths, or encoded image bytes.
IMAGE_VALUE_TYPES = ("string", "large_string", "binary", "large_binary")


def check_image_feature(feature: Any, column: str, where: str) -> None:
    """A `ValueError` naming `where` and `column` unless the column holds images: a `datasets.Image` feature, file
    paths (strings), image bytes, or `{bytes, path}` structs (how `datasets` stores images)."""
    from datasets import Image as ImageFeature
    from datasets import Value

    if feature is None or isinstance(feature, ImageFeature):
        return
    if isinstance(feature, Value) and feature.dtype in IMAGE_VALUE_TYPES:
        return
    if isinstance(feature, dict) and set(feature) <= {"bytes", "path"} and feature:
        return
    shown = feature.dtype if isinstance(feature, Value) else type(feature).__name__
    raise ValueError(f"{where}: image column {column!r} holds {shown} values; it must hold images (a datasets.Image "
                     "column), image file paths (strings) or encoded image bytes: set image_column to the column "
                     "that does")


def decode_image(value: Any, where: str) -> Image.Image:
    """Decode one `image` cell (a PIL image, or the `{"bytes", "path"}` dict of `datasets.Image(decode=False)`).

    `where` names the example (e.g. `"flickr8k/train/row 17"`) and appears in the error if decoding fails.
    """
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict) and value.get("bytes") is not None:
            image = Image.open(io.BytesIO(value["bytes"]))
        elif isinstance(value, dict) and value.get("path"):
            image = Image.open(value["path"])
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        else:
            raise TypeError(f"unsupported image value of type {type(value).__name__}")
        image.load()
        return image.convert("RGB")
    except Exception as error:  # PIL raises many types for bad data
        raise CorruptImageError(f"Image at {where} cannot be decoded: {error}") from error


def resolve_image(value: Any, base: PathBase, where: str) -> Any:
    """One image cell with a path-only cell's path made absolute against `base.folder` (absolute paths are kept).

    A string cell is a path. Cells with bytes (or decoded images) are returned as they are. A cell without an
    image, a URL, a relative path that `base` cannot resolve, or a path to no file raises `MissingImageError`
    naming `where` (the data file and the row).
    """
    if isinstance(value, str):
        value = {"bytes": None, "path": value}
    if not isinstance(value, dict):
        if value is None:
            raise MissingImageError(f"{where}: the image cell is empty")
        return value  # a decoded image
    if value.get("bytes") is not None:
        return value
    path = value.get("path")
    if not path:
        raise MissingImageError(f"{where}: the image cell is empty")
    if _URL.match(path):
        raise MissingImageError(f"{where}: image {path!r} is a URL; images are read from local files only "
                                "(download them and give their paths)")
    resolved = Path(path).expanduser()
    if not resolved.is_absolute():
        if base.folder is None:
            raise MissingImageError(f"{where}: image path {path!r} is relative, but {base.reason}; give absolute "
                                    "paths")
        resolved = Path(os.path.normpath(base.folder / resolved))
    if not resolved.is_file():
        relative = "" if Path(path).expanduser().is_absolute() else f" (relative paths resolve against {base.folder})"
        raise MissingImageError(f"{where}: image file {path!r} not found at {resolved}{relative}")
    return {"bytes": None, "path": str(resolved)}
