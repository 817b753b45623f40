"""The MTIL stream (ZSCL, MoE-Adapters): fine-tuning CLIP on eleven classification datasets in turn.

`mtil_stream(order="I")` builds one classification task per dataset, each with its own label space, class names
and prompt templates, from CLIP_benchmark's webdataset copies on the Hub (`clip-benchmark/wds_*`):

- order I (ZSCL `mtil/scripts/ZSCL.sh`): Aircraft, Caltech101, CIFAR100, DTD, EuroSAT, Flowers, Food, MNIST,
  OxfordPet, StanfordCars, SUN397;
- order II (ZSCL `mtil/scripts/ZSCL_minus.sh`): StanfordCars, Food, MNIST, OxfordPet, Flowers, SUN397, Aircraft,
  Caltech101, DTD, EuroSAT, CIFAR100.

Layout of a `clip-benchmark/wds_*` repo (written by CLIP_benchmark's `webdataset_builder.py`)::

    classnames.txt                           one class name per line, line k = label k
    zeroshot_classification_templates.txt    one template per line, `{c}` for the class name
    train/0.tar, train/1.tar, ...            shards of up to 10,000 samples: s0000000.webp + s0000000.cls
    train/nshards.txt                        the number of shards
    test/0.tar, ..., test/nshards.txt

`datasets` reads a shard as the columns `webp` (an `Image`; `png` or `jpg` in some repos), `cls` (int64),
`__key__` and `__url__`. `wds_sun397` has a test split only: its train/eval split is made here (see
`holdout_fraction`). The splits are CLIP_benchmark's (VTAB's train splits for the `wds_vtab-*` repos), not the
torchvision splits ZSCL trains on, so sizes differ from the paper.

**Do not read these repos with `load_dataset(repo_id)`**: with a single shard in a split, `train/0.tar` and
`train/nshards.txt` tie for the most common file type and `datasets` infers the `text` builder, returning one row
`{"text": "1"}` per split (measured with datasets 5.2 on a local Hub server; on the Hub, the parquet conversions of
`wds_fgvc_aircraft` and `wds_vtab-pets` are 715-byte tables, as that mistake would give). `load_wds_classification` lists the shards itself and reads them with the
`webdataset` builder (`hf://datasets/<repo>@<commit>/<split>/<k>.tar`), pinned to one commit per repo.

As in ZSCL, a task trains on the first template of its dataset and is scored with all of them. Each task is scored
among its own classes (`Task.class_names`); the whole of each split is downloaded (tens of GB for all eleven
datasets), and `max_train_per_task` / `max_eval_per_task` subsample after loading.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset, DatasetDict, load_dataset
from datasets import Image as ImageFeature

from .builders import TaskSource, check_builder_options, quiet_progress_bars, stream_from_datasets
from .task import TaskStream
from .templates import PLACEHOLDERS

logger = logging.getLogger(__name__)

#: Each MTIL dataset (ZSCL's name) and its CLIP_benchmark webdataset repo on the Hub.
MTIL_REPOS: dict[str, str] = {
    "Aircraft": "clip-benchmark/wds_fgvc_aircraft",
    "Caltech101": "clip-benchmark/wds_vtab-caltech101",
    "CIFAR100": "clip-benchmark/wds_vtab-cifar100",
    "DTD": "clip-benchmark/wds_dtd",
    "EuroSAT": "clip-benchmark/wds_vtab-eurosat",
    "Flowers": "clip-benchmark/wds_vtab-flowers",
    "Food": "clip-benchmark/wds_food101",
    "MNIST": "clip-benchmark/wds_mnist",
    "OxfordPet": "clip-benchmark/wds_vtab-pets",
    "StanfordCars": "clip-benchmark/wds_cars",
    "SUN397": "clip-benchmark/wds_sun397",
}
#: The two dataset orders of the MTIL benchmark (ZSCL `mtil/scripts/ZSCL.sh` and `ZSCL_minus.sh`).
MTIL_ORDERS: dict[str, tuple[str, ...]] = {
    "I": ("Aircraft", "Caltech101", "CIFAR100", "DTD", "EuroSAT", "Flowers", "Food", "MNIST", "OxfordPet",
          "StanfordCars", "SUN397"),
    "II": ("StanfordCars", "Food", "MNIST", "OxfordPet", "Flowers", "SUN397", "Aircraft", "Caltech101", "DTD",
           "EuroSAT", "CIFAR100"),
}
#: Other spellings accepted in `datasets`, `revision` and `sources` (matched case-insensitively).
MTIL_ALIASES = {"cars": "StanfordCars", "pets": "OxfordPet", "food101": "Food", "flowers102": "Flowers",
                "fgvc_aircraft": "Aircraft", "eurosat": "EuroSAT"}
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
IMAGE_KEYS = ("webp", "png", "jpg", "jpeg")
LABEL_KEY = "cls"
#: Seed of the stratified train/eval split of a repo with one split (SUN397); fixed so that every run, whatever
#: its `seed`, is scored on the same images.
HOLDOUT_SEED = 0


@dataclass
class WdsClassification:
    """A CLIP_benchmark webdataset classification dataset, read: its splits (columns `cls`, an image key, `__key__`,
    `__url__`), class names, templates, the image column, where it came from, and the commit read (Hub only)."""

    origin: str
    splits: dict[str, Dataset]
    class_names: list[str]
    templates: list[str]
    image_column: str
    commit: str | None = None


def mtil_dataset_name(name: str, option: str = "datasets") -> str:
    """ZSCL's name of an MTIL dataset from any accepted spelling (case-insensitive; `Cars` for `StanfordCars`)."""
    if isinstance(name, str):
        by_lower = {key.lower(): key for key in MTIL_REPOS} | MTIL_ALIASES
        found = by_lower.get(name.lower())
        if found is not None:
            return found
    raise ValueError(f"{option}: unknown MTIL dataset {name!r}; valid names: {', '.join(MTIL_REPOS)}")


