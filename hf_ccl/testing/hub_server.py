"""A local server that speaks the Hugging Face Hub HTTP API, for testing pushes and downloads with no network.

`LocalHubServer` answers the endpoints that `huggingface_hub` (and so `transformers`) calls to create repos, commit
files, manage branches and tags, list files and download them: `HfApi.create_repo`, `upload_folder`, `upload_file`,
`create_commit`, `create_branch`, `create_tag`, `list_repo_refs`, `list_repo_commits`, `list_repo_files`,
`model_info`, `file_exists`, `hf_hub_download`, `snapshot_download` and `CLIPModel.from_pretrained(repo, revision=...)`
work against it unchanged. Model, dataset and space repos are served; every file is stored in real revisions on disk
(see `HubStore`); there is no authentication (any token, or none, is accepted; the user is `hf-ccl-test`).

Uploads never take the LFS or Xet path: the preupload endpoint answers "regular" for every file, so the client sends
contents inline (base64) in the commit. Pull requests are not supported.

`local_hub_endpoint(server.endpoint)` (or `server.patch_client()`) points huggingface_hub, transformers and datasets in
this process at the server, online, for the duration of a `with` block, and sets the environment variables that
subprocesses started inside inherit. `FaultPlan` makes the server drop, fail, delay or hang requests, to test how a
pusher copes; `server.request_log` records what was asked and answered.

Also runnable on its own (the endpoint is the first line on stdout; SIGTERM or Ctrl-C stops it)::

    python -m hf_ccl.testing.hub_server --root DIR [--port 0] [--drop-every N] [--fail-every N] [--delay S]

This module imports only the standard library until `local_hub_endpoint` is used.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

#: The user every request is made as.
LOCAL_USER = "hf-ccl-test"
#: The (fake) token `local_hub_endpoint` sets, so that calls which need a token locally (`whoami`) work.
LOCAL_TOKEN = "hf_local_hub_test_token"

_TYPE_BY_PLURAL = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_SHA_PREFIX = re.compile(r"[0-9a-f]{7,40}")
_BAD_REF = re.compile(r"(^refs/)|(^/)|(/$)|(\.\.)|(//)|[\s~^:?*\[\\]")
_GITATTRIBUTES = (
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
)


def _now() -> str:
    """The current UTC time in the Hub's date format ('2024-05-01T12:00:00.000Z')."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_oid(content: bytes) -> str:
    """The git object id (sha1 of 'blob <size>\\0' + content) of a file, which the Hub uses as a regular file's ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubError(Exception):
    """An error answered as JSON, with the `X-Error-Code` header huggingface_hub maps to its exception classes."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, dict(headers or {})


def _repo_not_found(repo_id: str) -> HubError:
    return HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")


def _revision_not_found(revision: str) -> HubError:
    return HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


def _entry_not_found(path: str, commit: str) -> HubError:
    return HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit})


def _check_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


# ----------------------------------------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------------------------------------


