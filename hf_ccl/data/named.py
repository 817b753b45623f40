"""Named benchmark streams over the bundled datasets (`paths.data_root()`) and scikit-learn's digits.

`build_stream("domains5", max_train_per_task=500)` returns a `TaskStream`; `NAMED_STREAMS` maps each name to its
builder (`builder(root, common, **kwargs)`, where `common` holds the options shared by every builder).
"""

from __future__ import annotations

import inspect
import io
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features
from datasets import Image as ImageFeature
from PIL import Image

from ..paths import data_root as default_data_root
from .builders import (
    TaskSource,
    stream_by_class,
    stream_by_column,
    stream_by_time,
    stream_from_datasets,
    stream_random_split,
)
from .languages import FLICKR8K_LANGUAGES, flickr8k_languages
from .pair_streams import flickr_fashion_pairs_stream  # noqa: F401  (registers flickr-fashion-pairs)
from .stream_registry import NAMED_STREAMS, bundled, register
from .task import TaskStream

DIGIT_CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_TRAIN_TEMPLATES = ("a photo of the digit {label}.",)
DIGIT_EVAL_TEMPLATES = (
    "a photo of the digit {label}.",
    "a photo of the number {label}.",
    "a blurry photo of the digit {label}.",
    "a pixelated image of the handwritten digit {label}.",
    'a photo of the number: "{label}".',
)
RSSCN7_TRAIN_TEMPLATES = ("an aerial photo of a {label}.",)
RSSCN7_EVAL_TEMPLATES = (
    "an aerial photo of a {label}.",
    "a satellite photo of a {label}.",
    "an aerial view of a {label}.",
    "a remote sensing image of a {label}.",
    "{label} seen from above.",
)
PACS_TRAIN_TEMPLATES = {
    "photo": ("a photo of a {label}.",),
    "art_painting": ("a painting of a {label}.",),
    "cartoon": ("a cartoon of a {label}.",),
    "sketch": ("a sketch of a {label}.",),
}
PACS_EVAL_TEMPLATES = {
    "photo": (
        "a photo of a {label}.",
        "a good photo of a {label}.",
        "a close-up photo of the {label}.",
        "a photo of the {label}.",
    ),
    "art_painting": (
        "a painting of a {label}.",
        "an art painting of a {label}.",
        "a painting of the {label}.",
        "an oil painting of a {label}.",
    ),
    "cartoon": (
        "a cartoon of a {label}.",
        "a cartoon {label}.",
        "a drawing of a cartoon {label}.",
        "a cartoon of the {label}.",
    ),
    "sketch": (
        "a sketch of a {label}.",
        "a pencil sketch of a {label}.",
        "a black and white sketch of a {label}.",
        "a drawing of a {label}.",
    ),
}
PACS_DOMAINS = ("photo", "art_painting", "cartoon", "sketch")
FASHION_CATEGORIES = ("Apparel", "Accessories", "Footwear", "Personal Care")
#: End years of the `fashion-years` steps: <=2011 | 2012 | 2013-2015 | 2016 | 2017-2019.
FASHION_YEAR_BOUNDARIES = (2011, 2012, 2015, 2016, 2019)


COMMON_STREAM_OPTIONS = ("data_root", "seed", "max_train_per_task", "max_eval_per_task", "validate_images")


def stream_options(name: str) -> list[str]:
    """Every option `build_stream(name, ...)` accepts: the common ones, then the stream's own."""
    if name not in NAMED_STREAMS:
        raise ValueError(f"Unknown stream {name!r}; valid names: {', '.join(sorted(NAMED_STREAMS))}")
    own = [p.name for p in inspect.signature(NAMED_STREAMS[name]).parameters.values() if p.kind == p.KEYWORD_ONLY]
    return [*COMMON_STREAM_OPTIONS, *own]


def check_stream_options(name: str, options: dict[str, Any]) -> None:
    """Reject an unknown stream or option before any data is read, listing the valid ones."""
    valid = stream_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"Unknown option(s) {unknown} for stream {name!r}; valid options: {', '.join(valid)}")


def build_stream(
    name: str,
    *,
    data_root: str | Path | None = None,
    seed: int = 0,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    validate_images: bool = False,
    **kwargs: Any,
) -> TaskStream:
    """Build a named stream; `kwargs` go to its builder (e.g. `label_space="all"` for `digits`)."""
    check_stream_options(name, kwargs)
    root = Path(data_root) if data_root is not None else default_data_root()
    common = dict(
        seed=seed,
        max_train_per_task=max_train_per_task,
        max_eval_per_task=max_eval_per_task,
        validate_images=validate_images,
    )
    return NAMED_STREAMS[name](root, common, **kwargs)


