"""Per-task revisions on the Hugging Face Hub: push each task's checkpoint, survive a flaky Hub, find the last one.

One Hub repository per run. After task k the checkpoint folder `task-<k>/` (model, processor, method state, results
so far, model card) is committed to `main` (replacing the previous task's files) and a branch `task-<k>` is created
at that commit, so `CLIPModel.from_pretrained(repo, revision="task-<k>")` gives the model after task k and `main`
follows the latest task. A push that failed is retried before the next one and at the end of the run; an older task
pushed late goes to its own branch only (``main`` keeps the newest task).

Faults: every request has a bounded timeout (`bounded_hub_timeouts`; the default client has none and can hang
forever); transient failures (connection errors, timeouts, 429 and 5xx answers) are retried with exponential
backoff; a push that still fails does not stop training: it is kept pending, retried later, and reported by
`HubPusher.finish()`. A push whose replies were lost (the commit or the branch was made, the answer never came) is
checked against the Hub before it counts as failed: the revision holds the checkpoint when its manifest equals the
local one. Pushes run on one background thread, in task order, so training goes on while they upload.
Only the main process pushes. No token is ever written anywhere: the client reads it from `HF_TOKEN` or the login.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import _http as hub_http

from .callbacks import StreamControl, StreamState, TaskCallback
from .checkpoint_files import MANIFEST, read_manifest, verify_checkpoint
from .distributed import is_main_process

if TYPE_CHECKING:
    from .arguments import ContinualArguments

logger = logging.getLogger(__name__)

TASK_BRANCH = "task-{index}"
_TASK_BRANCH_RE = re.compile(r"^task-(\d+)$")
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


# ----- bounded timeouts ----------------------------------------------------------------------------------------
def bounded_hub_timeouts(seconds: float = 60.0) -> None:
    """Give every huggingface_hub request a timeout of `seconds` (connect, read, write and pool).

    huggingface_hub's default client waits forever on a server that accepts a connection and never answers; this
    keeps its event hooks and redirects and only bounds the waits. Idempotent; applies to the whole process.
    """
    if seconds <= 0:
        raise ValueError(f"Hub timeout must be > 0 seconds, got {seconds}")

    def factory() -> httpx2.Client:
        client = hub_http.default_client_factory()
        client.timeout = httpx2.Timeout(seconds)
        return client

    hub_http.set_client_factory(factory)


def is_transient(error: BaseException) -> bool:
    """True for failures worth retrying: network errors, timeouts, 408/425/429 and 5xx answers."""
    if isinstance(error, (RepositoryNotFoundError, RevisionNotFoundError)):
        return False
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        return status is None or status in RETRYABLE_STATUS or status >= 500
    return isinstance(error, (httpx2.TransportError, httpx2.TimeoutException, ConnectionError, TimeoutError, OSError))


def with_retries(call: Any, *, retries: int, backoff: float, what: str) -> Any:
    """`call()` retried up to `retries` times on transient errors, sleeping backoff * 2**attempt in between."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as error:  # noqa: BLE001 (classified just below)
            if attempt == retries or not is_transient(error):
                raise
            delay = backoff * 2**attempt
            logger.warning("%s failed (%s: %s); retry %d/%d in %.1f s", what, type(error).__name__, error,
                           attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


# ----- pushing -------------------------------------------------------------------------------------------------
@dataclass
class PushRecord:
    """One task's push: when it landed (or why not), how long it took, how many attempts it needed."""

    task_index: int
    folder: str
    attempts: int = 0
    seconds: float = 0.0
    commit: str | None = None
    error: str | None = None

    @property
    def pushed(self) -> bool:
        return self.commit is not None


@dataclass
class PushReport:
    """What `HubPusher.finish()` returns: every task's push record, in task order."""

    repo_id: str
    records: list[PushRecord] = field(default_factory=list)

    @property
    def failed(self) -> list[PushRecord]:
        return [record for record in self.records if not record.pushed]

    def summary(self) -> str:
        pushed = [r for r in self.records if r.pushed]
        lines = [f"Hub pushes to {self.repo_id}: {len(pushed)}/{len(self.records)} task revisions pushed"]
        for record in self.records:
            state = f"commit {record.commit[:10]}" if record.commit is not None else f"FAILED ({record.error})"
            lines.append(f"  task-{record.task_index}: {state}, {record.attempts} attempt(s), {record.seconds:.1f} s")
        return "\n".join(lines)


class PushFailedError(OSError):
    """Some task revisions could not be pushed (after retries); training and local checkpoints are complete."""

    def __init__(self, report: PushReport, run_dir: str | Path):
        missing = ", ".join(f"task-{record.task_index}" for record in report.failed)
        super().__init__(
            f"{len(report.failed)} of {len(report.records)} task revisions were not pushed to {report.repo_id} "
            f"({missing}); the local checkpoints in {run_dir} are complete. Push them with: "
            f"hf-ccl push {run_dir} --repo {report.repo_id}. First error: {_shorten(report.failed[0].error)}"
        )
        self.report = report


def _shorten(text: str | None, limit: int = 200) -> str:
    text = " ".join((text or "unknown").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def push_run(run_dir: str | Path, repo_id: str, **options: Any) -> PushReport:
    """Push every task checkpoint `run_dir/task-<k>/` to `repo_id` (branch `task-<k>`, the newest also to main), as
    the run would have; `options` are `HubPusher`'s (timeout, retries, backoff, private)."""
    folders = sorted((int(p.name[5:]), p) for p in Path(run_dir).glob("task-*") if p.name[5:].isdigit())
    if not folders:
        raise ValueError(f"{run_dir} has no task checkpoints (task-<k>/ folders) to push")
    for _, folder in folders:
        verify_checkpoint(folder)  # never push a damaged checkpoint; all checked before anything is sent
    pusher = HubPusher(repo_id, background=False, **options)
    for index, folder in folders:
        pusher.push(folder, index)
    return pusher.finish()


class HubPusher:
    """Pushes task checkpoints to `repo_id` in the background, in task order, retrying what failed.

    `push(folder, k)` returns at once; `finish()` waits for every push, retries the failed ones one last time and
    returns a `PushReport`. A failed push never raises into training.
    """

    def __init__(
        self,
        repo_id: str,
        *,
        private: bool = False,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        api: HfApi | None = None,
        background: bool = True,
    ):
        bounded_hub_timeouts(timeout)
        self.repo_id = repo_id
        self.private = private
        self.retries = retries
        self.backoff = backoff
        self.api = api or HfApi()
        self._repo_ready = False
        self._newest_on_main = -1
        self._records: dict[int, PushRecord] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_ccl-push") if background else None
        self._futures: list[Future] = []

    # ----- public -----------------------------------------------------------------------------------------
    def push(self, folder: str | Path, task_index: int) -> None:
        """Queue task `task_index`'s checkpoint folder for pushing (pending failures are retried first)."""
        record = PushRecord(task_index=task_index, folder=str(folder))
        with self._lock:
            self._records[task_index] = record
        if self._executor is None:
            self._push_pending_then(record)
        else:
            self._futures.append(self._executor.submit(self._push_pending_then, record))

    def finish(self) -> PushReport:
        """Wait for queued pushes, retry every failed one once more, and report."""
        for future in self._futures:
            future.result()
        self._futures.clear()
        for record in self._pending():
            self._push_one(record)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return PushReport(self.repo_id, [self._records[k] for k in sorted(self._records)])

    # ----- internals --------------------------------------------------------------------------------------
    def _pending(self) -> list[PushRecord]:
        with self._lock:
            return [self._records[k] for k in sorted(self._records) if not self._records[k].pushed]

    def _push_pending_then(self, record: PushRecord) -> None:
        for pending in self._pending():
            if pending is not record:
                self._push_one(pending)
        self._push_one(record)

    def _retrying(self, call: Any, what: str, record: PushRecord) -> Any:
        def counted() -> Any:
            record.attempts += 1
            return call()

        return with_retries(counted, retries=self.retries, backoff=self.backoff, what=what)

    def _push_one(self, record: PushRecord) -> None:
        started = time.perf_counter()
        branch = TASK_BRANCH.format(index=record.task_index)
        try:
            if not self._repo_ready:
                self._retrying(
                    lambda: self.api.create_repo(self.repo_id, private=self.private, exist_ok=True),
                    f"create_repo {self.repo_id}", record,
                )
                self._repo_ready = True
            message = f"hf_ccl: checkpoint after task {record.task_index}"
            if record.task_index > self._newest_on_main:
                commit = self._retrying(lambda: self._upload(record.folder, "main", message), "upload to main", record)
                self._retrying(lambda: self._point_branch(branch, commit), f"create branch {branch}", record)
                self._newest_on_main = record.task_index
            else:  # an older task pushed late: its own branch only, main keeps the newest task
                self._retrying(
                    lambda: self.api.create_branch(self.repo_id, branch=branch, exist_ok=True),
                    f"create branch {branch}", record,
                )
                commit = self._retrying(lambda: self._upload(record.folder, branch, message), f"upload to {branch}",
                                        record)
            record.commit, record.error = commit, None
        except Exception as error:  # noqa: BLE001 (a failed push must never stop training)
            confirmed = self._on_hub(record)
            if confirmed is not None:  # the replies were lost, the writes were made
                record.commit, record.error = confirmed, None
                logger.info("Push of task %d to %s: no answer to %s, but the Hub holds the checkpoint",
                            record.task_index, self.repo_id, type(error).__name__)
            else:
                record.error = f"{type(error).__name__}: {error}"
                logger.warning("Push of task %d to %s failed; it will be retried later: %s", record.task_index,
                               self.repo_id, record.error)
        finally:
            record.seconds += time.perf_counter() - started

    def _on_hub(self, record: PushRecord) -> str | None:
        """The commit of branch `task-<k>` when it holds `record`'s checkpoint (the same manifest as the local
        folder) and, for the newest task, `main` does too; None otherwise (or when the Hub cannot be read)."""
        branch = TASK_BRANCH.format(index=record.task_index)
        local = Path(record.folder) / MANIFEST
        revisions = [branch] + (["main"] if record.task_index > self._newest_on_main else [])
        commit = None
        try:
            for revision in revisions:
                info = self.api.model_info(self.repo_id, revision=revision)
                remote = self.api.hf_hub_download(self.repo_id, MANIFEST, revision=info.sha)
                if Path(remote).read_bytes() != local.read_bytes():
                    return None
                commit = commit or info.sha
        except Exception:  # noqa: BLE001 (not there, or the Hub cannot be read: not confirmed)
            return None
        self._repo_ready = True
        if "main" in revisions:
            self._newest_on_main = record.task_index
        return commit

    def _upload(self, folder: str, revision: str, message: str) -> str:
        """Commit `folder` as the whole content of `revision` (files not in it are deleted); the commit id."""
        manifest = read_manifest(Path(folder))
        listed = None if manifest is None else [MANIFEST, *manifest["files"]]  # never files placed there later
        info = self.api.upload_folder(
            repo_id=self.repo_id, folder_path=folder, revision=revision, commit_message=message,
            delete_patterns="*", ignore_patterns=["*.partial/*"], allow_patterns=listed,
        )
        return info.oid

    def _point_branch(self, branch: str, commit: str) -> None:
        """Create `branch` at `commit`, moving it there if it already exists (a task re-pushed after resume)."""
        try:
            self.api.create_branch(self.repo_id, branch=branch, revision=commit)
        except HfHubHTTPError as error:
            if error.response is None or error.response.status_code != 409:
                raise
            self.api.delete_branch(self.repo_id, branch=branch)
            self.api.create_branch(self.repo_id, branch=branch, revision=commit)


def ensure_branch(repo_id: str, branch: str, *, private: bool = False, retries: int = 3, backoff: float = 1.0) -> None:
    """Create `repo_id` and its `branch` when missing (the Trainer pushes to `hub_revision` but creates neither)."""
    api = HfApi()
    with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True), retries=retries, backoff=backoff,
                 what=f"create_repo {repo_id}")
    with_retries(lambda: api.create_branch(repo_id, branch=branch, exist_ok=True), retries=retries, backoff=backoff,
                 what=f"create branch {branch}")