class HubStore:
    """Repos, revisions and files on disk, content-addressed.

    Layout under `root`::

        blobs/<sha256>                              file contents, shared by every repo
        repos/<type>s/<namespace>/<name>/refs.json  {"branches": {name: commit}, "tags": {name: commit}, ...}
        repos/<type>s/<namespace>/<name>/commits/<commit>.json
            {"id", "parent", "title", "message", "date", "files": {path: {"sha256", "oid", "size"}}}

    A repo starts with an initial commit holding `.gitattributes` on `main`, as on the Hub. Every method is
    thread-safe (one lock); files are written atomically.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()

    # ----- low level ------------------------------------------------------------------------------------------------
    def _repo_dir(self, repo_type: str, repo_id: str) -> Path:
        if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
            raise _repo_not_found(repo_id)  # also keeps every path under root
        return self.root / "repos" / f"{repo_type}s" / repo_id

    @staticmethod
    def _write_json(path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)

    def _refs(self, repo_type: str, repo_id: str) -> dict[str, Any]:
        path = self._repo_dir(repo_type, repo_id) / "refs.json"
        if not path.is_file():
            raise _repo_not_found(repo_id)
        return json.loads(path.read_text(encoding="utf-8"))

    def put_blob(self, content: bytes) -> dict[str, Any]:
        """Store `content`; return its manifest entry {"sha256", "oid", "size"}."""
        sha256 = hashlib.sha256(content).hexdigest()
        path = self.root / "blobs" / sha256
        if not path.exists():
            tmp = path.with_name(f".{sha256}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)
        return {"sha256": sha256, "oid": git_blob_oid(content), "size": len(content)}

    def read_blob(self, sha256: str) -> bytes:
        return (self.root / "blobs" / sha256).read_bytes()

    def has_blob(self, sha256: str) -> bool:
        return (self.root / "blobs" / sha256).is_file()

    # ----- repos ----------------------------------------------------------------------------------------------------
    def repo_exists(self, repo_type: str, repo_id: str) -> bool:
        return (self._repo_dir(repo_type, repo_id) / "refs.json").is_file()

    def create_repo(self, repo_type: str, repo_id: str) -> bool:
        """Create a repo with its initial commit; False if it already exists."""
        with self.lock:
            if self.repo_exists(repo_type, repo_id):
                return False
            self._write_json(
                self._repo_dir(repo_type, repo_id) / "refs.json",
                {"branches": {}, "tags": {}, "createdAt": _now()},
            )
            gitattributes = self.put_blob(_GITATTRIBUTES)
            self._new_commit(
                repo_type, repo_id, "main", None, {".gitattributes": gitattributes}, "initial commit", ""
            )
            return True

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        with self.lock:
            repo_dir = self._repo_dir(repo_type, repo_id)
            if not self.repo_exists(repo_type, repo_id):
                raise _repo_not_found(repo_id)
            for path in sorted(repo_dir.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            repo_dir.rmdir()

    def created_at(self, repo_type: str, repo_id: str) -> str:
        return self._refs(repo_type, repo_id).get("createdAt", _now())

    # ----- revisions ------------------------------------------------------------------------------------------------
    def resolve(self, repo_type: str, repo_id: str, revision: str) -> str:
        """The commit id a branch, tag, `refs/heads/..`, `refs/tags/..`, commit id or commit-id prefix points to."""
        with self.lock:
            refs = self._refs(repo_type, repo_id)
            for kind, prefix in (("branches", "refs/heads/"), ("tags", "refs/tags/")):
                name = revision.removeprefix(prefix)
                if name in refs[kind]:
                    return refs[kind][name]
            if _SHA_PREFIX.fullmatch(revision):
                commits_dir = self._repo_dir(repo_type, repo_id) / "commits"
                matches = [p.stem for p in commits_dir.glob(f"{revision}*.json")]
                if len(matches) == 1:
                    return matches[0]
            raise _revision_not_found(revision)

    def commit_info(self, repo_type: str, repo_id: str, commit: str) -> dict[str, Any]:
        return json.loads(
            (self._repo_dir(repo_type, repo_id) / "commits" / f"{commit}.json").read_text("utf-8")
        )

    def files(self, repo_type: str, repo_id: str, revision: str) -> tuple[str, dict[str, dict[str, Any]]]:
        """(commit id, {path: {"sha256", "oid", "size"}}) of a revision."""
        with self.lock:
            commit = self.resolve(repo_type, repo_id, revision)
            return commit, self.commit_info(repo_type, repo_id, commit)["files"]

    def history(self, repo_type: str, repo_id: str, revision: str) -> list[dict[str, Any]]:
        """The commits reachable from `revision`, newest first."""
        with self.lock:
            commit: str | None = self.resolve(repo_type, repo_id, revision)
            out = []
            while commit is not None:
                info = self.commit_info(repo_type, repo_id, commit)
                out.append(info)
                commit = info["parent"]
            return out

    def refs(self, repo_type: str, repo_id: str) -> dict[str, dict[str, str]]:
        """{"branches": {name: commit}, "tags": {name: commit}}."""
        with self.lock:
            refs = self._refs(repo_type, repo_id)
            return {"branches": dict(refs["branches"]), "tags": dict(refs["tags"])}

    def _set_ref(self, repo_type: str, repo_id: str, kind: str, name: str, commit: str | None) -> None:
        refs = self._refs(repo_type, repo_id)
        if commit is None:
            refs[kind].pop(name, None)
        else:
            refs[kind][name] = commit
        self._write_json(self._repo_dir(repo_type, repo_id) / "refs.json", refs)

    def create_branch(self, repo_type: str, repo_id: str, branch: str, start: str | None = None) -> str:
        """Create `branch` at `start` (default: main's head); 409 if it exists."""
        with self.lock:
            if _BAD_REF.search(branch) or not branch:
                raise HubError(400, f"Invalid reference for a branch: {branch}")
            refs = self._refs(repo_type, repo_id)
            if branch in refs["branches"]:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            commit = self.resolve(repo_type, repo_id, start or "main")
            self._set_ref(repo_type, repo_id, "branches", branch, commit)
            return commit

    def delete_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        with self.lock:
            if branch == "main":
                raise HubError(403, "Cannot delete the main branch")
            if branch not in self._refs(repo_type, repo_id)["branches"]:
                raise _revision_not_found(branch)
            self._set_ref(repo_type, repo_id, "branches", branch, None)

    def create_tag(self, repo_type: str, repo_id: str, tag: str, revision: str = "main") -> str:
        """Tag the commit `revision` points to; 409 if the tag exists."""
        with self.lock:
            if _BAD_REF.search(tag) or not tag:
                raise HubError(400, f"Invalid reference for a tag: {tag}")
            if tag in self._refs(repo_type, repo_id)["tags"]:
                raise HubError(409, f"Tag already exists: {tag}")
            commit = self.resolve(repo_type, repo_id, revision)
            self._set_ref(repo_type, repo_id, "tags", tag, commit)
            return commit

    def delete_tag(self, repo_type: str, repo_id: str, tag: str) -> None:
        with self.lock:
            if tag not in self._refs(repo_type, repo_id)["tags"]:
                raise _revision_not_found(tag)
            self._set_ref(repo_type, repo_id, "tags", tag, None)

    # ----- commits --------------------------------------------------------------------------------------------------
    def _new_commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        parent: str | None,
        files: dict[str, dict[str, Any]],
        title: str,
        message: str,
    ) -> str:
        seed = json.dumps(
            [parent, files, title, message, time.time_ns(), secrets.token_hex(8)], sort_keys=True
        )
        commit = hashlib.sha1(seed.encode()).hexdigest()
        record = {
            "id": commit,
            "parent": parent,
            "title": title,
            "message": message,
            "date": _now(),
            "files": files,
        }
        self._write_json(self._repo_dir(repo_type, repo_id) / "commits" / f"{commit}.json", record)
        self._set_ref(repo_type, repo_id, "branches", branch, commit)
        return commit

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        operations: list[tuple[str, str, Any]],
        title: str,
        message: str = "",
        parent_commit: str | None = None,
    ) -> str:
        """Apply operations to the head of `branch` and advance it; return the new commit id.

        Operations, in order: ("add", path, bytes), ("lfs", path, sha256 of a stored blob), ("delete_file", path),
        ("delete_folder", path). `parent_commit` (or a prefix of it), when given, must be the branch head (else 412).
        """
        with self.lock:
            refs = self._refs(repo_type, repo_id)
            if branch not in refs["branches"]:
                raise _revision_not_found(branch)
            head = refs["branches"][branch]
            if parent_commit is not None and not head.startswith(parent_commit):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(self.commit_info(repo_type, repo_id, head)["files"])
            for kind, path, payload in operations:
                path = _check_path(path.strip("/") if kind == "delete_folder" else path)
                if kind == "add":
                    files[path] = self.put_blob(payload)
                elif kind == "lfs":
                    if not self.has_blob(payload):
                        raise HubError(
                            422, f"LFS object {payload} of {path} was never uploaded to this server"
                        )
                    content = self.read_blob(payload)
                    files[path] = {"sha256": payload, "oid": git_blob_oid(content), "size": len(content)}
                elif kind == "delete_file":
                    if files.pop(path, None) is None:
                        raise _entry_not_found(path, head)
                elif kind == "delete_folder":
                    doomed = [p for p in files if p.startswith(path + "/")]
                    if not doomed:
                        raise _entry_not_found(path, head)
                    for p in doomed:
                        del files[p]
                else:
                    raise HubError(400, f"Unknown commit operation: {kind}")
            return self._new_commit(repo_type, repo_id, branch, head, files, title, message)


