"""X-TAIL: cross-domain task-agnostic incremental learning (Xu et al., NeurIPS 2024, "Advancing Cross-domain
Discriminability in Continual Learning of Vision-Language Models" (RAIL), arXiv 2406.18868; also LADA, arXiv
2505.23271).

A learner trains on ten domains in turn, few-shot (16 images per class), and after every domain classifies the test
images of all ten, seen and unseen, with no domain identity: each image is scored among the union of the class
names of every domain of the stream. In hf_ccl that scoring is the `"all"` class scope (`class_scope: all`, the
`all_accuracy` headline, `hf_ccl.class_prompts.scope_class_names`); a stream here only supplies the domains.

What the official code does (github.com/linghan1997/Regression-based-Analytic-Incremental-Learning at HEAD,
`configs/analytic_clip.yaml`, `primal_RAIL.py`), and how it is followed here:

- the ten domains, in order: Aircraft, Caltech101, DTD, EuroSAT, Flowers, Food, MNIST, OxfordPet, StanfordCars,
  SUN397 (MTIL order I without CIFAR100; `XTAIL_DATASETS`); `num_shots: 16` training images per class (CoOp's
  few-shot sampling), here `shots_per_class` (a seeded choice per class, `few_shot_rows`);
- every domain's images are scored against the class names of all ten (`merged_classnames`), each put through the
  single template "a photo of a {}." (`clip_classifier(merged_classnames, ['a photo of a {}.'])`), with `_` read as
  a space: `XTAIL_TEMPLATES`, the train and eval templates of every task (no per-domain prompt, which would hint at
  the domain);
- Transfer / Avg. / Last are computed on the resulting 10 x 10 accuracy matrix exactly as ZSCL's MTIL metrics
  (`hf_ccl.evaluation.continual_metrics.mtil_*`; the matrix summary's `mtil_transfer`, `mtil_average`,
  `mtil_last`): column means of the strict upper triangle averaged over domains 2..10, the mean of all cells, and
  the last row's mean.

Differences, kept on purpose: the official code concatenates the ten name lists (a name two domains share, e.g.
"pizza" in Caltech101 and Food, is two columns with one embedding, and the first wins the tie); the paper speaks of
the union of the classes, which is what `"all"` scores (each name once). The images come from CLIP_benchmark's
webdataset copies (`hf_ccl.data.mtil`), not from CoOp's split files, so test sets and class counts differ slightly
(CLIP_benchmark's Caltech101 keeps the background class). RAIL's text could not be read in this session beyond its
abstract (the definitions above are its code's); LADA states the same label space (the classes learned so far and
the unseen ones, C_L ∪ C_U) and adds a full-shot setting (`shots_per_class=None`). LADA's repository
(MaolinLuo/LADA) could not be fetched here; RAIL's releases no result matrix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from datasets import DatasetDict

from .builders import TaskSource, _stable_seed, check_builder_options, load_split, stream_from_datasets
from .mtil import MTIL_ORDERS, mtil_dataset_list, mtil_task_sources
from .stream_registry import bundled, register
from .task import TaskStream

#: The ten X-TAIL domains in RAIL's order (`configs/analytic_clip.yaml`): MTIL order I without CIFAR100.
XTAIL_DATASETS: tuple[str, ...] = tuple(name for name in MTIL_ORDERS["I"] if name != "CIFAR100")
#: The template every X-TAIL class name is put through, for training and scoring (RAIL `primal_RAIL.py`).
XTAIL_TEMPLATES: tuple[str, ...] = ("a photo of a {c}.",)
#: Training images per class (RAIL `num_shots: 16`, LADA's 16-shot setting).
XTAIL_SHOTS = 16
#: How task templates are chosen: one shared template (X-TAIL), or each dataset's own (MTIL's ZSCL convention).
TEMPLATE_CHOICES = ("shared", "dataset")
#: The bundled stand-ins of `xtail-bundled` (folder, CLIP_benchmark templates), in X-TAIL's order of the domains
#: they stand for (Caltech101, DTD, EuroSAT -> RSSCN7 aerial scenes, MNIST), then GTSRB (a fifth domain).
XTAIL_BUNDLED_TASKS: dict[str, tuple[str, str | None]] = {
    "caltech101": ("caltech101", "caltech101"),
    "dtd10": ("dtd10", "dtd"),
    "rsscn7": ("rsscn7", None),
    "mnist": ("mnist", "mnist"),
    "gtsrb": ("gtsrb", "gtsrb"),
}
RSSCN7_DATASET_TEMPLATES = ("an aerial photo of a {c}.", "a satellite photo of a {c}.")


def few_shot_rows(labels: Sequence[int], shots: int, seed: int) -> np.ndarray:
    """The rows kept when each class keeps `shots` of its rows (all of them when it has fewer): the first `shots` of
    a permutation of the class's rows seeded by `seed`, in row order. The same labels and seed give the same rows."""
    label_array = np.asarray(labels)
    rng = np.random.default_rng(_stable_seed(seed, "few-shot"))
    kept = [rng.permutation(np.flatnonzero(label_array == label))[:shots] for label in np.unique(label_array)]
    return np.sort(np.concatenate(kept)) if kept else np.zeros(0, dtype=np.int64)


