"""One run per folder: a lock held for the whole run, and no new run over another run's files.

`RunFolderLock` takes an exclusive `fcntl.flock` on `output_dir/.hf_ccl.lock` (released by the kernel when the process
ends, even by `kill -9`: a lock left by a dead run is never in the way). The file records the holder's pid, host and
start time, so a second run fails at once naming the first. Where `flock` is unavailable (a filesystem that refuses
it) the lock falls back to the recorded pid: a lock whose process is gone on this host is stale and taken over.

`claim_run_folder` refuses to start a new run (not a resume) in a folder that holds another run's files, unless told
to overwrite them; it then removes exactly those files and says which.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: pid-based locking only
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

LOCK_FILE = ".hf_ccl.lock"
#: What a run writes in its folder (besides the lock): task checkpoints and their interrupted saves, the Trainer's
#: mid-task checkpoints, and the run-level copies of results, compute and config.
RUN_FILES = ("task-*", "trainer", "results.json", "results.md", "compute.json", "spatial_disorder.json",
             "run_config.yaml")


class RunFolderError(ValueError):
    """The output folder cannot be used as asked (another run holds it, or holds files there)."""


def existing_run_files(folder: Path) -> list[Path]:
    """The files and folders of an hf_ccl run in `folder` (a task checkpoint or a Trainer checkpoint counts)."""
    if not folder.is_dir():
        return []
    found = {path for pattern in RUN_FILES for path in folder.glob(pattern)}
    return sorted(found)


def holds_a_run(folder: Path) -> bool:
    """Whether `folder` holds a run's work: a task checkpoint (complete, or without its manifest) or a mid-task
    Trainer checkpoint. What a run that failed before any checkpoint leaves (run_config.yaml, an empty `trainer/`,
    a `.partial` save) is not a run: a new run may start there."""
    if not folder.is_dir():
        return False
    tasks = [path for path in folder.glob("task-*") if path.is_dir() and path.name[5:].isdigit()]
    return bool(tasks) or any(path.is_dir() for path in folder.glob("trainer/task-*/checkpoint-*"))


def check_run_folder(folder: Path, resume: bool, overwrite: bool) -> None:
    """What `claim_run_folder` and the lock would refuse, checked without writing anything (before a run is
    built): another run holding the folder now, or another run's files without `overwrite`."""
    holder = RunFolderLock(folder).holder()
    if holder is not None:
        raise RunFolderError(_in_use(folder, holder))
    if not resume and not overwrite and holds_a_run(folder):
        raise RunFolderError(_holds_another_run(folder))


def claim_run_folder(folder: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a new run over another run's files; with `overwrite`, remove them first (logged)."""
    if resume:
        return
    files = existing_run_files(folder)
    if not holds_a_run(folder):
        if files:  # what a run that failed before its first checkpoint left: replaced by this run
            logger.info("output_dir %s: removing what a run that made no checkpoint left: %s", folder, _names(files))
            _remove(files)
        return
    if not overwrite:
        raise RunFolderError(_holds_another_run(folder))
    logger.warning("overwrite_output_dir: removing the previous run's files in %s: %s", folder, _names(files))
    _remove(files)


def _names(files: list[Path]) -> str:
    names = ", ".join(path.name + ("/" if path.is_dir() else "") for path in files[:8])
    return names + (", ..." if len(files) > 8 else "")


def _remove(files: list[Path]) -> None:
    for path in files:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _holds_another_run(folder: Path) -> str:
    return (f"output_dir {folder} holds another run ({_names(existing_run_files(folder))}): resume it with "
            "resume_from_checkpoint=true, replace it with overwrite_output_dir=true, or choose another output_dir")


def _in_use(folder: Path, holder: dict[str, Any]) -> str:
    return (f"output_dir {folder} is in use by another run ({_describe(holder)}); wait for it to finish or stop it, "
            f"or choose another output_dir (lock: {folder / LOCK_FILE})")


class RunFolderLock:
    """An exclusive lock on a run folder for as long as the run lasts (`acquire` ... `release`, or `with`)."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK_FILE
        self._handle: Any = None

    def holder(self) -> dict[str, Any] | None:
        """Who holds the lock now when another process does (pid, host, start), else None; takes nothing."""
        if not self.path.is_file() or self._handle is not None:
            return None
        with open(self.path, "a+", encoding="utf-8") as handle:
            if self._flock(handle):
                return None  # (released when the handle closes)
        return _read_holder(self.path)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
        if not self._flock(handle):
            holder = _read_holder(self.path)
            handle.close()
            raise RunFolderError(_in_use(self.path.parent, holder))
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
        handle.flush()
        self._handle = handle

    def _flock(self, handle: Any) -> bool:
        """Take the lock: True when this process holds it now."""
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as error:
                if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    return False
                logger.warning("flock is unavailable on %s (%s): locking by pid", self.path, error)
        holder = _read_holder(self.path)
        return not holder or holder.get("host") != socket.gethostname() or not _alive(holder.get("pid"))

    def release(self, remove_if_alone: bool = False) -> None:
        """Release the lock; `remove_if_alone`: also remove the lock file and its folder (still holding the lock)
        when the folder holds nothing else (a run that failed before writing anything leaves nothing)."""
        if self._handle is None:
            return
        folder = self.path.parent
        if remove_if_alone and [path.name for path in folder.iterdir()] == [LOCK_FILE]:
            self.path.unlink(missing_ok=True)
            self._handle.close()
            self._handle = None
            with contextlib.suppress(OSError):  # another run made its own lock file there meanwhile
                folder.rmdir()
            return
        self._handle.seek(0)
        self._handle.truncate()  # an empty lock file: nobody holds it (also for the pid fallback)
        self._handle.close()  # closing releases the flock
        self._handle = None

    def __enter__(self) -> RunFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