# ----------------------------------------------------------------------------------------------------------------------
# HTTP application: request -> response, no sockets
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class _Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> _Response:
    return _Response(
        status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})}
    )


def _error(err: HubError) -> _Response:
    headers = {**err.headers, "X-Error-Message": err.message}
    if err.code:
        headers["X-Error-Code"] = err.code
    return _json({"error": err.message}, err.status, headers)


class _HubApp:
    """Routes Hub API requests to a `HubStore`. `base` is the endpoint URL the client used (for URLs in replies)."""

    def __init__(self, store: HubStore):
        self.store = store

    def __call__(self, method: str, target: str, headers: Any, body: bytes, base: str) -> _Response:
        try:
            return self._route(method, target, headers, body, base)
        except HubError as err:
            return _error(err)
        except (ValueError, KeyError, TypeError) as err:
            return _error(HubError(400, f"Bad request: {err!r}"))
        except (
            Exception
        ) as err:  # a bug or a disk error: answer 500 as the Hub would, not a dropped connection
            return _error(HubError(500, f"Internal error of the local hub: {err!r}"))

    def _route(self, method: str, target: str, headers: Any, body: bytes, base: str) -> _Response:
        split = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        seg = [unquote(s) for s in split.path.split("/")[1:]]
        if seg and seg[-1] == "" and len(seg) > 1:
            seg = seg[:-1]
        if seg[:1] != ["api"]:
            return self._resolve_route(method, seg, headers)
        api = seg[1:]
        if api == ["whoami-v2"]:
            return _json(_whoami())
        if api == ["validate-yaml"] and method == "POST":
            return _json({"errors": [], "warnings": []})
        if api[:1] == ["telemetry"]:
            return _json({})
        if api == ["repos", "create"] and method == "POST":
            return self._create_repo(json.loads(body or b"{}"), base)
        if api == ["repos", "delete"] and method == "DELETE":
            payload = json.loads(body or b"{}")
            repo_type = payload.get("type") or "model"
            self.store.delete_repo(
                repo_type, f"{payload.get('organization') or LOCAL_USER}/{payload['name']}"
            )
            return _json({})
        if len(api) >= 3 and api[0] in _TYPE_BY_PLURAL:
            repo_type, repo_id, rest = _TYPE_BY_PLURAL[api[0]], f"{api[1]}/{api[2]}", api[3:]
            if not self.store.repo_exists(repo_type, repo_id):
                raise _repo_not_found(repo_id)
            return self._repo_route(method, repo_type, repo_id, rest, query, headers, body, base)
        return _json({"error": f"Not found: {method} {split.path}"}, 404)

    # ----- /api/{type}s/{namespace}/{name}/... ------------------------------------------------------------------
    def _repo_route(
        self,
        method: str,
        repo_type: str,
        repo_id: str,
        rest: list[str],
        query: dict[str, str],
        headers: Any,
        body: bytes,
        base: str,
    ) -> _Response:
        store, action = self.store, (rest[0] if rest else "")
        if method == "GET" and not rest:
            return self._info(repo_type, repo_id, "main")
        if method == "GET" and action == "revision" and len(rest) == 2:
            return self._info(repo_type, repo_id, rest[1])
        if method == "GET" and action == "refs":
            return self._refs(repo_type, repo_id)
        if method == "GET" and action == "tree" and len(rest) >= 2:
            return self._tree(
                repo_type, repo_id, rest[1], "/".join(rest[2:]), query.get("recursive") == "true"
            )
        if method == "GET" and action == "commits" and len(rest) == 2:
            return self._commits(repo_type, repo_id, rest[1])
        if method == "POST" and action == "paths-info" and len(rest) == 2:
            return self._paths_info(repo_type, repo_id, rest[1], headers, body)
        if method == "POST" and action == "preupload" and len(rest) == 2:
            return self._preupload(repo_type, repo_id, rest[1], json.loads(body or b"{}"), query)
        if method == "POST" and action == "commit" and len(rest) == 2:
            return self._commit(repo_type, repo_id, rest[1], body, query, base)
        if action == "branch" and len(rest) == 2:
            if method == "POST":
                start = json.loads(body or b"{}").get("startingPoint")
                store.create_branch(repo_type, repo_id, rest[1], start)
                return _json({})
            if method == "DELETE":
                store.delete_branch(repo_type, repo_id, rest[1])
                return _json({})
        if action == "tag" and len(rest) == 2:
            if method == "POST":
                store.create_tag(repo_type, repo_id, json.loads(body or b"{}")["tag"], rest[1])
                return _json({})
            if method == "DELETE":
                store.delete_tag(repo_type, repo_id, rest[1])
                return _json({})
        return _json({"error": f"Not supported by the local hub: {method} {action or '(repo)'}"}, 404)

    def _create_repo(self, payload: dict[str, Any], base: str) -> _Response:
        repo_type = payload.get("type") or "model"
        if repo_type not in _URL_PREFIX:
            raise HubError(400, f"Unsupported repo type: {repo_type}")
        repo_id = f"{payload.get('organization') or LOCAL_USER}/{payload['name']}"
        url = f"{base}/{_URL_PREFIX[repo_type]}{repo_id}"
        if not self.store.create_repo(repo_type, repo_id):
            return _json({"error": f"You already created this {repo_type} repo", "url": url}, 409)
        return _json({"url": url, "name": repo_id, "id": repo_id})

    def _info(self, repo_type: str, repo_id: str, revision: str) -> _Response:
        commit, files = self.store.files(repo_type, repo_id, revision)
        date = self.store.commit_info(repo_type, repo_id, commit)["date"]
        siblings = [{"rfilename": p, "size": f["size"], "blobId": f["oid"]} for p, f in sorted(files.items())]
        info = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit,
            "lastModified": date,
            "createdAt": self.store.created_at(repo_type, repo_id),
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(f["size"] for f in files.values()),
        }
        if repo_type == "model":
            info["modelId"] = repo_id
        if repo_type == "space":
            info["sdk"] = "static"
        return _json(info)

    def _refs(self, repo_type: str, repo_id: str) -> _Response:
        refs = self.store.refs(repo_type, repo_id)

        def fmt(kind: str, prefix: str) -> list[dict[str, str]]:
            return [{"name": n, "ref": prefix + n, "targetCommit": c} for n, c in sorted(refs[kind].items())]

        return _json(
            {
                "branches": fmt("branches", "refs/heads/"),
                "tags": fmt("tags", "refs/tags/"),
                "converts": [],
                "pullRequests": [],
            }
        )

    def _commits(self, repo_type: str, repo_id: str, revision: str) -> _Response:
        return _json(
            [
                {
                    "id": c["id"],
                    "title": c["title"],
                    "message": c["message"],
                    "date": c["date"],
                    "authors": [{"user": LOCAL_USER}],
                }
                for c in self.store.history(repo_type, repo_id, revision)
            ]
        )

    @staticmethod
    def _entries(files: dict[str, dict[str, Any]], commit: str) -> tuple[dict[str, dict], dict[str, dict]]:
        """File and folder entries as the tree endpoint lists them, by path."""
        file_entries = {
            p: {"type": "file", "path": p, "oid": f["oid"], "size": f["size"]} for p, f in files.items()
        }
        folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
        folder_entries = {
            d: {
                "type": "directory",
                "path": d,
                "oid": hashlib.sha1(f"{commit}:{d}".encode()).hexdigest(),
                "size": 0,
            }
            for d in folders
        }
        return file_entries, folder_entries

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str, recursive: bool) -> _Response:
        commit, files = self.store.files(repo_type, repo_id, revision)
        file_entries, folder_entries = self._entries(files, commit)
        path = path.strip("/")
        if path and path not in folder_entries:
            raise _entry_not_found(path, commit)
        prefix = f"{path}/" if path else ""
        out = []
        for entries in (folder_entries, file_entries):
            for p, entry in sorted(entries.items()):
                if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :]):
                    out.append(entry)
        return _json(out, headers={"X-Repo-Commit": commit})

    def _paths_info(
        self, repo_type: str, repo_id: str, revision: str, headers: Any, body: bytes
    ) -> _Response:
        commit, files = self.store.files(repo_type, repo_id, revision)
        if "json" in (headers.get("Content-Type") or ""):
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        file_entries, folder_entries = self._entries(files, commit)
        known = {**file_entries, **folder_entries}
        return _json([known[p.strip("/")] for p in paths if p.strip("/") in known])

    def _preupload(
        self, repo_type: str, repo_id: str, revision: str, payload: dict[str, Any], query: dict[str, str]
    ) -> _Response:
        if query.get("create_pr") == "1":
            raise HubError(400, "Pull requests are not supported by the local hub")
        commit, files = self.store.files(repo_type, repo_id, revision)
        out = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": files[f["path"]]["oid"] if f["path"] in files else None,
            }
            for f in payload.get("files", [])
        ]
        return _json({"files": out, "commitOid": commit})

    def _commit(
        self, repo_type: str, repo_id: str, branch: str, body: bytes, query: dict[str, str], base: str
    ) -> _Response:
        if query.get("create_pr") == "1":
            raise HubError(400, "Pull requests are not supported by the local hub")
        header: dict[str, Any] = {}
        operations: list[tuple[str, str, Any]] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                content = value["content"]
                raw = base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
                operations.append(("add", value["path"], raw))
            elif key == "lfsFile":
                operations.append(("lfs", value["path"], value["oid"]))
            elif key == "deletedFile":
                operations.append(("delete_file", value["path"], None))
            elif key == "deletedFolder":
                operations.append(("delete_folder", value["path"], None))
            else:
                raise HubError(400, f"Unknown commit line key: {key}")
        if not self.store.repo_exists(repo_type, repo_id):
            raise _repo_not_found(repo_id)
        commit = self.store.commit(
            repo_type,
            repo_id,
            branch,
            operations,
            title=header.get("summary") or "Commit",
            message=header.get("description") or "",
            parent_commit=header.get("parentCommit"),
        )
        url = f"{base}/{_URL_PREFIX[repo_type]}{repo_id}/commit/{commit}"
        return _json(
            {"success": True, "commitOid": commit, "commitUrl": url, "hookOutput": "", "pullRequestUrl": None}
        )

    # ----- /[{type}s/]{namespace}/{name}/resolve/{revision}/{path} ------------------------------------------------
    def _resolve_route(self, method: str, seg: list[str], headers: Any) -> _Response:
        repo_type = "model"
        if seg and seg[0] in ("datasets", "spaces"):
            repo_type, seg = _TYPE_BY_PLURAL[seg[0]], seg[1:]
        if "resolve" not in seg[:3] or method not in ("GET", "HEAD"):
            return _json({"error": f"Not found: {method} /{'/'.join(seg)}"}, 404)
        at = seg.index("resolve")
        repo_id, rest = "/".join(seg[:at]), seg[at + 1 :]
        if not self.store.repo_exists(repo_type, repo_id):
            raise _repo_not_found(repo_id)
        if len(rest) < 2:
            raise HubError(400, "Expected /resolve/{revision}/{path}")
        commit, files = self.store.files(repo_type, repo_id, rest[0])
        path = "/".join(rest[1:])
        if path not in files:
            raise _entry_not_found(path, commit)
        entry = files[path]
        content = self.store.read_blob(entry["sha256"])
        out_headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": commit,
            "ETag": f'"{entry["oid"]}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f'inline; filename="{path.rsplit("/", 1)[-1]}"',
        }
        match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", headers.get("Range") or "")
        if match and method == "GET" and (match.group(1) or match.group(2)):
            size = len(content)
            if match.group(1):
                start, end = int(match.group(1)), int(match.group(2) or size - 1)
            else:
                start, end = max(size - int(match.group(2)), 0), size - 1
            if start >= size or start > end:
                return _Response(416, b"", {"Content-Range": f"bytes */{size}"})
            end = min(end, size - 1)
            out_headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            return _Response(206, content[start : end + 1], out_headers)
        return _Response(200, content, out_headers)