def _shard_key(path: str) -> tuple[int, str]:
    stem = path.rsplit("/", 1)[-1].removesuffix(".tar")
    return (int(stem), path) if stem.isdigit() else (-1, path)


def _shards_by_split(files: Sequence[str], splits: Sequence[str]) -> dict[str, list[str]]:
    """The `.tar` shards directly under each split folder, in shard order (`2.tar` before `10.tar`)."""
    found = {}
    for split in splits:
        shards = [f for f in files if re.fullmatch(rf"{re.escape(split)}/[^/]+\.tar", f)]
        if shards:
            found[split] = sorted(shards, key=_shard_key)
    return found


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _is_local(source: str | os.PathLike[str]) -> bool:
    text = os.fspath(source)
    return isinstance(source, os.PathLike) or Path(text).expanduser().exists() or text.startswith((".", "/", "~"))


def load_wds_classification(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    splits: Sequence[str] = ("train", "test"),
    cache_dir: str | os.PathLike[str] | None = None,
) -> WdsClassification:
    """Read a CLIP_benchmark webdataset classification repo (see the module docstring): a Hub dataset id (read at
    `revision`, resolved to one commit) or a local folder with the same layout (a `snapshot_download` copy).

    Only the `splits` that have shards are returned (at least one must). Raises `ValueError` naming the repo for a
    missing `classnames.txt`, no shards, no image or `cls` column, or a template without a placeholder; a repo
    without a templates file gets `"a photo of a {c}."` (with a warning).
    """
    origin = os.fspath(source)
    commit = None
    if _is_local(source):
        folder = Path(origin).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"MTIL dataset folder {origin!r} not found")
        if revision is not None:
            raise ValueError(f"revision={revision!r} given for the local folder {origin!r}; a folder has none")
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

        def read_text(name: str) -> str | None:
            path = folder / name
            return path.read_text(encoding="utf-8") if path.is_file() else None

        def location(path: str) -> str:
            return str(folder / path)
    else:
        from huggingface_hub import HfApi, hf_hub_download

        api = HfApi()
        commit = api.dataset_info(origin, revision=revision).sha
        files = api.list_repo_files(origin, repo_type="dataset", revision=commit)

        def read_text(name: str) -> str | None:
            if name not in files:
                return None
            path = hf_hub_download(origin, name, repo_type="dataset", revision=commit)
            return Path(path).read_text(encoding="utf-8")

        def location(path: str) -> str:
            return f"hf://datasets/{origin}@{commit}/{path}"

    classnames = read_text(CLASSNAMES_FILE)
    if classnames is None or not _lines(classnames):
        raise ValueError(f"MTIL dataset {origin!r} has no {CLASSNAMES_FILE} (or it is empty); files: "
                         f"{', '.join(f for f in files if '/' not in f)}")
    templates_text = read_text(TEMPLATES_FILE)
    templates = _lines(templates_text or "")
    if not templates:
        logger.warning("MTIL dataset %r has no %s: using 'a photo of a {c}.'", origin, TEMPLATES_FILE)
        templates = ["a photo of a {c}."]
    bad = [t for t in templates if not any(p in t for p in PLACEHOLDERS)]
    if bad:
        raise ValueError(f"MTIL dataset {origin!r}: templates without a placeholder ({', '.join(PLACEHOLDERS)}): "
                         f"{bad}")
    shards = _shards_by_split(files, splits)
    if not shards:
        folders = sorted({f.split("/")[0] for f in files if f.endswith(".tar")})
        raise ValueError(f"MTIL dataset {origin!r} has no .tar shards in split folders {list(splits)}; folders "
                         f"with shards: {folders}")
    data_files = {split: [location(path) for path in paths] for split, paths in shards.items()}
    with quiet_progress_bars():
        loaded = load_dataset("webdataset", data_files=data_files, cache_dir=cache_dir)
    first = next(iter(loaded.values()))
    images = [key for key in IMAGE_KEYS if isinstance(first.features.get(key), ImageFeature)]
    if not images or LABEL_KEY not in first.column_names:
        raise ValueError(f"MTIL dataset {origin!r}: expected an image column ({', '.join(IMAGE_KEYS)}) and a "
                         f"{LABEL_KEY!r} column; its columns are {', '.join(first.column_names)}")
    return WdsClassification(origin, dict(loaded), _lines(classnames), templates, images[0], commit)


