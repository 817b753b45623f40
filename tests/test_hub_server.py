"""The local Hub server against the real huggingface_hub client and transformers, with no network."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from transformers import CLIPModel

from hf_ccl.testing import FaultPlan, LocalHubServer, local_hub_endpoint, local_hub_process, tiny_clip

REPO = "hf-ccl-test/demo"


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _read(repo: str, filename: str, revision: str) -> str:
    return Path(huggingface_hub.hf_hub_download(repo, filename, revision=revision)).read_text()


def test_commits_branches_tags_and_downloads(local_hub, tmp_path):
    api = HfApi()
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO
    api.create_repo(REPO, exist_ok=True)  # 409 from the server, swallowed by exist_ok
    with pytest.raises(HfHubHTTPError) as exists:
        api.create_repo(REPO)
    assert exists.value.response.status_code == 409

    folder = _write(tmp_path / "v1", {"a.txt": "a1", "b.txt": "b1", "sub/c.txt": "c1"})
    first = api.upload_folder(repo_id=REPO, folder_path=folder, commit_message="first")
    api.create_branch(REPO, branch="task-0", revision=first.oid, exist_ok=True)
    api.create_branch(REPO, branch="task-0", exist_ok=True)

    (folder / "a.txt").write_text("a2")
    (folder / "b.txt").unlink()
    second = api.upload_folder(repo_id=REPO, folder_path=folder, revision="task-0", delete_patterns=["b.txt"])
    api.create_tag(REPO, tag="v0.2", revision="task-0", exist_ok=True)
    api.create_tag(REPO, tag="v0.2", revision="task-0", exist_ok=True)
    api.create_tag(REPO, tag="v0.1", revision=first.oid)

    assert second.oid != first.oid and api.model_info(REPO, revision="task-0").sha == second.oid
    assert api.list_repo_files(REPO, revision="task-0") == [".gitattributes", "a.txt", "sub/c.txt"]
    assert api.list_repo_files(REPO) == [".gitattributes", "a.txt", "b.txt", "sub/c.txt"]
    assert [c.commit_id for c in api.list_repo_commits(REPO, revision="task-0")][:2] == [
        second.oid,
        first.oid,
    ]
    refs = api.list_repo_refs(REPO)
    assert {b.name: b.target_commit for b in refs.branches} == {"main": first.oid, "task-0": second.oid}
    assert {t.name: t.target_commit for t in refs.tags} == {"v0.1": first.oid, "v0.2": second.oid}
    assert api.file_exists(REPO, "b.txt") and not api.file_exists(REPO, "b.txt", revision="task-0")

    for revision, expected in [
        ("main", "a1"),
        ("task-0", "a2"),
        ("v0.1", "a1"),
        ("v0.2", "a2"),
        (first.oid, "a1"),
        (second.oid, "a2"),
        (second.oid[:7], "a2"),
    ]:
        assert _read(REPO, "a.txt", revision) == expected, revision

    snapshot = Path(huggingface_hub.snapshot_download(REPO, revision="v0.2"))
    assert snapshot.name == second.oid
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()) == [
        ".gitattributes",
        "a.txt",
        "sub/c.txt",
    ]
    assert (snapshot / "sub" / "c.txt").read_text() == "c1"

    # upload_file / create_commit on a branch; a commit whose parent is not the head is refused (412)
    third = api.upload_file(
        path_or_fileobj=b"\x00\x01", path_in_repo="d/e.bin", repo_id=REPO, revision="task-0"
    )
    assert (
        Path(huggingface_hub.hf_hub_download(REPO, "d/e.bin", revision=third.oid)).read_bytes() == b"\x00\x01"
    )
    with pytest.raises(HfHubHTTPError) as stale:
        api.create_commit(
            REPO,
            [huggingface_hub.CommitOperationAdd("x", b"x")],
            commit_message="m",
            revision="task-0",
            parent_commit=second.oid,
        )
    assert stale.value.response.status_code == 412

    api.delete_branch(REPO, branch="task-0")
    assert [b.name for b in api.list_repo_refs(REPO).branches] == ["main"]
    assert _read(REPO, "a.txt", "v0.2") == "a2"  # the tag keeps the commit


def test_missing_repo_revision_and_file_map_to_hub_errors(local_hub):
    api = HfApi()
    api.create_repo(REPO)
    with pytest.raises(RepositoryNotFoundError):
        huggingface_hub.hf_hub_download("hf-ccl-test/missing", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("hf-ccl-test/missing")
    with pytest.raises(RevisionNotFoundError):
        huggingface_hub.hf_hub_download(REPO, ".gitattributes", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):  # committing to a branch that does not exist, as on the Hub
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id=REPO, revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "no-such-file.json")
    with pytest.raises(EntryNotFoundError):
        api.delete_file("no-such-file.json", repo_id=REPO)


def test_clip_branches_load_with_from_pretrained(local_hub, tmp_path):
    api = HfApi()
    repo = api.create_repo("tiny-clip").repo_id  # the namespace is the server's user, as on the Hub
    assert repo == "hf-ccl-test/tiny-clip"
    for seed in (0, 1):
        tiny_clip(seed=seed).save_pretrained(tmp_path / f"task-{seed}")
        api.create_branch(repo, branch=f"task-{seed}")
        api.upload_folder(repo_id=repo, folder_path=tmp_path / f"task-{seed}", revision=f"task-{seed}")
    for seed in (0, 1):
        loaded = CLIPModel.from_pretrained(repo, revision=f"task-{seed}")
        assert type(loaded) is CLIPModel
        assert torch.equal(loaded.text_projection.weight, tiny_clip(seed=seed).text_projection.weight)
    assert not torch.equal(
        CLIPModel.from_pretrained(repo, revision="task-0").visual_projection.weight,
        CLIPModel.from_pretrained(repo, revision="task-1").visual_projection.weight,
    )


def test_range_requests_and_heads(local_hub):
    api = HfApi()
    api.create_repo(REPO)
    info = api.upload_file(path_or_fileobj=b"0123456789", path_in_repo="digits.txt", repo_id=REPO)
    url = f"{local_hub.endpoint}/{REPO}/resolve/main/digits.txt"
    with httpx2.Client() as client:
        head = client.head(url)
        assert head.headers["X-Repo-Commit"] == info.oid and head.headers["Content-Length"] == "10"
        assert head.headers["ETag"].strip('"') == huggingface_hub.get_hf_file_metadata(url).etag
        part = client.get(url, headers={"Range": "bytes=3-5"})
        assert part.status_code == 206 and part.content == b"345"
        assert client.get(url, headers={"Range": "bytes=7-"}).content == b"789"


def test_drop_fail_and_lost_reply_faults(local_hub):
    api = HfApi()
    api.create_repo(REPO)
    local_hub.faults = FaultPlan(drop_every=3)  # POST only, by default
    api.model_info(REPO)  # a GET: not counted
    api.create_tag(REPO, tag="t1")
    api.create_tag(REPO, tag="t2")
    with pytest.raises(httpx2.TransportError):  # the connection closes without a response
        api.create_tag(REPO, tag="t3")
    api.create_tag(REPO, tag="t4")
    assert [entry.status for entry in local_hub.request_log[-4:]] == [200, 200, None, 200]
    assert [t.name for t in api.list_repo_refs(REPO).tags] == ["t1", "t2", "t4"]  # t3 was never processed

    local_hub.faults = FaultPlan(fail_every=1, fail_status=503)
    with pytest.raises(HfHubHTTPError) as failed:
        api.create_branch(REPO, branch="b1")
    assert failed.value.response.status_code == 503
    local_hub.faults = FaultPlan(lose_reply_every=1)
    with pytest.raises(httpx2.TransportError):
        api.create_branch(REPO, branch="b2")
    local_hub.faults = None
    assert [b.name for b in api.list_repo_refs(REPO).branches] == ["b2", "main"]  # b2 was made, b1 was not


def test_delay_and_hang_with_client_timeouts(local_hub):
    api = HfApi()
    api.create_repo(REPO)
    local_hub.faults = FaultPlan(delay_s=0.3, only_methods=None)
    start = time.monotonic()
    api.model_info(REPO)
    assert time.monotonic() - start >= 0.3

    local_hub.faults = FaultPlan(hang_every=1, only_methods=("GET",))
    with pytest.raises(httpx2.TimeoutException):
        api.model_info(REPO, timeout=0.3)
    local_hub.faults = FaultPlan(hang_every=1)
    with local_hub_endpoint(local_hub.endpoint, client_timeout=0.3), pytest.raises(httpx2.TimeoutException):
        # create_tag sets no timeout of its own: the client's default applies
        api.create_tag(REPO, tag="never")
    local_hub.faults = None
    assert api.list_repo_refs(REPO).tags == []
    # hung requests are logged on arrival, with no status: they were never answered
    assert [(e.method, e.status) for e in local_hub.request_log[-3:]] == [
        ("GET", None),
        ("POST", None),
        ("GET", 200),
    ]


def test_patch_restores_and_reaches_subprocesses(tmp_path):
    before = (
        constants.ENDPOINT,
        constants.HF_HUB_OFFLINE,
        os.environ.get("HF_ENDPOINT"),
        os.environ["HF_HUB_OFFLINE"],
    )
    with (
        local_hub_process(tmp_path / "hub") as endpoint,
        local_hub_endpoint(endpoint, cache_dir=tmp_path / "c"),
    ):
        assert constants.ENDPOINT == endpoint and not constants.HF_HUB_OFFLINE
        api = HfApi()
        api.create_repo(REPO)
        api.upload_file(path_or_fileobj=b"from the parent", path_in_repo="x.txt", repo_id=REPO)
        child = (
            "import huggingface_hub as h; print(open(h.hf_hub_download('hf-ccl-test/demo', 'x.txt')).read())"
        )
        out = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
        )
        assert out.stdout.strip() == "from the parent"
    after = (
        constants.ENDPOINT,
        constants.HF_HUB_OFFLINE,
        os.environ.get("HF_ENDPOINT"),
        os.environ["HF_HUB_OFFLINE"],
    )
    assert after == before


def test_server_restarts_on_the_same_root(tmp_path):
    with LocalHubServer(tmp_path / "hub") as server, server.patch_client(cache_dir=tmp_path / "c1"):
        HfApi().create_repo(REPO)
        commit = HfApi().upload_file(path_or_fileobj=b"kept", path_in_repo="k.txt", repo_id=REPO).oid
    with LocalHubServer(tmp_path / "hub") as server, server.patch_client(cache_dir=tmp_path / "c2"):
        assert _read(REPO, "k.txt", commit) == "kept"


def test_dataset_repos(local_hub):
    api = HfApi()
    api.create_repo(REPO, repo_type="dataset")
    info = api.upload_file(
        path_or_fileobj=b"a,b\n1,2\n", path_in_repo="data/train.csv", repo_id=REPO, repo_type="dataset"
    )
    assert info.repo_url.repo_type == "dataset"
    assert api.dataset_info(REPO).sha == info.oid
    assert not api.repo_exists(REPO)  # a dataset, not a model
    path = huggingface_hub.hf_hub_download(REPO, "data/train.csv", repo_type="dataset")
    assert Path(path).read_bytes() == b"a,b\n1,2\n"
    assert [f.path for f in api.list_repo_tree(REPO, repo_type="dataset")] == ["data", ".gitattributes"]
