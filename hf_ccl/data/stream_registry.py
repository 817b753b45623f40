"""The registry of named streams: `register(name)` adds a builder `fn(root: Path, common: dict, **kwargs) ->
TaskStream` to `NAMED_STREAMS` (`hf_ccl.data.named.build_stream` runs them); `bundled` finds a bundled dataset."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .task import TaskStream

StreamBuilder = Callable[..., TaskStream]
NAMED_STREAMS: dict[str, StreamBuilder] = {}
#: A named stream's check of its own options' values (`check(**stream_args)` raises ValueError), run with the config's
#: checks before anything is built or downloaded (`hf_ccl.run.check_stream`).
STREAM_CHECKS: dict[str, Callable[..., None]] = {}


def register(name: str, check: Callable[..., None] | None = None) -> Callable[[StreamBuilder], StreamBuilder]:
    """Add a builder `fn(root: Path, common: dict, **kwargs) -> TaskStream` to `NAMED_STREAMS` (and `check`, the
    check of its options' values, to `STREAM_CHECKS`)."""

    def decorate(function: StreamBuilder) -> StreamBuilder:
        NAMED_STREAMS[name] = function
        if check is not None:
            STREAM_CHECKS[name] = check
        return function

    return decorate


def bundled(root: Path, folder: str) -> Path:
    """A bundled dataset folder under the data root; a missing one is an error (never a Hub lookup)."""
    path = root / folder
    if not path.is_dir():
        raise FileNotFoundError(
            f"Dataset folder {path} not found. Point data_root (or $HF_CCL_DATA_ROOT) at the folder that holds "
            f"flickr8k/, pacs/, rsscn7/, fashion/ (the project's ../shared/datasets)."
        )
    return path