def _whoami() -> dict[str, Any]:
    return {
        "type": "user",
        "id": "0" * 24,
        "name": LOCAL_USER,
        "fullname": "hf_ccl local hub test user",
        "email": None,
        "emailVerified": False,
        "isPro": False,
        "orgs": [],
        "auth": {"type": "access_token", "accessToken": {"displayName": "local", "role": "write"}},
    }


# ----------------------------------------------------------------------------------------------------------------------
# Faults, request log, server
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultPlan:
    """Faults the server injects, counted over the requests it applies to (1-based, thread-safe counter).

    For the n-th matching request, in this order of precedence:

    - `hang_every`: never answer (the handler waits until the server stops), to test client timeouts;
    - `drop_every`: close the connection without any response; the request is not processed;
    - `fail_every`: answer `fail_status` (default 500) without processing the request;
    - `lose_reply_every`: process the request (a commit IS made), then close the connection without answering,
      as when a reply is lost in transit: the case where retrying a non-idempotent call duplicates it.

    `delay_s` sleeps before answering every matching request. `only_methods` limits the faults to those HTTP methods
    (default: POST, which is how every write reaches the Hub); None applies them to every request. Counters restart
    when a new plan is assigned to `LocalHubServer.faults`.
    """

    drop_every: int = 0
    fail_every: int = 0
    fail_status: int = 500
    delay_s: float = 0.0
    hang_every: int = 0
    lose_reply_every: int = 0
    only_methods: tuple[str, ...] | None = ("POST",)

    def applies_to(self, method: str) -> bool:
        return self.only_methods is None or method.upper() in {m.upper() for m in self.only_methods}

    def action(self, n: int) -> str | None:
        """The fault for the n-th matching request: "hang", "drop", "fail", "lose_reply" or None."""
        for name, every in (
            ("hang", self.hang_every),
            ("drop", self.drop_every),
            ("fail", self.fail_every),
            ("lose_reply", self.lose_reply_every),
        ):
            if every > 0 and n % every == 0:
                return name
        return None


