"""A language-incremental stream: one task per caption language of a multilingual image-caption dataset.

This is CLL-CLIP's continual language learning setting (spec `cllclip.md` §1: one language per task, English
first, retrieval in both directions on every language learned so far) on the bundled multilingual Flickr8k:

- train of task `<lang>`: the train-split images that have captions in `<lang>`; `texts` are those captions, and an
  extra column `texts_en` holds the image's English captions (the cross-lingual teacher's input x^E of CLL-CLIP,
  spec §2.1; for English it equals `texts`);
- eval of every task: the same held-out images, those with captions in *every* language of the stream (so the
  results matrix compares languages on one image set); `texts` are that language's captions.

Uyghur, Mongolian and Tibetan have no test-split captions, so a stream with any of them evaluates on the validation
split (`eval_split="auto"`). Bundled counts (images with captions in every language): validation 934 for all eight
languages; test 929 for en, de, fr, cs, zh.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset, List, Value

from . import dropped as drops
from .builders import DatasetSource, load_split, subsample, to_canonical
from .builders import validate_images as check_images
from .sources import image_base
from .task import Task, TaskStream

FLICKR8K_LANGUAGES = ("en", "de", "fr", "cs", "zh", "ug", "bo", "mn")
ENGLISH_COLUMN = "texts_en"


def _captions(value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else list(value or [])
    return [item.strip() for item in items if isinstance(item, str) and item.strip()]


def _caption_lists(dataset: Dataset, column: str) -> list[list[str]]:
    return [_captions(value) for value in dataset.with_format("arrow")[column].to_pylist()]


def rows_with_captions(dataset: Dataset, languages: Sequence[str]) -> np.ndarray:
    """Rows that have at least one caption in every one of `languages`."""
    keep = np.ones(len(dataset), dtype=bool)
    for language in languages:
        keep &= np.asarray([bool(c) for c in _caption_lists(dataset, language)], dtype=bool)
    return np.flatnonzero(keep).astype(np.int64)


def pick_eval_split(data: DatasetSource, languages: Sequence[str], candidates: Sequence[str] = ("test", "validation")) -> str:
    """The first split in `candidates` with at least one image captioned in every language."""
    for split in candidates:
        try:
            dataset = load_split(data, split)
        except (KeyError, ValueError):
            continue
        if len(rows_with_captions(dataset, languages)):
            return split
    raise ValueError(f"No split among {list(candidates)} has an image with captions in every language of {list(languages)}")


def _language_split(
    dataset: Dataset, rows: np.ndarray, language: str, *, source: str, split: str, english: str, data: DatasetSource
) -> Dataset:
    built = to_canonical(dataset, source=source, split=split, text_column=language, indices=rows.tolist(),
                         base=image_base(data, split))
    if len(built) != len(rows):  # to_canonical drops rows without captions: none are left by construction
        raise RuntimeError(f"{source}/{split}/{language}: {len(built)} rows built from {len(rows)}")
    all_english = _caption_lists(dataset, english) if english in dataset.column_names else [[] for _ in range(len(dataset))]
    texts_en = [all_english[row] for row in rows.tolist()]
    return built.add_column(ENGLISH_COLUMN, texts_en, feature=List(Value("string")))


def language_stream(
    data: DatasetSource,
    languages: Sequence[str],
    *,
    name: str = "languages",
    source: str = "dataset",
    english: str = "en",
    train_split: str = "train",
    eval_split: str = "auto",
    seed: int = 0,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    validate_images: bool = False,
) -> TaskStream:
    """One retrieval task per language (a caption column of `data`), in the given order. See the module docstring.

    `eval_split="auto"`: the first of test, validation with images captioned in every language. The eval images
    (at most `max_eval_per_task`, one seeded choice shared by all tasks) are the same for every task; the train
    images of each task (at most `max_train_per_task`) are drawn per language.
    """
    languages = list(languages)
    if not languages:
        raise ValueError("A language stream needs at least one language")
    if len(set(languages)) != len(languages):
        raise ValueError(f"Languages {languages} name a language twice")
    train = load_split(data, train_split)
    missing = [language for language in languages if language not in train.column_names]
    if missing:
        raise ValueError(f"No caption column {missing} in {source!r}; its columns: {', '.join(train.column_names)}")
    split = pick_eval_split(data, languages) if eval_split == "auto" else eval_split
    evaluation = load_split(data, split)
    captioned = rows_with_captions(evaluation, languages)
    if not len(captioned):
        raise ValueError(f"Split {split!r} of {source!r} has no image with captions in every language of {languages}")
    eval_rows = subsample(captioned, max_eval_per_task, seed, name, "eval")
    eval_dropped: drops.SplitCounts = {}
    drops.count(eval_dropped, "eval", drops.NO_CAPTION_IN_EVERY_LANGUAGE, len(evaluation) - len(captioned))
    drops.count(eval_dropped, "eval", drops.over_limit("eval"), len(captioned) - len(eval_rows))
    tasks: list[Task] = []
    for language in languages:
        usable = rows_with_captions(train, [language])
        train_rows = subsample(usable, max_train_per_task, seed, name, language, "train")
        if not len(train_rows):
            raise ValueError(f"Split {train_split!r} of {source!r} has no caption in {language!r}")
        dropped = {split: dict(reasons) for split, reasons in eval_dropped.items()}
        drops.count(dropped, "train", drops.NO_CAPTION, len(train) - len(usable))
        drops.count(dropped, "train", drops.over_limit("train"), len(usable) - len(train_rows))
        task_train = _language_split(train, train_rows, language, source=source, split=train_split, english=english,
                                     data=data)
        task_eval = _language_split(evaluation, eval_rows, language, source=source, split=split, english=english,
                                    data=data)
        if validate_images:
            check_images(task_train, f"stream {name!r}, task {language!r}, split {train_split!r}")
            if not tasks:
                check_images(task_eval, f"stream {name!r}, eval split {split!r}")
        tasks.append(Task(name=language, train=task_train, eval=task_eval, kind="retrieval", source=source,
                          dropped=dropped))
    stream = TaskStream(name=name, tasks=tasks)
    drops.log_dropped(stream)
    return stream


def flickr8k_languages(
    folder: str | Path,
    languages: Sequence[str] = FLICKR8K_LANGUAGES,
    **options: Any,
) -> TaskStream:
    """`language_stream` over the bundled multilingual Flickr8k folder (languages en de fr cs zh ug bo mn)."""
    unknown = [language for language in languages if language not in FLICKR8K_LANGUAGES]
    if unknown:
        raise ValueError(f"Unknown Flickr8k language(s) {unknown}; valid: {', '.join(FLICKR8K_LANGUAGES)}")
    return language_stream(folder, languages, source="flickr8k", **options)
