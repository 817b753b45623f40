"""Class-incremental streams as CLIP continual-learning papers run them: CIFAR-100 (B0-Inc10, B50-Inc10), ImageNet-R
(B0-Inc20, B0-Inc10) from the Hub, and Caltech-101 on the bundled data.

A setting `"B<b>-Inc<n>"` is a first task of b classes (b = 0: of n) and then tasks of n classes, in a fixed class
order (`stream_class_incremental`'s `initial_classes` and `classes_per_step`). Each task is scored among every class
seen so far (`class_scope: seen`, the `seen_accuracy` headline), and the results matrix then reports the
class-incremental average and last accuracy (`class_incremental_average` / `class_incremental_last`, iCaRL's,
checked against MoE-Adapters' released logs in tests/test_mtil_metrics.py and PROOF's CIFAR-100 B0-Inc10 and
B50-Inc10 logs in tests/test_protocols.py).

Conventions, and where they come from:
- CIFAR-100's class order is Continual-CLIP's, used by ZSCL and MoE-Adapters (`CIFAR100_CLIP_ORDER`: MoE-Adapters4CL
  at 4572d97, `cil/class_orders/cifar100.yaml`); PyCIL's seed-1993 shuffle (`np.random.seed(1993);
  np.random.permutation(n)`, PROOF's: github.com/zhoudw-zdw/PROOF at 0bb2052, `utils/data_manager.py` with
  `"shuffle": true, "seed": [1993]` in `exps/*.json`) is `class_order: seed-1993`, the default for ImageNet-R (PROOF
  `exps/img.json`: B0-Inc20) and Caltech-101;
- prompts: Continual-CLIP's and MoE-Adapters' single template "a bad photo of a {c}." (`templates: shared`), or
  the repo's CLIP_benchmark templates (`templates: dataset`, trained on the first);
- data: CLIP_benchmark's webdataset copies, read by `hf_ccl.data.mtil.load_wds_classification` at one commit.
  CIFAR-100 is `clip-benchmark/wds_vtab-cifar100` pinned at `CIFAR100_COMMIT` (VTAB's train split: 45,000 of the
  50,000 training images; the full 10,000-image test set). ImageNet-R is `clip-benchmark/wds_imagenet-r` (a test
  split only: 30,000 images of 200 classes, split 80/20 per class here, as the 24,000 / 6,000 split of L2P and
  CODA-Prompt, with other images); its commit could not be read in full offline (the Hub page shows `610f29c`,
  "Initial upload", Jan 20 2023), so `revision` is required and must be a full commit SHA.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .builders import load_split, stream_class_incremental
from .mtil import _is_local, _train_eval, load_wds_classification
from .stream_registry import bundled, register
from .task import TaskStream
from .templates import benchmark_templates

CIFAR100_REPO = "clip-benchmark/wds_vtab-cifar100"
#: The commit of `CIFAR100_REPO` read by default ("Initial upload", 2023-01-20, its main branch).
CIFAR100_COMMIT = "c181ce0341d21e40ebe4f35a8fc56dd547e20418"
IMAGENET_R_REPO = "clip-benchmark/wds_imagenet-r"
#: Continual-CLIP's CIFAR-100 class order (ZSCL, MoE-Adapters: MoE-Adapters4CL @ 4572d97
#: `cil/class_orders/cifar100.yaml`), indices of CIFAR-100's fine labels.
CIFAR100_CLIP_ORDER = (
    87, 0, 52, 58, 44, 91, 68, 97, 51, 15, 94, 92, 10, 72, 49, 78, 61, 14, 8, 86, 84, 96, 18, 24, 32, 45, 88, 11,
    4, 67, 69, 66, 77, 47, 79, 93, 29, 50, 57, 83, 17, 81, 41, 12, 37, 59, 25, 20, 80, 73, 1, 28, 6, 46, 62, 82,
    53, 9, 31, 75, 38, 63, 33, 74, 27, 22, 36, 3, 16, 21, 60, 19, 70, 90, 89, 43, 5, 42, 65, 76, 40, 30, 23, 85, 2,
    95, 56, 48, 71, 64, 98, 13, 99, 7, 34, 55, 54, 26, 35, 39,
)
#: The single prompt of Continual-CLIP and MoE-Adapters' class-incremental runs (`prompt_template`).
CIL_TEMPLATES = ("a bad photo of a {c}.",)
#: Caltech-101 classes CoOp leaves out (BACKGROUND_Google and Faces_easy in CLIP_benchmark's names): 100 remain.
CALTECH101_LEFT_OUT = ("background", "centered face")
SETTING = re.compile(r"B(\d+)-Inc(\d+)")
COMMIT = re.compile(r"[0-9a-f]{40}")


def parse_setting(setting: str) -> tuple[int | None, int]:
    """(initial_classes, classes_per_step) of a setting `"B<b>-Inc<n>"`: B0 is None (a first task of n classes)."""
    match = SETTING.fullmatch(setting) if isinstance(setting, str) else None
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"setting must be 'B<base classes>-Inc<classes per step>' (e.g. B0-Inc10, B50-Inc10), got "
                         f"{setting!r}")
    base, step = int(match.group(1)), int(match.group(2))
    return (base or None), step


def seed_1993_order(classes: Sequence[int]) -> list[int]:
    """PyCIL's class order: `classes` permuted by `np.random.seed(1993); np.random.permutation(len(classes))`."""
    permutation = np.random.RandomState(1993).permutation(len(classes))
    return [int(classes[i]) for i in permutation]