class LoggedRequest(NamedTuple):
    """One request the server received; `status` is None when no response was sent (dropped, hung, lost reply)."""

    method: str
    path: str
    status: int | None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub; every response carries a Content-Length
    timeout = 120  # close idle keep-alive connections eventually
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr log; see `LocalHubServer.request_log`."""

    def setup(self) -> None:
        super().setup()
        with self.server.hub._lock:
            self.server.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.hub._lock:
            self.server.hub._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        hub = self.server.hub
        body = self._read_body()
        path = urlsplit(self.path).path
        action, plan = hub._next_fault(self.command)
        if plan is not None and plan.delay_s > 0:
            hub._stopping.wait(plan.delay_s)
        if action in ("hang", "drop"):
            # logged on arrival: a hung request is in the log while it hangs
            hub._log(self.command, path, None)
            if action == "hang":
                hub._stopping.wait()
            self.close_connection = True
            return
        if action == "fail":
            assert plan is not None
            response = _error(HubError(plan.fail_status, f"Injected fault: HTTP {plan.fail_status}"))
        else:
            base = f"http://{self.headers.get('Host') or hub.endpoint.split('://', 1)[1]}"
            response = hub._app(self.command, self.path, self.headers, body, base)
        if action == "lose_reply":
            self.close_connection = True
            hub._log(self.command, path, None)
            return
        # logged before answering: once a client has its answer, the log shows it
        hub._log(self.command, path, response.status)
        try:
            self.send_response(response.status)
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(response.body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(response.body)
        except OSError:  # the client gave up (e.g. its timeout passed during a delay)
            self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: LocalHubServer


class LocalHubServer:
    """A Hugging Face Hub look-alike on `host:port` (0: a free port), serving repos stored under `root`.

    Use as a context manager (starts, then stops), or call `start()` / `stop()`. The server runs in a daemon
    thread; `endpoint` is its URL. Point clients at it with `patch_client()` or `local_hub_endpoint(endpoint)`.
    `faults` (a `FaultPlan`) can be replaced at any time; `request_log` lists every request received.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        faults: FaultPlan | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.root = Path(root)
        self.store = HubStore(self.root)
        self._app = _HubApp(self.store)
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._faults = faults or FaultPlan()
        self._fault_count = 0
        self._log_entries: list[LoggedRequest] = []
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> LocalHubServer:
        """Bind and serve in a daemon thread (no-op if already running)."""
        if self._httpd is not None:
            return self
        self._stopping.clear()
        httpd = _HTTPServer((self._host, self._port), _Handler)
        httpd.hub = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="local-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: hung requests are released, open connections closed."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> LocalHubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The server's URL, e.g. 'http://127.0.0.1:54321'."""
        if self._httpd is None:
            raise RuntimeError("LocalHubServer is not running: call start() or use it as a context manager")
        host, port = self._httpd.socket.getsockname()[:2]  # what `server_address` holds, typed
        return f"http://{host}:{port}"

    def patch_client(self, **kwargs: Any) -> contextlib.AbstractContextManager[str]:
        """`local_hub_endpoint(self.endpoint, **kwargs)`: point huggingface_hub and transformers at this server."""
        return local_hub_endpoint(self.endpoint, **kwargs)

    # ----- faults and log -------------------------------------------------------------------------------------------
    @property
    def faults(self) -> FaultPlan:
        return self._faults

    @faults.setter
    def faults(self, plan: FaultPlan | None) -> None:
        with self._lock:
            self._faults = plan or FaultPlan()
            self._fault_count = 0

    def _next_fault(self, method: str) -> tuple[str | None, FaultPlan | None]:
        with self._lock:
            plan = self._faults
            if not plan.applies_to(method):
                return None, None
            self._fault_count += 1
            return plan.action(self._fault_count), plan

    def _log(self, method: str, path: str, status: int | None) -> None:
        with self._lock:
            self._log_entries.append(LoggedRequest(method, path, status))

    @property
    def request_log(self) -> list[LoggedRequest]:
        """A copy of the requests received so far, oldest first."""
        with self._lock:
            return list(self._log_entries)

    def clear_request_log(self) -> None:
        with self._lock:
            self._log_entries.clear()


