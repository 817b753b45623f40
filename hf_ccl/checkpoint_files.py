"""Checkpoint integrity: a manifest of every file's size and sha256, written last, verified before a checkpoint is used.

A task checkpoint (`task-<k>/`) and every mid-task Trainer checkpoint (`trainer/task-<k>/checkpoint-<n>/`) end with
`checkpoint_manifest.json`. It is written after every other file, so a checkpoint without one was cut short (killed
mid-write, a full disk); a file missing, of another size or with other bytes than the manifest lists is an error
naming it (`CheckpointError`), never a default. The manifest travels with a pushed task revision, so a download is
verified the same way.

Checkpoints written before manifests existed are accepted with a warning that their bytes cannot be
checked; their required files (`LEGACY_REQUIRED`) must still be present.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from . import __version__

logger = logging.getLogger(__name__)

MANIFEST = "checkpoint_manifest.json"
#: Files every task checkpoint had before manifests existed (with a model.safetensors or a sharded index).
LEGACY_REQUIRED = ("config.json", "continual_state.json", "results.json", "method_state.json", "tokenizer_config.json",
                   "preprocessor_config.json")
#: Files that are not part of a checkpoint's content (the Hub adds `.gitattributes`; huggingface_hub's local-dir
#: downloads keep metadata under `.cache/`).
IGNORED = (".gitattributes", ".cache/")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint file is missing, cut short or changed; the message names it."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _content_files(folder: Path) -> list[Path]:
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if path.is_file() and relative != MANIFEST and not relative.startswith(IGNORED):
            files.append(path)
    return files


def write_manifest(folder: str | Path) -> Path:
    """Write `folder/checkpoint_manifest.json`: size and sha256 of every file below `folder`. Call it last."""
    folder = Path(folder)
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": file_digest(path)}
        for path in _content_files(folder)
    }
    manifest = folder / MANIFEST
    partial = manifest.with_suffix(".json.partial")
    partial.write_text(json.dumps({"hf_ccl_version": __version__, "files": files}, indent=1) + "\n", encoding="utf-8")
    partial.replace(manifest)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of `folder`, or None when it has none; an unreadable one is an error naming it."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"Cannot read {path} (truncated or corrupt?): {error}") from error
    return manifest


def verify_checkpoint(folder: str | Path, legacy_required: tuple[str, ...] = LEGACY_REQUIRED) -> None:
    """Check every file `folder`'s manifest lists: present, same size, same sha256. Without a manifest: a warning,
    and the `legacy_required` files must exist. Raises `CheckpointError` naming the first file at fault."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint {folder} does not exist")
    manifest = read_manifest(folder)
    if manifest is None:
        missing = [name for name in legacy_required if not (folder / name).exists()]
        if missing:
            raise CheckpointError(f"Checkpoint {folder} has no {MANIFEST} and lacks {missing}: it is incomplete "
                                  "(cut short while being written, or copied in part)")
        logger.warning("Checkpoint %s has no %s (written by an older hf_ccl, or cut short): its files cannot be "
                       "checked for damage", folder, MANIFEST)
        return
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint (its manifest lists it)")
        size = path.stat().st_size
        if size != expected.get("size"):
            raise CheckpointError(f"{path} has {size} bytes, its checkpoint manifest says {expected.get('size')} "
                                  "(truncated or changed)")
        if file_digest(path) != expected.get("sha256"):
            raise CheckpointError(f"{path} does not match its checksum in {folder / MANIFEST} (damaged or changed)")


def checkpoint_is_complete(folder: Path) -> bool:
    """Whether a mid-task Trainer checkpoint has its manifest and every file verifies (no warning, no error)."""
    if not (folder / MANIFEST).exists():
        return False
    try:
        verify_checkpoint(folder)
    except CheckpointError as error:
        logger.warning("Skipping Trainer checkpoint %s: %s", folder, error)
        return False
    return True
