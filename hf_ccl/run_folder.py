"""One run per folder: a lock held for the whole run, and no new run over another run's files.

`RunFolderLock` takes an exclusive `fcntl.flock` on `output_dir/.hf_ccl.lock` (released by the kernel when the process
ends, even by `kill -9`: a lock left by a dead run is never in the way). The file records the holder's pid, host and
start time, so a second run fails at once naming the first. Where `flock` is unavailable (a filesystem that refuses
it) the lock falls back to the recorded pid: a lock whose process is gone on this host is stale and taken over.

`claim_run_folder` refuses to start a new run (not a resume) in a folder that holds another run's files, unless told
to overwrite them; it then removes exactly those files and says which.
"""

from __future__ import annotations

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
    """Whether `folder` holds a run's results: a task checkpoint (complete or not) or a Trainer checkpoint."""
    return any(path.name.startswith("task-") or path.name == "trainer" for path in existing_run_files(folder))


def claim_run_folder(folder: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a new run over another run's files; with `overwrite`, remove them first (logged)."""
    if resume or not holds_a_run(folder):
        return
    files = existing_run_files(folder)
    names = ", ".join(path.name + ("/" if path.is_dir() else "") for path in files[:8])
    if not overwrite:
        raise RunFolderError(
            f"output_dir {folder} holds another run ({names}{', ...' if len(files) > 8 else ''}): resume it with "
            "resume_from_checkpoint=true, replace it with overwrite_output_dir=true, or choose another output_dir"
        )
    logger.warning("overwrite_output_dir: removing the previous run's files in %s: %s", folder, names)
    for path in files:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


class RunFolderLock:
    """An exclusive lock on a run folder for as long as the run lasts (`acquire` ... `release`, or `with`)."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK_FILE
        self._handle: Any = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
        if not self._flock(handle):
            holder = _read_holder(self.path)
            handle.close()
            raise RunFolderError(
                f"output_dir {self.path.parent} is in use by another run ({_describe(holder)}); wait for it to "
                f"finish or stop it, or choose another output_dir (lock: {self.path})"
            )
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

    def release(self) -> None:
        if self._handle is None:
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