def check_shots(shots_per_class: int | None) -> None:
    """`shots_per_class` must be a positive integer or None (every training row)."""
    if shots_per_class is not None and (isinstance(shots_per_class, bool) or not isinstance(shots_per_class, int)
                                        or shots_per_class < 1):
        raise ValueError(f"shots_per_class must be a positive integer or None, got {shots_per_class!r}")


def _check_templates(templates: str) -> None:
    if templates not in TEMPLATE_CHOICES:
        raise ValueError(f"templates must be one of {list(TEMPLATE_CHOICES)}, got {templates!r}")


def few_shot_task(entry: TaskSource, shots_per_class: int | None, seed: int, templates: str) -> TaskSource:
    """`entry` with its train split cut to `shots_per_class` rows per class (`few_shot_rows`) and, with
    `templates="shared"`, `XTAIL_TEMPLATES` for training and scoring."""
    assert entry.label_column is not None
    if shots_per_class is not None:
        train, evaluation = load_split(entry.train, entry.train_split), load_split(entry.train, entry.eval_split)
        labels = train.with_format("arrow")[entry.label_column].to_pylist()
        train = train.select(few_shot_rows(labels, shots_per_class, seed).tolist())
        entry = dataclasses.replace(entry, train=DatasetDict({"train": train, "test": evaluation}),
                                    train_split="train", eval_split="test")
    if templates == "shared":
        entry = dataclasses.replace(entry, train_templates=XTAIL_TEMPLATES, eval_templates=XTAIL_TEMPLATES)
    return entry


def xtail_dataset_list(datasets: Sequence[str] | None) -> list[str]:
    """The domains of an X-TAIL stream, checked: `datasets` (any MTIL datasets, in their own order) or the ten."""
    return list(XTAIL_DATASETS) if datasets is None else mtil_dataset_list(datasets=datasets)


