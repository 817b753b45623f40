"""Checkpoint integrity: a manifest of every file's size and sha256, written last, verified before a checkpoint is used.

A task checkpoint (`task-<k>/`) and every mid-task Trainer checkpoint (`trainer/task-<k>/checkpoint-<n>/`) end with
`checkpoint_manifest.json`. It is written after every other file, so a checkpoint without one was cut short (killed
mid-write, a full disk, copied in part) and is never used: the run resumes from the task before it. A file missing,
of another size or with other bytes than the manifest lists is an error naming it (`CheckpointError`), never a
default; the documents written for people (`DOCUMENTS`: the model card, results.md) are never read back, so an
edited one is a warning, not an error. Files in the folder that the manifest does not list were not written by
the checkpoint: they are named in a warning and never read (`manifest_view`). The manifest travels with a pushed
task revision, so a download is verified the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .version import __version__

logger = logging.getLogger(__name__)

MANIFEST = "checkpoint_manifest.json"
#: Files written for people and never read back by a resume or a push (the model card, the results table, plots):
#: one changed by hand is reported, not refused.
DOCUMENTS = ("README.md", "results.md", "results_heatmap.png", "spatial_disorder.png")
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


def verify_checkpoint(folder: str | Path) -> list[str]:
    """Check every file `folder`'s manifest lists: present, same size, same sha256 (a changed document, `DOCUMENTS`,
    is a warning). Raises `CheckpointError` naming the first file at fault, or the missing manifest (a checkpoint
    cut short). Returns the files the folder holds that the manifest does not list (never read; see
    `manifest_view`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint {folder} does not exist")
    manifest = read_manifest(folder)
    if manifest is None:
        raise CheckpointError(f"Checkpoint {folder} has no {MANIFEST}: it is incomplete (cut short while being "
                              "written, or copied in part)")
    listed = manifest["files"]
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint (its manifest lists it)")
        size = path.stat().st_size
        changed = size != expected.get("size") or file_digest(path) != expected.get("sha256")
        if changed and name in DOCUMENTS:
            logger.warning("%s was changed after the checkpoint was written (it is not read back; the next task's "
                           "checkpoint writes its own)", path)
        elif size != expected.get("size"):
            raise CheckpointError(f"{path} has {size} bytes, its checkpoint manifest says {expected.get('size')} "
                                  "(truncated or changed)")
        elif changed:
            raise CheckpointError(f"{path} does not match its checksum in {folder / MANIFEST} (damaged or changed)")
    extra = [path.relative_to(folder).as_posix() for path in _content_files(folder)]
    extra = [name for name in extra if name not in listed]
    if extra:
        logger.warning("%s holds files its manifest does not list, not written with the checkpoint: %s (ignored)",
                       folder, ", ".join(extra))
    return extra


@contextmanager
def manifest_view(folder: str | Path, extra: list[str]) -> Iterator[Path]:
    """`folder` itself when it holds no `extra` files, else a temporary folder of links to the files its manifest
    lists, so that loaders that scan a folder (tokenizers, processors, sharded weights) read only the checkpoint."""
    folder = Path(folder)
    if not extra:
        yield folder
        return
    view = Path(tempfile.mkdtemp(prefix="hf_ccl-checkpoint-"))
    try:
        for name in read_manifest(folder)["files"]:  # type: ignore[index]
            target = view / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                target.symlink_to((folder / name).resolve())
            except OSError:  # no symlinks here: a copy
                shutil.copy2(folder / name, target)
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def is_complete_checkpoint(folder: Path) -> bool:
    """Whether `folder` has its manifest (written last: without it, the checkpoint was cut short)."""
    return (folder / MANIFEST).is_file()


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