def resolve_class_order(class_order: Any, classes: Sequence[int]) -> Any:
    """A named order among `classes` (class indices): `"seed-1993"` (`seed_1993_order`), `"dataset"` (their own
    order); anything else (None, "seed", a list, a file) is `stream_class_incremental`'s and passes through."""
    if class_order == "seed-1993":
        return seed_1993_order(classes)
    if class_order == "dataset":
        return list(classes)
    return class_order


def _templates(choice: str, own: Sequence[str]) -> tuple[list[str], list[str]]:
    if choice == "shared":
        return list(CIL_TEMPLATES), list(CIL_TEMPLATES)
    if choice == "dataset":
        return list(own[:1]), list(own)
    raise ValueError(f"templates must be 'shared' or 'dataset', got {choice!r}")


def check_pinned(source: str | os.PathLike[str], revision: str | None) -> None:
    """A Hub source needs `revision`, a full 40-hex commit SHA (a branch or tag moves); a local folder none."""
    if _is_local(source):
        if revision is not None:
            raise ValueError(f"revision={revision!r} given for the local folder {os.fspath(source)!r}; a folder has none")
        return
    if not isinstance(revision, str) or not COMMIT.fullmatch(revision):
        raise ValueError(f"revision must be the full 40-character commit SHA of {os.fspath(source)!r} to pin it "
                         f"(a branch or tag moves), got {revision!r}")


def check_hub_options(*, source: str | os.PathLike[str], revision: str | None, setting: str = "B0-Inc10",
                      templates: str = "shared", holdout_fraction: float = 0.2, **_: Any) -> None:
    """The values of a Hub class-incremental stream's options (ValueError naming the option), read before anything
    is downloaded: the setting, the templates, a pinned commit, the held-out fraction."""
    parse_setting(setting)
    _templates(templates, ["{c}"])
    check_pinned(source, revision)
    if isinstance(holdout_fraction, bool) or not isinstance(holdout_fraction, (int, float)) or not (
            0 < holdout_fraction < 1):
        raise ValueError(f"holdout_fraction must be a number in (0, 1), got {holdout_fraction!r}")


def _check_cifar100(*, source: str = CIFAR100_REPO, revision: str | None = CIFAR100_COMMIT, **options: Any) -> None:
    check_hub_options(source=source, revision=revision, **options)


def _check_imagenet_r(*, source: str = IMAGENET_R_REPO, revision: str | None = None, **options: Any) -> None:
    check_hub_options(source=source, revision=revision, **options)


def _check_caltech101(*, setting: str = "B0-Inc10", templates: str = "shared", **_: Any) -> None:
    parse_setting(setting)
    _templates(templates, ["{c}"])


def hub_class_incremental(
    source: str | os.PathLike[str],
    revision: str | None,
    *,
    name: str,
    setting: str,
    class_order: Any,
    templates: str,
    holdout_fraction: float,
    cache_dir: str | os.PathLike[str] | None,
    common: dict[str, Any],
) -> TaskStream:
    """A class-incremental stream of a CLIP_benchmark webdataset repo (or a local copy), at a pinned commit; every
    option is checked before anything is downloaded (`check_hub_options`)."""
    check_hub_options(source=source, revision=revision, setting=setting, templates=templates,
                      holdout_fraction=holdout_fraction)
    initial, step = parse_setting(setting)
    data = load_wds_classification(source, revision=revision, cache_dir=cache_dir)
    train_templates, eval_templates = _templates(templates, data.templates)
    order = resolve_class_order(class_order, range(len(data.class_names)))
    stream = stream_class_incremental(
        _train_eval(data, "train", "test", float(holdout_fraction)), step, initial_classes=initial,
        class_order=order, label_column="cls", class_names=data.class_names, train_templates=train_templates,
        eval_templates=eval_templates, image_column=data.image_column, name=f"{name}-{setting}", source=name,
        task_names=None, **common)
    if data.commit is not None:  # a Hub repo read at one commit: its tasks name it in `.eval_results` (hf_ccl.eval_results)
        for task in stream:
            task.dataset_id, task.dataset_revision = data.origin, data.commit
    return stream