# ----------------------------------------------------------------------------------------------------------------------
# Pointing clients at the server
# ----------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def local_hub_endpoint(
    endpoint: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | None = LOCAL_TOKEN,
    client_timeout: float | None = None,
) -> Iterator[str]:
    """Make huggingface_hub, transformers and datasets in this process use `endpoint`, online, inside the block.

    huggingface_hub reads `HF_ENDPOINT` and `HF_HUB_OFFLINE` once, at import, into `huggingface_hub.constants`, and
    binds its module-level `HfApi` (behind `huggingface_hub.create_repo` and friends) and transformers' shared `HfApi`
    to the endpoint of their day, so setting the variables is not enough. Inside the block:

    - `huggingface_hub.constants`: ENDPOINT, HUGGINGFACE_CO_URL_TEMPLATE, HF_URL_HOSTS (plus the server's host),
      HF_HUB_OFFLINE=False, HF_HUB_DISABLE_TELEMETRY=True, and HF_HUB_CACHE when `cache_dir` is given;
    - `huggingface_hub.hf_api.api.endpoint`; transformers' cached `transformers.utils.hub._hf_api` is dropped so it is
      rebuilt for the endpoint; `datasets.config` HF_ENDPOINT, HUB_DATASETS_URL, HF_HUB_OFFLINE, HF_DATASETS_OFFLINE
      (when datasets is imported);
    - environment, for subprocesses: HF_ENDPOINT, HF_HUB_OFFLINE=0, TRANSFORMERS_OFFLINE=0, HF_DATASETS_OFFLINE=0,
      HF_HUB_DISABLE_TELEMETRY=1, NO_PROXY/no_proxy (plus the server's host), HF_HUB_CACHE when `cache_dir` is
      given, HF_TOKEN=`token` unless `token` is None (a fake token by default, so no real one is sent and `whoami`
      works);
    - the shared HTTP client is closed on entry and exit (no connection outlives the block); with `client_timeout`,
      every request that does not set its own timeout times out after that many seconds (huggingface_hub's default
      client has none: a server that never answers hangs the caller forever).

    Everything is restored on exit. Modules first imported inside the block keep what they read from the
    environment then (datasets' config, for one). Not thread-safe: patch once, from the main thread.
    Yields the endpoint.
    """
    import huggingface_hub
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _http

    endpoint = endpoint.rstrip("/")
    host = urlsplit(endpoint).hostname or "127.0.0.1"
    with contextlib.ExitStack() as stack:

        def set_attr(obj: Any, name: str, value: Any) -> None:
            if hasattr(obj, name):  # older huggingface_hub versions lack some of these
                stack.callback(setattr, obj, name, getattr(obj, name))
                setattr(obj, name, value)

        def set_env(name: str, value: str) -> None:
            old = os.environ.get(name)
            stack.callback(
                lambda: os.environ.__setitem__(name, old) if old is not None else os.environ.pop(name, None)
            )
            os.environ[name] = value

        env = {
            "HF_ENDPOINT": endpoint,
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_DATASETS_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        for name in ("NO_PROXY", "no_proxy"):
            env[name] = ",".join(filter(None, [host, os.environ.get(name)]))
        if cache_dir is not None:
            env["HF_HUB_CACHE"] = str(Path(cache_dir))
        if token is not None:
            env["HF_TOKEN"] = token
        for name, value in env.items():
            set_env(name, value)

        set_attr(constants, "ENDPOINT", endpoint)
        set_attr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        set_attr(constants, "HF_URL_HOSTS", constants.HF_URL_HOSTS | {host.lower()})
        set_attr(constants, "HF_HUB_OFFLINE", False)
        set_attr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        if cache_dir is not None:
            set_attr(constants, "HF_HUB_CACHE", str(Path(cache_dir)))
        set_attr(hf_api.api, "endpoint", endpoint)

        transformers_hub: Any = sys.modules.get("transformers.utils.hub")  # its private `_hf_api` is set below
        saved_api = getattr(transformers_hub, "_hf_api", None)

        def restore_transformers_api() -> None:
            module: Any = sys.modules.get("transformers.utils.hub")
            if module is not None and hasattr(module, "_hf_api"):
                module._hf_api = saved_api if module is transformers_hub else None

        stack.callback(restore_transformers_api)
        if transformers_hub is not None and hasattr(transformers_hub, "_hf_api"):
            transformers_hub._hf_api = None

        datasets_config = sys.modules.get("datasets.config")
        if datasets_config is not None:
            set_attr(datasets_config, "HF_ENDPOINT", endpoint)
            set_attr(
                datasets_config,
                "HUB_DATASETS_URL",
                endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}",
            )
            set_attr(datasets_config, "HF_HUB_OFFLINE", False)
            set_attr(datasets_config, "HF_DATASETS_OFFLINE", False)

        if client_timeout is not None:
            if not hasattr(huggingface_hub, "set_client_factory"):
                raise NotImplementedError("client_timeout needs huggingface_hub>=1.0 (set_client_factory)")
            stack.callback(huggingface_hub.set_client_factory, _http._GLOBAL_CLIENT_FACTORY)

            def factory() -> Any:
                client = _http.default_client_factory()
                client.timeout = client_timeout  # the client turns it into a Timeout
                return client

            huggingface_hub.set_client_factory(factory)
        stack.callback(huggingface_hub.close_session)
        huggingface_hub.close_session()
        yield endpoint


