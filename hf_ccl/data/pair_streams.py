"""Pair streams (CMCL's setting: every task aligns two named modalities) from the bundled data: Flickr8k (images with English, German, French, ... captions) and
Fashion (product photos with titles).

The default stream (issue 7) has four tasks, with both kinds of CMCL step (spec cmcl.md §1.2): a new pair that
shares one modality with an earlier one, and an earlier pair on a new domain:

1. `flickr-image-en`:  image – en   (Flickr8k photos, English captions)
2. `flickr-en-de`:     en – de      (Flickr8k English–German caption pairs)
3. `flickr-image-de`:  image – de   (Flickr8k photos, German captions)
4. `fashion-image-en`: image – en   (Fashion product photos, product titles, read by the `en` head)

Every Flickr task trains on its own images (a seeded, disjoint share of the train split, after the
`reserve_train_images` held back e.g. to pretrain the frozen prior); every Flickr task tests on the same seeded
test images (those captioned in every language the stream uses). One caption per image and language is drawn with
a seeded generator, so a row is one pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset

from .builders import load_split
from .languages import FLICKR8K_LANGUAGES, rows_with_captions
from .stream_registry import bundled, register
from .task import Task, TaskStream

#: (dataset, modality a, modality b) of the default stream.
DEFAULT_PAIRS: tuple[tuple[str, str, str], ...] = (
    ("flickr8k", "image", "en"),
    ("flickr8k", "en", "de"),
    ("flickr8k", "image", "de"),
    ("fashion", "image", "en"),
)
IMAGE = "image"


def _pick_captions(captions: Sequence[Sequence[str]], rng: np.random.Generator) -> list[str]:
    return [str(options[int(rng.integers(len(options)))]) for options in captions]


def _flickr_split(dataset: Dataset, rows: np.ndarray, modalities: Sequence[str], seed: int) -> Dataset:
    """One pair per row: the image (kept as stored) and/or one seeded caption per language."""
    subset = dataset.select(rows.tolist())
    keep = ["image_id"] + ([IMAGE] if IMAGE in modalities else [])
    built = subset.select_columns(keep)
    rng = np.random.default_rng(seed)
    for modality in modalities:
        if modality != IMAGE:
            built = built.add_column(modality, _pick_captions(subset[modality], rng))
    return built


def _fashion_split(dataset: Dataset, rows: np.ndarray, title_modality: str) -> Dataset:
    subset = dataset.select(rows.tolist()).select_columns(["id", IMAGE, "title"])
    return subset.rename_columns({"id": "image_id", "title": title_modality})


def flickr_fashion_pairs(
    data_root: str | Path,
    pairs: Sequence[tuple[str, str, str]] = DEFAULT_PAIRS,
    *,
    train_per_task: int = 500,
    test_per_task: int = 500,
    reserve_train_images: int = 0,
    reserve_seed: int = 0,
    seed: int = 0,
) -> TaskStream:
    """A pair stream over the bundled Flickr8k and Fashion data (see the module docstring).

    `pairs` lists (dataset, modality_a, modality_b): dataset `flickr8k` takes the modalities `image` and any caption
    language (en, de, fr, cs, zh, ...); `fashion` takes `image` and one text modality, which reads the product
    titles. Task names are `<flickr|fashion>-<a>-<b>`. The reserved images depend on `reserve_seed` only, so
    streams of every `seed` leave out the same ones (`flickr_reserved_rows`)."""
    root = Path(data_root)
    if train_per_task < 1 or test_per_task < 1:
        raise ValueError("train_per_task and test_per_task must be >= 1")
    for dataset_name, a, b in pairs:
        if dataset_name == "flickr8k":
            bad = [m for m in (a, b) if m != IMAGE and m not in FLICKR8K_LANGUAGES]
            if bad:
                raise ValueError(
                    f"flickr8k pairs take 'image' or a language of {FLICKR8K_LANGUAGES}, got {bad}"
                )
        elif dataset_name == "fashion":
            if IMAGE not in (a, b) or a == b:
                raise ValueError(f"fashion pairs are (image, <title modality>), got ({a}, {b})")
        else:
            raise ValueError(f"unknown pair dataset {dataset_name!r}; valid: flickr8k, fashion")
    languages = sorted({m for d, a, b in pairs if d == "flickr8k" for m in (a, b) if m != IMAGE})
    flickr_tasks = [i for i, (d, _, _) in enumerate(pairs) if d == "flickr8k"]
    tasks: list[Task] = []
    if flickr_tasks:
        flickr = bundled(root, "flickr8k")
        train, test = load_split(flickr, "train"), load_split(flickr, "test")
        train_rows = np.random.default_rng(reserve_seed).permutation(rows_with_captions(train, languages))
        train_rows = np.random.default_rng(seed).permutation(train_rows[reserve_train_images:])
        needed = train_per_task * len(flickr_tasks)
        if len(train_rows) < needed:
            raise ValueError(
                f"{len(flickr_tasks)} flickr8k tasks x {train_per_task} images need {needed} train images captioned "
                f"in {languages}; {len(train_rows)} are left after reserving {reserve_train_images}"
            )
        test_rows = rows_with_captions(test, languages)
        test_rows = np.sort(np.random.default_rng(seed + 1).permutation(test_rows)[:test_per_task])
    fashion_data = None
    for index, (dataset_name, a, b) in enumerate(pairs):
        name = f"{'flickr' if dataset_name == 'flickr8k' else dataset_name}-{a}-{b}"
        if dataset_name == "flickr8k":
            share = flickr_tasks.index(index)
            rows = np.sort(train_rows[share * train_per_task : (share + 1) * train_per_task])
            task_train = _flickr_split(train, rows, (a, b), seed + 10 + index)
            task_test = _flickr_split(test, test_rows, (a, b), seed + 100 + index)
        else:
            if fashion_data is None:
                fashion_root = bundled(root, "fashion")
                fashion_data = load_split(fashion_root, "train"), load_split(fashion_root, "test")
            title = b if a == IMAGE else a
            rng = np.random.default_rng(seed + 1000 + index)
            fashion_train, fashion_test = fashion_data
            rows = np.sort(rng.permutation(len(fashion_train))[:train_per_task])
            test_rows_f = np.sort(rng.permutation(len(fashion_test))[:test_per_task])
            task_train = _fashion_split(fashion_train, rows, title)
            task_test = _fashion_split(fashion_test, test_rows_f, title)
        tasks.append(Task(name=name, train=task_train, eval=task_test, kind="pair", modalities=(a, b),
                          source=dataset_name))
    return TaskStream(name="flickr-fashion-pairs", tasks=tasks)


@register("flickr-fashion-pairs")
def flickr_fashion_pairs_stream(
    root: Path,
    common: dict[str, Any],
    *,
    pairs: Sequence[Sequence[str]] = DEFAULT_PAIRS,
    reserve_train_images: int = 0,
    reserve_seed: int = 0,
) -> TaskStream:
    """Pair tasks (CMCL): image-en, en-de, image-de on Flickr8k, then image-en on Fashion (train with learner_heads).

    `max_train_per_task` / `max_eval_per_task` are the pairs per task (default 500 each); `pairs` lists
    [dataset, modality_a, modality_b]; `reserve_train_images` Flickr8k train images are left out of every task."""
    if common.get("validate_images"):
        raise ValueError("flickr-fashion-pairs: validate_images is not supported (the images are read once, by the "
                         "frozen encoder, which names a bad row)")
    return flickr_fashion_pairs(
        root, [(dataset, a, b) for dataset, a, b in pairs], train_per_task=common.get("max_train_per_task") or 500,
        test_per_task=common.get("max_eval_per_task") or 500, reserve_train_images=reserve_train_images,
        reserve_seed=reserve_seed, seed=common.get("seed", 0),
    )


def flickr_reserved_rows(
    data_root: str | Path, count: int, languages: Sequence[str] = ("en", "de"), reserve_seed: int = 0
) -> np.ndarray:
    """The Flickr8k train rows that `flickr_fashion_pairs(..., reserve_train_images=count,
    reserve_seed=reserve_seed)` holds back (to pretrain a frozen prior on images no task trains on), for streams
    whose Flickr modalities are `languages` (and images)."""
    train = load_split(bundled(Path(data_root), "flickr8k"), "train")
    rows = rows_with_captions(train, sorted(set(languages)))
    return np.sort(np.random.default_rng(reserve_seed).permutation(rows)[:count])