# ----- finding and fetching task revisions ------------------------------------------------------------------------
def task_branches(repo_id: str, api: HfApi | None = None) -> dict[int, str]:
    """{task index: branch name} of the `task-<k>` branches of `repo_id` (empty when the repo does not exist)."""
    api = api or HfApi()
    try:
        refs = api.list_repo_refs(repo_id)
    except RepositoryNotFoundError:
        return {}
    found = {}
    for branch in refs.branches:
        match = _TASK_BRANCH_RE.match(branch.name)
        if match:
            found[int(match.group(1))] = branch.name
    return found


def download_task_checkpoint(repo_id: str, task_index: int, local_dir: str | Path) -> Path:
    """Download revision `task-<task_index>` of `repo_id` into `local_dir` and verify it (`CheckpointError` naming
    a damaged or missing file)."""
    path = Path(snapshot_download(repo_id, revision=TASK_BRANCH.format(index=task_index), local_dir=str(local_dir)))
    verify_checkpoint(path)  # every file against the manifest pushed with it
    return path


class HubPushCallback(TaskCallback):
    """Pushes every task checkpoint to `hub.model_id` in the background (main process; `main` and branch
    `task-<k>`, with the `hub` section's timeout, retries and backoff: `hf_ccl.arguments.HubArguments`); at the
    stream's end it waits for the pushes and keeps their `report`."""

    def __init__(self) -> None:
        self.pusher: HubPusher | None = None
        self.report: PushReport | None = None

    def on_stream_begin(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self.report = None
        hub = args.hub  # HubArguments
        if hub.model_id is not None and is_main_process():
            self.pusher = HubPusher(hub.model_id, private=hub.private, timeout=hub.timeout, retries=hub.retries,
                                    backoff=hub.backoff)

    def on_checkpoint_saved(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if self.pusher is not None:
            self.pusher.push(kwargs["folder"], state.task_index)

    def on_stream_end(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        """Even when a task failed, the finished tasks' pushes complete (bounded by timeouts and retries)."""
        if self.pusher is None:
            return
        self.report, self.pusher = self.pusher.finish(), None
        if self.report.failed:
            logger.warning("%d task revision(s) could not be pushed to %s (see push_report; `hf-ccl push` pushes a "
                           "run's checkpoints again)", len(self.report.failed), args.hub.model_id)