@register("cil-cifar100", check=_check_cifar100)
def cil_cifar100(
    root: Path,
    common: dict[str, Any],
    *,
    setting: str = "B0-Inc10",
    class_order: Any = CIFAR100_CLIP_ORDER,
    templates: str = "shared",
    source: str = CIFAR100_REPO,
    revision: str | None = CIFAR100_COMMIT,
    cache_dir: str | None = None,
) -> TaskStream:
    """Class-incremental CIFAR-100 from the Hub, B0-Inc10 (10 tasks of 10 classes) or B50-Inc10; class_scope: seen.

    See `hf_ccl.data.cil`: CLIP_benchmark's `wds_vtab-cifar100` at a pinned commit, Continual-CLIP's class order,
    "a bad photo of a {c}.". `setting`: any "B<b>-Inc<n>"; `class_order`: a list, "seed-1993", "dataset", "seed"
    or a .yaml/.json file; `source`/`revision`: another repo (a full commit SHA) or a local folder (revision None).
    """
    del root
    return hub_class_incremental(source, revision, name="cifar100", setting=setting,
                                 class_order=list(class_order) if isinstance(class_order, tuple) else class_order,
                                 templates=templates, holdout_fraction=0.2, cache_dir=cache_dir, common=common)


@register("cil-imagenet-r", check=_check_imagenet_r)
def cil_imagenet_r(
    root: Path,
    common: dict[str, Any],
    *,
    revision: str | None = None,
    setting: str = "B0-Inc20",
    class_order: Any = "seed-1993",
    templates: str = "shared",
    source: str = IMAGENET_R_REPO,
    holdout_fraction: float = 0.2,
    cache_dir: str | None = None,
) -> TaskStream:
    """Class-incremental ImageNet-R from the Hub, B0-Inc20 (10 tasks of 20 classes) or B0-Inc10; class_scope: seen.

    See `hf_ccl.data.cil`: CLIP_benchmark's `wds_imagenet-r` (test split only, 80/20 per class), PyCIL's seed-1993
    class order, "a bad photo of a {c}.". `revision` is required: the repo's full commit SHA (or None with a local
    folder as `source`).
    """
    del root
    return hub_class_incremental(source, revision, name="imagenet-r", setting=setting, class_order=class_order,
                                 templates=templates, holdout_fraction=holdout_fraction, cache_dir=cache_dir,
                                 common=common)


@register("cil-caltech101-bundled", check=_check_caltech101)
def cil_caltech101_bundled(
    root: Path,
    common: dict[str, Any],
    *,
    setting: str = "B0-Inc10",
    class_order: Any = "seed-1993",
    templates: str = "shared",
) -> TaskStream:
    """Class-incremental Caltech-101 on bundled data: CoOp's 100 classes, 10 tasks of 10 (B0-Inc10); class_scope: seen.

    The bundled Caltech-101 (6096 train / 3049 test images before `max_*_per_task`) without CoOp's left-out
    `background` and `centered face` (Faces_easy) classes; PyCIL's seed-1993 order of the other 100 (class_order
    "dataset": their own order; or a list / file of classes), "a bad photo of a {c}." (templates "dataset":
    CLIP_benchmark's caltech101 templates). `setting`: any "B<b>-Inc<n>" that divides the 100 classes.
    """
    initial, step = parse_setting(setting)
    folder = bundled(root, "caltech101")
    names = load_split(folder, "test").features["label"].names
    kept = [index for index, class_name in enumerate(names) if class_name not in CALTECH101_LEFT_OUT]
    train_templates, eval_templates = _templates(templates, benchmark_templates("caltech101"))
    return stream_class_incremental(
        folder, step, initial_classes=initial, class_order=resolve_class_order(class_order, kept),
        train_templates=train_templates, eval_templates=eval_templates, name=f"cil-caltech101-{setting}",
        source="caltech101", **common)