def stratified_holdout(labels: Sequence[int], fraction: float, seed: int = HOLDOUT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(kept rows, held-out rows): `fraction` of each class's rows, chosen by a permutation seeded by `seed`, held
    out (at least one row of each class with two or more)."""
    label_array = np.asarray(labels)
    rng = np.random.default_rng(seed)
    kept, held = [], []
    for label in np.unique(label_array):
        rows = rng.permutation(np.flatnonzero(label_array == label))
        n_held = min(max(int(round(len(rows) * fraction)), 1), len(rows) - 1) if len(rows) > 1 else 0
        held.append(rows[:n_held])
        kept.append(rows[n_held:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


def _train_eval(data: WdsClassification, train_split: str, eval_split: str, fraction: float) -> DatasetDict:
    """The train and eval splits of a dataset; a dataset with only one of them is split (`stratified_holdout`)."""
    if train_split in data.splits and eval_split in data.splits:
        return DatasetDict({"train": data.splits[train_split], "test": data.splits[eval_split]})
    only = next(iter(data.splits.values()))
    kept, held = stratified_holdout(only.with_format("arrow")[LABEL_KEY].to_pylist(), fraction)
    logger.info("MTIL dataset %r has only split %r: %d rows to train, %d to eval (stratified, %.0f%% held out)",
                data.origin, next(iter(data.splits)), len(kept), len(held), 100 * fraction)
    return DatasetDict({"train": only.select(kept), "test": only.select(held)})


def _per_dataset(value: Any, option: str) -> dict[str, Any]:
    """A mapping option (`revision`, `sources`) keyed by ZSCL's dataset names."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{option} must be a mapping of MTIL dataset names, got {type(value).__name__}")
    return {mtil_dataset_name(key, option): item for key, item in value.items()}


def mtil_dataset_list(order: str = "I", datasets: Sequence[str] | None = None) -> list[str]:
    """The datasets of an MTIL stream, checked: `datasets` (any subset, in its own order) or the order's eleven."""
    if order not in MTIL_ORDERS:
        raise ValueError(f"order must be one of {list(MTIL_ORDERS)}, got {order!r}")
    if datasets is None:
        return list(MTIL_ORDERS[order])
    if isinstance(datasets, str) or not isinstance(datasets, Sequence) or not datasets:
        raise ValueError(f"datasets must be a non-empty list of MTIL dataset names, got {datasets!r}")
    names = [mtil_dataset_name(name) for name in datasets]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"datasets names a dataset twice: {', '.join(repeated)}")
    return names