def describe_streams() -> dict[str, str]:
    """Each named stream with the first line of its description."""
    return {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in sorted(NAMED_STREAMS.items())}


# ----------------------------------------------------------------------------------------------------------------
# scikit-learn digits as an image dataset
# ----------------------------------------------------------------------------------------------------------------


def _digit_png(pixels: np.ndarray, image_size: int) -> bytes:
    grey = np.clip(np.round(pixels * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    image = Image.fromarray(grey, mode="L").resize((image_size, image_size), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _stratified_split(labels: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train, evaluation = [], []
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        n_eval = int(round(len(rows) * eval_fraction))
        evaluation.append(rows[:n_eval])
        train.append(rows[n_eval:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(evaluation))


@lru_cache(maxsize=4)
def digits_dataset(image_size: int = 32, eval_fraction: float = 0.2, split_seed: int = 0) -> DatasetDict:
    """scikit-learn's 1797 8x8 digits as RGB PNG images (nearest upscaling, grey 0..16 -> 0..255), with a fixed
    stratified train/test split (`eval_fraction` of each class to test, by a permutation seeded by `split_seed`)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    labels = digits.target.astype(np.int64)
    features = Features({"image": ImageFeature(), "label": ClassLabel(names=list(DIGIT_CLASS_NAMES))})
    splits = dict(zip(("train", "test"), _stratified_split(labels, eval_fraction, split_seed), strict=True))
    data = {}
    for split, rows in splits.items():
        images = [{"bytes": _digit_png(digits.images[i], image_size), "path": None} for i in rows]
        data[split] = Dataset.from_dict({"image": images, "label": labels[rows].tolist()}, features=features)
    return DatasetDict(data)


# ----------------------------------------------------------------------------------------------------------------
# Named streams
# ----------------------------------------------------------------------------------------------------------------


@register("digits")
def digits_stream(
    root: Path, common: dict[str, Any], *, label_space: str = "task", image_size: int = 32
) -> TaskStream:
    """scikit-learn 8x8 digits, 5 class-incremental tasks {0,1}, {2,3}, ... {8,9}; zero-shot classification.

    By default (`label_space="task"`) each task is scored among its own two classes (task-incremental zero-shot:
    its `class_names` are e.g. ["two", "three"] and labels index them). Pass `label_space="all"` to keep all ten
    names (`DIGIT_CLASS_NAMES`) and global labels in every task, to score among all classes. Train/test is a fixed
    stratified 80/20 split; `image_size` is the upscaled side (nearest).
    """
    del root  # ships with scikit-learn
    groups = [[2 * i, 2 * i + 1] for i in range(5)]
    return stream_by_class(
        digits_dataset(image_size),
        None,
        groups,
        label_space=label_space,
        name="digits",
        task_names=[f"digits-{a}{b}" for a, b in groups],
        train_templates=DIGIT_TRAIN_TEMPLATES,
        eval_templates=DIGIT_EVAL_TEMPLATES,
        source="digits",
        **common,
    )


@register("flickr8k-random5")
def flickr8k_random5(
    root: Path, common: dict[str, Any], *, language: str = "en", n_tasks: int = 5
) -> TaskStream:
    """Flickr8k captions split at random into 5 equal tasks (Mod-X protocol); train split -> train, test -> eval.

    `language` picks the caption column (en, zh, de, fr, cs; ug/mn/bo have no test captions).
    """
    return stream_random_split(
        bundled(root, "flickr8k"),
        None,
        n_tasks,
        name="flickr8k-random5" if n_tasks == 5 else f"flickr8k-random{n_tasks}",
        text_column=language,
        eval_split="test",
        **common,
    )


@register("flickr8k-languages")
def flickr8k_languages_stream(
    root: Path, common: dict[str, Any], *, languages: tuple[str, ...] = FLICKR8K_LANGUAGES, eval_split: str = "auto"
) -> TaskStream:
    """Flickr8k one language per task (CLL-CLIP): en de fr cs zh ug bo mn by default, retrieval on shared eval images.

    Each task trains on the train images captioned in its language (plus `texts_en`, their English captions) and is
    scored on the same held-out images, those captioned in every language of the stream: `eval_split="auto"` takes
    test when every language has test captions (en de fr cs zh: 929 images), else validation (ug bo mn have none on
    test; all eight: 934 images). See `hf_ccl.data.languages`.
    """
    return flickr8k_languages(bundled(root, "flickr8k"), languages, name="flickr8k-languages", eval_split=eval_split,
                              **common)


def _pacs_task(root: Path, domain: str, name: str | None = None) -> TaskSource:
    if domain not in PACS_DOMAINS:
        raise ValueError(f"Unknown PACS domain {domain!r}; valid domains: {', '.join(PACS_DOMAINS)}")
    return TaskSource(
        name=name or domain,
        train=bundled(root, "pacs"),
        label_column="label",
        train_templates=PACS_TRAIN_TEMPLATES[domain],
        eval_templates=PACS_EVAL_TEMPLATES[domain],
        where={"domain": domain},
    )


@register("domains5")
def domains5(root: Path, common: dict[str, Any]) -> TaskStream:
    """Five domains: Flickr8k (captions) -> Fashion (product titles) -> RSSCN7 (aerial, classes) -> PACS
    art_painting -> PACS sketch (classes); retrieval for the first two, zero-shot classification after."""
    entries = [
        TaskSource(name="flickr8k", train=bundled(root, "flickr8k"), text_column="en"),
        TaskSource(name="fashion", train=bundled(root, "fashion"), text_column="title"),
        TaskSource(
            name="rsscn7",
            train=bundled(root, "rsscn7"),
            label_column="label",
            train_templates=RSSCN7_TRAIN_TEMPLATES,
            eval_templates=RSSCN7_EVAL_TEMPLATES,
        ),
        _pacs_task(root, "art_painting", "pacs-art_painting"),
        _pacs_task(root, "sketch", "pacs-sketch"),
    ]
    return stream_from_datasets(entries, name="domains5", **common)


@register("pacs-domains")
def pacs_domains(
    root: Path, common: dict[str, Any], *, domains: tuple[str, ...] = PACS_DOMAINS
) -> TaskStream:
    """PACS photo -> art_painting -> cartoon -> sketch: 7-class zero-shot classification, domain templates."""
    return stream_from_datasets(
        [_pacs_task(root, domain) for domain in domains], name="pacs-domains", **common
    )


@register("fashion-categories")
def fashion_categories(
    root: Path, common: dict[str, Any], *, categories: tuple[str, ...] = FASHION_CATEGORIES
) -> TaskStream:
    """Fashion products by `master_category` (P9D-like 'industries'): Apparel -> Accessories -> Footwear ->
    Personal Care, product titles as captions (retrieval).

    The tiny categories (Free Items: 6 products, Sporting Goods: 2, none of them or one in the test split) are dropped.
    """
    return stream_by_column(
        bundled(root, "fashion"),
        None,
        "master_category",
        list(categories),
        name="fashion-categories",
        task_names=[category.lower().replace(" ", "-") for category in categories],
        text_column="title",
        **common,
    )


@register("fashion-years")
def fashion_years(
    root: Path,
    common: dict[str, Any],
    *,
    boundaries: tuple[Any, ...] = FASHION_YEAR_BOUNDARIES,
    streaming: bool = False,
    shuffle_buffer: int | None = 1000,
) -> TaskStream:
    """Fashion titles by catalogue year, train/eval pairs: 2011 (<=2011) 517/135 | 2012 623/138 | 2013-2015 145/42 | 2016 201/49 | 2017-2019 122/27.

    TiC-CLIP-like time steps with product titles as captions (retrieval, R_mean). Years hold very different amounts
    of data (train 2010: 30, 2011: 487, 2012: 623, 2013: 38, 2014: 4, 2015: 103, 2016: 201, 2017: 109, 2018: 12,
    2019: 1; test 9, 126, 138, 12, 2, 28, 49, 23, 3, 1), so sparse years are merged until every step has over 100
    training and 25 eval pairs; the first step is named by its last year, as in TiC-CLIP. `boundaries` changes the steps (see `stream_by_time`). Image ids are `fashion/<split>/<product id>`.
    `streaming=True`: each task's train split is streamed from the folder (`load_dataset(streaming=True)`, filtered
    by year) through a shuffle buffer of `shuffle_buffer` rows; eval splits stay map-style.
    """
    return stream_by_time(
        bundled(root, "fashion"),
        None,
        "year",
        list(boundaries),
        name="fashion-years",
        text_column="title",
        id_column="id",
        streaming=streaming,
        shuffle_buffer=shuffle_buffer,
        **common,
    )

