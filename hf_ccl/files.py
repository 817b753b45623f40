"""Writing a run's files safely: whole or not at all, and never through a link planted in the run folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` through a new temporary file in the same folder, renamed over `path`: a crash never
    leaves a half-written file, and a symlink at `path` is replaced, never written through (a planted link cannot
    make the run overwrite a file outside its folder). Returns the path."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