def mtil_stream(
    order: str = "I",
    datasets: Sequence[str] | None = None,
    *,
    revision: str | Mapping[str, str] | None = None,
    sources: Mapping[str, str | os.PathLike[str]] | None = None,
    holdout_fraction: float = 0.2,
    name: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """The MTIL stream: one classification task per dataset, in `order` ("I" or "II", see the module docstring),
    or `datasets` (any subset of the eleven, in the order given; `Cars` is accepted for `StanfordCars`).

    Task `k` is named after its dataset (ZSCL's names); its `class_names` come from the repo's `classnames.txt`,
    labels index them (each task its own label space), it trains on the first line of
    `zeroshot_classification_templates.txt` and is scored with all of them. Image ids are
    `"<dataset, lower case>/<train|test>/<row>"`.

    - `revision`: one revision for every repo, or a mapping dataset -> revision (a branch, tag or commit); each repo
      is read at the single commit it resolves to.
    - `sources`: dataset -> another Hub repo id or a local folder with the same layout (e.g. a `snapshot_download`
      copy), instead of `MTIL_REPOS`.
    - `holdout_fraction`: for a repo with one split only (`wds_sun397`: test), the fraction of each class held out
      for eval (stratified, fixed seed); the rest trains. ZSCL splits SUN397 80/20 at random.
    - `cache_dir`: where `datasets` keeps the Arrow files (default: its own cache).

    Every option is checked before anything is downloaded; an error names the option.
    """
    names = mtil_dataset_list(order, datasets)
    check_builder_options(dict(max_train_per_task=max_train_per_task, max_eval_per_task=max_eval_per_task,
                               validate_images=validate_images))
    entries = mtil_task_sources(names, revision=revision, sources=sources, holdout_fraction=holdout_fraction,
                                cache_dir=cache_dir)
    default_name = f"mtil-{order}" if datasets is None else "mtil"
    return stream_from_datasets(entries, name=name or default_name, max_train_per_task=max_train_per_task,
                                max_eval_per_task=max_eval_per_task, seed=seed, validate_images=validate_images)


def mtil_task_sources(
    names: Sequence[str],
    *,
    revision: str | Mapping[str, str] | None = None,
    sources: Mapping[str, str | os.PathLike[str]] | None = None,
    holdout_fraction: float = 0.2,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[TaskSource]:
    """One `TaskSource` per MTIL dataset of `names` (ZSCL's names, checked), read as `mtil_stream` reads them (see
    its options): trained on the repo's first template, scored with all of them. Options are checked before any
    download."""
    if isinstance(holdout_fraction, bool) or not isinstance(holdout_fraction, (int, float)) or not (
            0 < holdout_fraction < 1):
        raise ValueError(f"holdout_fraction must be a number in (0, 1), got {holdout_fraction!r}")
    if revision is not None and not isinstance(revision, (str, Mapping)):
        raise ValueError(f"revision must be a string, a mapping of dataset names or None, got {revision!r}")
    revisions = _per_dataset(revision, "revision") if isinstance(revision, Mapping) else dict.fromkeys(names, revision)
    where = {**MTIL_REPOS, **(_per_dataset(sources, "sources") if sources is not None else {})}
    for key, source in where.items():
        if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
            raise ValueError(f"sources.{key} must be a Hub dataset id or a local folder, got {source!r}")
    entries = []
    for dataset in names:
        data = load_wds_classification(where[dataset], revision=revisions.get(dataset), cache_dir=cache_dir)
        if data.commit is not None:  # what to pin (`revision`) to read the same data again
            logger.info("MTIL dataset %s: %s at commit %s", dataset, data.origin, data.commit)
        entries.append(
            TaskSource(
                name=dataset,
                train=_train_eval(data, "train", "test", float(holdout_fraction)),
                label_column=LABEL_KEY,
                class_names=data.class_names,
                train_templates=data.templates[:1],
                eval_templates=data.templates,
                image_column=data.image_column,
                source=dataset.lower(),
                dataset_id=data.origin if data.commit is not None else None,  # a Hub repo, read at one commit
                dataset_revision=data.commit,
            )
        )
    return entries
