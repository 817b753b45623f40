"""Named benchmark streams over the bundled datasets (`paths.data_root()`) and scikit-learn's digits.

`build_stream("domains5", max_train_per_task=500)` returns a `TaskStream`; `NAMED_STREAMS` maps each name to its
builder (`builder(root, common, **kwargs)`, where `common` holds the options shared by every builder).
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Mapping
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
    load_split,
    quiet_progress_bars,
    stream_by_class,
    stream_by_column,
    stream_by_time,
    stream_class_incremental,
    stream_from_datasets,
    stream_random_split,
)
from .cil import cil_cifar100  # noqa: F401  (registers cil-cifar100, cil-imagenet-r, cil-caltech101-bundled)
from .languages import FLICKR8K_LANGUAGES, flickr8k_languages
from .mtil import mtil_stream
from .pair_streams import flickr_fashion_pairs_stream  # noqa: F401  (registers flickr-fashion-pairs)
from .stream_registry import NAMED_STREAMS, bundled, register
from .task import TaskStream
from .templates import benchmark_templates
from .xtail import xtail_stream  # noqa: F401  (registers xtail, xtail-bundled)

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



# ----------------------------------------------------------------------------------------------------------------
# Classification streams: class-incremental CIFAR-10, a bundled MTIL-like stream, MTIL from the Hub
# ----------------------------------------------------------------------------------------------------------------


@register("cifar10-classes")
def cifar10_classes(
    root: Path,
    common: dict[str, Any],
    *,
    classes_per_step: int = 2,
    initial_classes: int | None = None,
    class_order: str | list[int | str] | None = None,
    label_space: str = "task",
) -> TaskStream:
    """The bundled CIFAR-10 subset, class-incremental: 5 tasks of 2 classes (airplane+automobile, bird+cat, ...).

    Train: 1000 images per class, eval: 500 per class (before `max_*_per_task`). Trains on "a photo of a {c}." and
    is scored with CLIP_benchmark's 18 CIFAR-10 templates. `classes_per_step`, `initial_classes` and `class_order`
    (None, "seed", a list of classes or a .yaml/.json file) are `stream_class_incremental`'s. By default
    (`label_space="task"`) each task's `class_names` are its own classes; scoring among all classes seen so far is
    the evaluator's business; `label_space="all"` keeps all ten names and global labels in every task.
    """
    templates = benchmark_templates("cifar10")
    return stream_class_incremental(
        bundled(root, "cifar10"),
        classes_per_step,
        initial_classes=initial_classes,
        class_order=class_order,
        label_space=label_space,
        name="cifar10-classes",
        train_templates=templates[:1],
        eval_templates=templates,
        source="cifar10",
        **common,
    )


CIFAR10_TRAIN_TEMPLATES = ("a photo of a {label}.",)
#: Fashion `sub_category` values with at least 25 train and 5 test products in the bundled data, and the class name
#: each is prompted with (e.g. `Lips` holds lipsticks, lip glosses and lip liners).
FASHION_SUBCATEGORIES = {
    "Topwear": "tops",
    "Shoes": "shoes",
    "Bags": "bags",
    "Bottomwear": "trousers",
    "Watches": "watches",
    "Innerwear": "underwear",
    "Jewellery": "jewellery",
    "Flip Flops": "flip flops",
    "Fragrance": "perfume",
    "Sandal": "sandals",
    "Eyewear": "sunglasses",
    "Lips": "lipstick",
}
FASHION_TRAIN_TEMPLATES = ("a product photo of {label}.",)
FASHION_EVAL_TEMPLATES = (
    "a product photo of {label}.",
    "a catalogue photo of {label}.",
    "a photo of {label}, a type of fashion product.",
    "{label} on a white background.",
    "an online shop photo of {label}.",
)
PACS_ALL_TRAIN_TEMPLATES = ("an image of a {label}.",)
PACS_ALL_EVAL_TEMPLATES = (
    "an image of a {label}.",
    "a photo of a {label}.",
    "a painting of a {label}.",
    "a cartoon of a {label}.",
    "a sketch of a {label}.",
)
#: The task keys of `mtil-bundled` in its two fixed orders (every task changes place from I to II).
MTIL_BUNDLED_ORDERS = {
    "I": ("digits", "cifar10", "rsscn7", "pacs", "fashion"),
    "II": ("rsscn7", "fashion", "cifar10", "digits", "pacs"),
}


@lru_cache(maxsize=2)
def fashion_subcategories(root: Path) -> DatasetDict:
    """The bundled Fashion products of the `FASHION_SUBCATEGORIES`, with `sub_category` as a `ClassLabel` column
    (12 classes; train 1397, test 358 products; the other 211 / 33 are left out)."""
    names = list(FASHION_SUBCATEGORIES)
    out = {}
    for split in ("train", "test"):
        data = load_split(bundled(root, "fashion"), split)
        values = data.with_format("arrow")["sub_category"].to_pylist()
        data = data.select([i for i, value in enumerate(values) if value in FASHION_SUBCATEGORIES])
        with quiet_progress_bars():
            out[split] = data.cast_column("sub_category", ClassLabel(names=names))
    return DatasetDict(out)


def _mtil_bundled_task(root: Path, key: str, pacs_domain: str) -> TaskSource:
    if key == "digits":
        return TaskSource(name="digits", train=digits_dataset(), label_column="label",
                          train_templates=DIGIT_TRAIN_TEMPLATES, eval_templates=DIGIT_EVAL_TEMPLATES, source="digits")
    if key == "cifar10":
        return TaskSource(name="cifar10", train=bundled(root, "cifar10"), label_column="label",
                          train_templates=CIFAR10_TRAIN_TEMPLATES, eval_templates=benchmark_templates("cifar10"))
    if key == "rsscn7":
        return TaskSource(name="rsscn7", train=bundled(root, "rsscn7"), label_column="label",
                          train_templates=RSSCN7_TRAIN_TEMPLATES, eval_templates=RSSCN7_EVAL_TEMPLATES)
    if key == "pacs":
        if pacs_domain == "all":
            return TaskSource(name="pacs", train=bundled(root, "pacs"), label_column="label",
                              train_templates=PACS_ALL_TRAIN_TEMPLATES, eval_templates=PACS_ALL_EVAL_TEMPLATES)
        return _pacs_task(root, pacs_domain, f"pacs-{pacs_domain}")
    return TaskSource(name="fashion", train=fashion_subcategories(root), label_column="sub_category",
                      class_names=list(FASHION_SUBCATEGORIES.values()), train_templates=FASHION_TRAIN_TEMPLATES,
                      eval_templates=FASHION_EVAL_TEMPLATES, source="fashion")


@register("mtil-bundled")
def mtil_bundled(
    root: Path,
    common: dict[str, Any],
    *,
    order: str = "I",
    tasks: tuple[str, ...] | None = None,
    pacs_domain: str = "sketch",
) -> TaskStream:
    """MTIL-like: five classification datasets in turn, each its own label space: digits -> cifar10 -> rsscn7 -> pacs-sketch -> fashion.

    Train/eval sizes (before `max_*_per_task`), classes:
    - `digits`: scikit-learn 8x8 digits at 32 px, 1438/359, the ten digit names;
    - `cifar10`: the bundled CIFAR-10 subset, 10000/5000, 10 classes, scored with CLIP_benchmark's 18 templates;
    - `rsscn7`: aerial scenes, 2260/540, 7 classes;
    - `pacs-sketch`: PACS sketches, 3122/807, 7 classes (dog, elephant, giraffe, guitar, horse, house, person).
      Sketches by default, as the PACS domain farthest from the other four tasks (photos would repeat CIFAR-10's
      natural photos and its dog and horse classes). `pacs_domain` picks another domain, or "all": the four
      domains as one 7-class task `pacs` (7959/2032) prompted "an image of a {label}." and scored with one template
      per domain;
    - `fashion`: product photos by `sub_category`, the 12 categories with at least 25 train and 5 test products
      (`FASHION_SUBCATEGORIES`: tops, shoes, bags, trousers, watches, underwear, jewellery, flip flops, perfume,
      sandals, sunglasses, lipstick), 1397/358, prompted "a product photo of {label}.".

    `order`: "I" (above) or "II" (rsscn7 -> fashion -> cifar10 -> digits -> pacs-sketch). `tasks`: any subset of
    digits, cifar10, rsscn7, pacs, fashion, in the order given (it replaces `order`).
    """
    if pacs_domain not in (*PACS_DOMAINS, "all"):
        raise ValueError(f"pacs_domain must be one of {[*PACS_DOMAINS, 'all']}, got {pacs_domain!r}")
    keys = _ordered_keys(MTIL_BUNDLED_ORDERS, MTIL_BUNDLED_ORDERS["I"], order, tasks)
    entries = [_mtil_bundled_task(root, key, pacs_domain) for key in keys]
    return stream_from_datasets(entries, name="mtil-bundled", **common)


#: The task keys of `mtil-heldout` in its two fixed orders: ZSCL's orders I and II (`hf_ccl.data.mtil.MTIL_ORDERS`)
#: of the MTIL datasets these stand in for (CIFAR-10 for CIFAR100, RSSCN7 for EuroSAT, DTD10 for DTD, MNIST), with
#: PACS photo (not an MTIL dataset) third in both.
MTIL_HELDOUT_ORDERS = {
    "I": ("cifar10", "dtd10", "pacs", "rsscn7", "mnist"),
    "II": ("mnist", "dtd10", "pacs", "rsscn7", "cifar10"),
}
#: Every task key `mtil-heldout` accepts in `tasks` (gtsrb and caltech101 only when named).
MTIL_HELDOUT_TASKS = ("cifar10", "dtd10", "pacs", "rsscn7", "mnist", "gtsrb", "caltech101")


def _clip_benchmark_task(root: Path, key: str, folder: str, templates: str) -> TaskSource:
    """A bundled class-label dataset trained on the first of its CLIP_benchmark templates and scored with all of
    them (ZSCL's convention); class names from its `label` ClassLabel (CLIP_benchmark's names)."""
    every = benchmark_templates(templates)
    return TaskSource(name=key, train=bundled(root, folder), label_column="label", train_templates=every[:1],
                      eval_templates=every)


def _mtil_heldout_task(root: Path, key: str, pacs_domain: str) -> TaskSource:
    if key in ("cifar10", "rsscn7"):
        return _mtil_bundled_task(root, key, pacs_domain)
    if key == "pacs":
        return _pacs_task(root, pacs_domain, f"pacs-{pacs_domain}")
    folder, templates = {"dtd10": ("dtd10", "dtd"), "mnist": ("mnist", "mnist"), "gtsrb": ("gtsrb", "gtsrb"),
                         "caltech101": ("caltech101", "caltech101")}[key]
    return _clip_benchmark_task(root, key, folder, templates)


def _ordered_keys(orders: Mapping[str, tuple[str, ...]], valid: tuple[str, ...], order: str,
                  tasks: tuple[str, ...] | None) -> tuple[str, ...]:
    """The task keys of an order, or `tasks` (checked: known, non-empty, none twice) when given."""
    if order not in orders:
        raise ValueError(f"order must be one of {list(orders)}, got {order!r}")
    if tasks is None:
        return orders[order]
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names ({', '.join(valid)}), got {tasks!r}")
    unknown = [task for task in tasks if task not in valid]
    if unknown:
        raise ValueError(f"tasks: unknown task(s) {unknown}; valid: {', '.join(valid)}")
    repeated = sorted({task for task in tasks if list(tasks).count(task) > 1})
    if repeated:
        raise ValueError(f"tasks names a task twice: {', '.join(repeated)}")
    return tuple(tasks)


@register("mtil-heldout")
def mtil_heldout(
    root: Path,
    common: dict[str, Any],
    *,
    order: str = "I",
    tasks: tuple[str, ...] | None = None,
    pacs_domain: str = "photo",
) -> TaskStream:
    """MTIL-like on datasets a model pretrained by `benchmarks/pretrain_start.py` never saw: cifar10 -> dtd10 -> pacs-photo -> rsscn7 -> mnist.

    Each task its own label space, scored task-aware by zero-shot accuracy; train/eval sizes before `max_*_per_task`:
    - `cifar10`: the bundled CIFAR-10 subset, 10000/5000, 10 classes, CLIP_benchmark's 18 templates;
    - `dtd10`: 10 DTD textures, 800/400, CLIP_benchmark's 8 `dtd` templates (trained on the first, as ZSCL);
    - `pacs-photo`: PACS photos, 7 classes (`pacs_domain` picks another domain);
    - `rsscn7`: aerial scenes, 2260/540, 7 classes;
    - `mnist`: MNIST digits "0".."9", 20000/10000, CLIP_benchmark's template;
    - `gtsrb` (43 traffic signs) and `caltech101` (102 classes) only when named in `tasks`.

    `order`: "I" (above, ZSCL's order I of the MTIL datasets these stand in for) or "II" (mnist -> dtd10 ->
    pacs-photo -> rsscn7 -> cifar10). `tasks`: any of the keys above in the order given (it replaces `order`).
    """
    if pacs_domain not in PACS_DOMAINS:
        raise ValueError(f"pacs_domain must be one of {list(PACS_DOMAINS)}, got {pacs_domain!r}")
    keys = _ordered_keys(MTIL_HELDOUT_ORDERS, MTIL_HELDOUT_TASKS, order, tasks)
    entries = [_mtil_heldout_task(root, key, pacs_domain) for key in keys]
    return stream_from_datasets(entries, name="mtil-heldout", **common)


@register("mtil")
def mtil(
    root: Path,
    common: dict[str, Any],
    *,
    order: str = "I",
    datasets: tuple[str, ...] | None = None,
    revision: str | dict[str, str] | None = None,
    sources: dict[str, str] | None = None,
    holdout_fraction: float = 0.2,
) -> TaskStream:
    """MTIL (ZSCL): 11 classification datasets from the Hub (clip-benchmark/wds_*), order I or II; see `hf_ccl.data.mtil`.

    Downloads every split in full (tens of GB); `max_train_per_task` subsamples after loading. `datasets` picks a
    subset in its own order; `revision` pins the repos; `sources` maps a dataset to another repo or a local folder
    with the same layout. The data root is not used.
    """
    del root
    return mtil_stream(order, list(datasets) if datasets is not None else None, revision=revision, sources=sources,
                       holdout_fraction=holdout_fraction, name=f"mtil-{order}" if datasets is None else "mtil",
                       **common)