def xtail_stream(
    datasets: Sequence[str] | None = None,
    *,
    shots_per_class: int | None = XTAIL_SHOTS,
    templates: str = "shared",
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
    """The X-TAIL stream (module docstring): one classification task per domain, from CLIP_benchmark's webdataset
    repos on the Hub, read as `hf_ccl.data.mtil.mtil_stream` reads them (`revision` pins them, `sources` maps a
    domain to another repo or a local folder, `holdout_fraction` splits SUN397's single split).

    `shots_per_class`: training images kept per class (16, RAIL's; None: all), chosen with `seed`;
    `templates`: "shared" (X-TAIL: "a photo of a {c}." for every domain) or "dataset" (each repo's own templates,
    trained on the first, as MTIL). Score it with `class_scope: all`. Every option is checked before any download.
    """
    names = xtail_dataset_list(datasets)
    check_shots(shots_per_class)
    _check_templates(templates)
    check_builder_options(dict(max_train_per_task=max_train_per_task, max_eval_per_task=max_eval_per_task,
                               validate_images=validate_images))
    entries = mtil_task_sources(names, revision=revision, sources=sources, holdout_fraction=holdout_fraction,
                                cache_dir=cache_dir)
    entries = [few_shot_task(entry, shots_per_class, seed, templates) for entry in entries]
    return stream_from_datasets(entries, name=name or "xtail", max_train_per_task=max_train_per_task,
                                max_eval_per_task=max_eval_per_task, seed=seed, validate_images=validate_images)


def _check_xtail(*, datasets: Sequence[str] | None = None, shots_per_class: int | None = XTAIL_SHOTS,
                 templates: str = "shared", **_: Any) -> None:
    xtail_dataset_list(list(datasets) if isinstance(datasets, tuple) else datasets)
    check_shots(shots_per_class)
    _check_templates(templates)


def _bundled_keys(tasks: Sequence[str] | None) -> list[str]:
    """The task keys of `xtail-bundled`, checked: `tasks` (distinct, known) or all five."""
    keys = list(tasks) if tasks is not None else list(XTAIL_BUNDLED_TASKS)
    if isinstance(tasks, str) or not keys or any(key not in XTAIL_BUNDLED_TASKS for key in keys) or len(set(keys)) < len(
            keys):
        raise ValueError(f"tasks must be a non-empty list of distinct names among {', '.join(XTAIL_BUNDLED_TASKS)}, "
                         f"got {tasks!r}")
    return keys


def _check_xtail_bundled(*, tasks: Sequence[str] | None = None, shots_per_class: int | None = XTAIL_SHOTS,
                         templates: str = "shared", **_: Any) -> None:
    _bundled_keys(tasks)
    check_shots(shots_per_class)
    _check_templates(templates)


@register("xtail", check=_check_xtail)
def xtail(
    root: Path,
    common: dict[str, Any],
    *,
    datasets: tuple[str, ...] | None = None,
    shots_per_class: int | None = XTAIL_SHOTS,
    templates: str = "shared",
    revision: str | dict[str, str] | None = None,
    sources: dict[str, str] | None = None,
    holdout_fraction: float = 0.2,
) -> TaskStream:
    """X-TAIL (RAIL): 10 domains from the Hub (clip-benchmark/wds_*), 16 shots per class; score with class_scope: all.

    See `hf_ccl.data.xtail`. Downloads every split in full; `datasets` picks domains in its own order, `revision`
    pins the repos, `sources` maps a domain to another repo or a local folder. The data root is not used.
    """
    del root
    return xtail_stream(list(datasets) if datasets is not None else None, shots_per_class=shots_per_class,
                        templates=templates, revision=revision, sources=sources, holdout_fraction=holdout_fraction,
                        **common)


@register("xtail-bundled", check=_check_xtail_bundled)
def xtail_bundled(
    root: Path,
    common: dict[str, Any],
    *,
    tasks: tuple[str, ...] | None = None,
    shots_per_class: int | None = XTAIL_SHOTS,
    templates: str = "shared",
) -> TaskStream:
    """X-TAIL on bundled data: caltech101 -> dtd10 -> rsscn7 -> mnist -> gtsrb, 16 shots per class; class_scope: all.

    Five domains, 172 class names in all (102 + 10 + 7 + 10 + 43), each image scored among all of them under
    `class_scope: all`; X-TAIL's order of the domains they stand for (Caltech101, DTD, EuroSAT, MNIST), GTSRB last.
    Train: `shots_per_class` images per class (16: 1632 / 160 / 112 / 160 / 688; None: all); eval: the full test
    splits (3049 / 400 / 540 / 10000 / 12630) before `max_eval_per_task`. `templates`: "shared" ("a photo of a
    {c}." everywhere, X-TAIL) or "dataset" (CLIP_benchmark's per dataset). `tasks`: any of the five, in order.
    """
    keys = _bundled_keys(tasks)
    check_shots(shots_per_class)
    _check_templates(templates)
    from .templates import benchmark_templates

    entries = []
    for key in keys:
        folder, template_name = XTAIL_BUNDLED_TASKS[key]
        own = benchmark_templates(template_name) if template_name else list(RSSCN7_DATASET_TEMPLATES)
        entry = TaskSource(name=key, train=bundled(root, folder), label_column="label", train_templates=own[:1],
                           eval_templates=own, source=key)
        entries.append(few_shot_task(entry, shots_per_class, common["seed"], templates))
    return stream_from_datasets(entries, name="xtail-bundled", **common)
