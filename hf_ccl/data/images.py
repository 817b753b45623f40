"""Image decoding with errors that name where the bad image is."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image


class CorruptImageError(ValueError):
    """An image that cannot be decoded; the message names dataset, split and row."""


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