# ----------------------------------------------------------------------------------------------------------------------
# Separate process
# ----------------------------------------------------------------------------------------------------------------------


def _fault_args(faults: FaultPlan) -> list[str]:
    args = [
        "--drop-every",
        str(faults.drop_every),
        "--fail-every",
        str(faults.fail_every),
        "--fail-status",
        str(faults.fail_status),
        "--delay",
        str(faults.delay_s),
        "--hang-every",
        str(faults.hang_every),
        "--lose-reply-every",
        str(faults.lose_reply_every),
    ]
    return [*args, "--methods", "all" if faults.only_methods is None else ",".join(faults.only_methods)]


@contextlib.contextmanager
def local_hub_process(
    root: str | os.PathLike[str],
    *,
    faults: FaultPlan | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 30.0,
) -> Iterator[str]:
    """Run `python -m hf_ccl.testing.hub_server` in a subprocess; yield its endpoint; terminate it on exit.

    For tests where the server must outlive, or be shared by, several client processes.
    """
    cmd = [
        sys.executable,
        "-m",
        "hf_ccl.testing.hub_server",
        "--root",
        str(root),
        "--host",
        host,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen([*cmd, *_fault_args(faults or FaultPlan())], stdout=subprocess.PIPE, text=True)
    try:
        stdout = proc.stdout
        assert stdout is not None
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(stdout.readline().strip()), daemon=True)
        reader.start()
        reader.join(startup_timeout)
        if not ready or not ready[0].startswith("http"):
            raise RuntimeError(
                f"the local hub process did not start (exit code {proc.poll()}, said {ready!r})"
            )
        yield ready[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C; print the endpoint as the first line on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m hf_ccl.testing.hub_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--root", type=Path, required=True, help="directory holding the repos (created if missing)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--drop-every", type=int, default=0, help="close the connection on every N-th request"
    )
    parser.add_argument(
        "--fail-every", type=int, default=0, help="answer --fail-status to every N-th request"
    )
    parser.add_argument("--fail-status", type=int, default=500)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before answering")
    parser.add_argument("--hang-every", type=int, default=0, help="never answer every N-th request")
    parser.add_argument("--lose-reply-every", type=int, default=0, help="process, then drop the reply")
    parser.add_argument(
        "--methods", default="POST", help="comma-separated methods the faults apply to, or 'all'"
    )
    args = parser.parse_args(argv)
    faults = FaultPlan(
        drop_every=args.drop_every,
        fail_every=args.fail_every,
        fail_status=args.fail_status,
        delay_s=args.delay,
        hang_every=args.hang_every,
        lose_reply_every=args.lose_reply_every,
        only_methods=None
        if args.methods.lower() == "all"
        else tuple(m.strip() for m in args.methods.split(",")),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with LocalHubServer(args.root, faults=faults, host=args.host, port=args.port) as server:
        print(server.endpoint, flush=True)
        while not stop.wait(0.2):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
