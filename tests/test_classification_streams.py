"""Classification streams: the class-incremental builder, `cifar10-classes`, `mtil-bundled`, and the MTIL stream
read from CLIP_benchmark-style webdataset repos on a local Hub server (no network)."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from datasets import Dataset, Features, Value
from datasets import Image as ImageFeature
from PIL import Image as PILImage

from hf_ccl.data import (
    CANONICAL_COLUMNS,
    DIGIT_CLASS_NAMES,
    MTIL_ORDERS,
    MTIL_REPOS,
    benchmark_templates,
    build_stream,
    decode_image,
    load_split,
    mtil_stream,
    stream_class_incremental,
)
from hf_ccl.data.builders import class_incremental_steps
from hf_ccl.data.mtil import _shards_by_split, load_wds_classification, mtil_dataset_list, stratified_holdout
from hf_ccl.data.named import FASHION_SUBCATEGORIES

CIFAR10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PACS = ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]
SMALL = {"max_train_per_task": 12, "max_eval_per_task": 8}


def _labels(dataset: Dataset) -> list[int]:
    return dataset.with_format("arrow")["label"].to_pylist()


def _ids(dataset: Dataset) -> list[str]:
    return dataset.with_format("arrow")["image_id"].to_pylist()


def _check_task(task, class_names: list[str], n_train: int, n_eval: int) -> None:
    assert task.kind == "classification"
    assert task.class_names == class_names
    assert (len(task.train), len(task.eval)) == (n_train, n_eval)
    for split in (task.train, task.eval):
        assert tuple(split.column_names) == CANONICAL_COLUMNS
        assert set(_labels(split)) <= set(range(len(class_names)))
    row = task.train[0]
    assert decode_image(row["image"], row["image_id"]).mode == "RGB"


# ---------------------------------------------------------------- class-incremental builder


def test_class_incremental_steps() -> None:
    names = [f"c{i}" for i in range(10)]
    assert class_incremental_steps(names, 2) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert class_incremental_steps(names, 2, initial_classes=4) == [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9]]
    assert class_incremental_steps(names, 10) == [list(range(10))]
    assert class_incremental_steps(names, 3, class_order=["c9", 8, "c7", 0, 1, 2]) == [[9, 8, 7], [0, 1, 2]]
    seeded = class_incremental_steps(names, 5, class_order="seed", seed=3)
    assert sorted(i for step in seeded for i in step) == list(range(10)) and seeded != [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert class_incremental_steps(names, 5, class_order="seed", seed=3) == seeded
    assert class_incremental_steps(names, 5, class_order="seed", seed=4) != seeded


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"classes_per_step": 3}, "classes_per_step=3 does not divide the 10 classes"),
        ({"classes_per_step": 0}, "classes_per_step must be a positive integer"),
        ({"classes_per_step": True}, "classes_per_step must be a positive integer"),
        ({"classes_per_step": 2.0}, "classes_per_step must be a positive integer"),
        ({"classes_per_step": 20}, "classes_per_step=20 is more than the 10 classes"),
        ({"classes_per_step": 4, "initial_classes": 4}, r"classes_per_step=4 does not divide the 6 classes after"),
        ({"classes_per_step": 2, "initial_classes": 0}, "initial_classes must be a positive integer"),
        ({"classes_per_step": 2, "initial_classes": 12}, "initial_classes=12 is more than the 10 classes"),
        ({"classes_per_step": 1, "class_order": [0, 1, 1]}, "class_order names a class twice: c1"),
        ({"classes_per_step": 1, "class_order": ["c0", 0]}, "class_order names a class twice: c0"),
        ({"classes_per_step": 1, "class_order": [0, 10]}, "class_order: class index 10 out of range"),
        ({"classes_per_step": 1, "class_order": ["c0", "nope"]}, "class_order: unknown class 'nope'"),
        ({"classes_per_step": 1, "class_order": [0, 1.5]}, "class_order: 1.5 is neither"),
        ({"classes_per_step": 1, "class_order": []}, "class_order must be a non-empty list"),
        ({"classes_per_step": 1, "class_order": "random"}, "class_order must be None, 'seed', a list"),
        ({"classes_per_step": 1, "class_order": "missing.yaml"}, "class_order: no such file"),
        ({"classes_per_step": 1, "class_order": 3}, "class_order must be None, 'seed', a list or a file"),
    ],
)
def test_class_incremental_steps_refuse_bad_options(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        class_incremental_steps([f"c{i}" for i in range(10)], **options)


def test_class_order_from_a_moe_adapters_yaml(tmp_path: Path) -> None:
    order = [3, 7, 0, 9, 1, 5, 2, 8, 6, 4]
    (tmp_path / "cifar10.yaml").write_text(f"class_order: {order}\n")
    (tmp_path / "bare.json").write_text(json.dumps(["cat", "dog"]))
    (tmp_path / "other.yaml").write_text("order: [1, 2]\n")
    names = CIFAR10
    assert class_incremental_steps(names, 2, class_order=str(tmp_path / "cifar10.yaml")) == [
        order[i:i + 2] for i in range(0, 10, 2)
    ]
    assert class_incremental_steps(names, 1, class_order=tmp_path / "bare.json") == [[3], [5]]
    with pytest.raises(ValueError, match="class_order: file .* has no `class_order` key"):
        class_incremental_steps(names, 1, class_order=str(tmp_path / "other.yaml"))


def test_stream_class_incremental_on_cifar10(shared_data_root, tmp_path: Path) -> None:
    path = shared_data_root / "cifar10"
    stream = stream_class_incremental(path, 3, initial_classes=4, class_order=["truck", "ship", 0, 1, 2, 3, 4, 5, 6, 7],
                                      **SMALL)
    assert stream.name == "cifar10-4-3"
    assert stream.task_names == ["cifar10-0", "cifar10-1", "cifar10-2"]
    expected = [["truck", "ship", "airplane", "automobile"], ["bird", "cat", "deer"], ["dog", "frog", "horse"]]
    for task, names in zip(stream, expected, strict=True):
        _check_task(task, names, 12, 8)
        assert task.eval_templates == ["a photo of a {label}."]
        for row in task.train.select(range(3)):
            assert row["texts"] == [f"a photo of a {names[row['label']]}."]
    assert _ids(stream[0].train)[0].startswith("cifar10/train/") and _ids(stream[0].eval)[0].startswith("cifar10/test/")
    everything = stream_class_incremental(path, 5, label_space="all", task_names=["first", "second"], **SMALL)
    assert everything.task_names == ["first", "second"]
    assert everything[1].class_names == CIFAR10 and set(_labels(everything[1].eval)) <= {5, 6, 7, 8, 9}
    partial = stream_class_incremental(path, 2, class_order=["cat", "dog"], max_eval_per_task=4)
    assert len(partial) == 1 and len(partial[0].train) == 2000
    assert partial.dropped["(no task)"]["train"]["class in no task"] == 8000
    with pytest.raises(ValueError, match="task_names has 1 names for 2 steps"):
        stream_class_incremental(path, 5, task_names=["one"])
    with pytest.raises(ValueError, match="label_space must be 'task' or 'all'"):
        stream_class_incremental(path, 5, label_space="seen")
    with pytest.raises(ValueError, match="max_train_per_task must be a positive integer"):
        stream_class_incremental(path, 5, max_train_per_task=0)


def test_stream_class_incremental_on_a_string_label_column() -> None:
    features = Features({"image": ImageFeature(), "kind": Value("string")})
    png = io.BytesIO()
    PILImage.new("RGB", (4, 4), (200, 10, 10)).save(png, format="PNG")
    rows = {"image": [{"bytes": png.getvalue(), "path": None}] * 6, "kind": ["b", "a", "c", "d", "a", "b"]}
    data = Dataset.from_dict(rows, features=features)
    stream = stream_class_incremental(data, 2, eval=data, label_column="kind", class_order=["d", "c", "b", "a"])
    assert [task.class_names for task in stream] == [["d", "c"], ["b", "a"]]
    assert _labels(stream[1].train) == [0, 1, 1, 0]


# ---------------------------------------------------------------- cifar10-classes


def test_cifar10_classes_named_stream(shared_data_root) -> None:
    stream = build_stream("cifar10-classes", data_root=shared_data_root, **SMALL)
    assert stream.name == "cifar10-classes"
    assert stream.task_names == [f"cifar10-{k}" for k in range(5)]
    for k, task in enumerate(stream):
        _check_task(task, CIFAR10[2 * k:2 * k + 2], 12, 8)
        assert task.eval_templates == benchmark_templates("cifar10") and len(task.eval_templates) == 18
        assert task.train[0]["texts"] == [f"a photo of a {task.class_names[task.train[0]['label']]}."]
    full = build_stream("cifar10-classes", data_root=shared_data_root, classes_per_step=5)
    assert [(len(t.train), len(t.eval)) for t in full] == [(5000, 2500), (5000, 2500)]
    seeded = build_stream("cifar10-classes", data_root=shared_data_root, class_order="seed", seed=7, **SMALL)
    again = build_stream("cifar10-classes", data_root=shared_data_root, class_order="seed", seed=7, **SMALL)
    assert [t.class_names for t in seeded] == [t.class_names for t in again]
    assert sorted(n for t in seeded for n in t.class_names) == sorted(CIFAR10)
    assert [t.class_names for t in seeded] != [t.class_names for t in stream]
    everything = build_stream("cifar10-classes", data_root=shared_data_root, label_space="all", **SMALL)
    assert everything[2].class_names == CIFAR10 and set(_labels(everything[2].train)) == {4, 5}
    with pytest.raises(ValueError, match="classes_per_step=4 does not divide the 10 classes"):
        build_stream("cifar10-classes", data_root=shared_data_root, classes_per_step=4)
    with pytest.raises(ValueError, match="Unknown option.*'n_tasks'.*classes_per_step"):
        build_stream("cifar10-classes", data_root=shared_data_root, n_tasks=5)


# ---------------------------------------------------------------- mtil-bundled

BUNDLED_CLASSES = {
    "digits": list(DIGIT_CLASS_NAMES),
    "cifar10": CIFAR10,
    "rsscn7": ["grass", "field", "industry", "river or lake", "forest", "residential area", "parking lot"],
    "pacs-sketch": PACS,
    "fashion": ["tops", "shoes", "bags", "trousers", "watches", "underwear", "jewellery", "flip flops", "perfume",
                "sandals", "sunglasses", "lipstick"],
}
BUNDLED_SIZES = {"digits": (1438, 359), "cifar10": (10000, 5000), "rsscn7": (2260, 540), "pacs-sketch": (3122, 807),
                 "fashion": (1397, 358), "pacs": (7959, 2032)}


def test_mtil_bundled_tasks(shared_data_root) -> None:
    stream = build_stream("mtil-bundled", data_root=shared_data_root, **SMALL)
    assert stream.name == "mtil-bundled"
    assert stream.task_names == ["digits", "cifar10", "rsscn7", "pacs-sketch", "fashion"]
    for task in stream:
        _check_task(task, BUNDLED_CLASSES[task.name], 12, 8)
        assert len(task.eval_templates) >= 4 and all("{label}" in t or "{c}" in t for t in task.eval_templates)
    digits, cifar10, rsscn7, sketch, fashion = stream
    assert digits.train[0]["texts"][0].startswith("a photo of the digit ")
    assert cifar10.eval_templates == benchmark_templates("cifar10")
    assert rsscn7.train[0]["texts"][0].startswith("an aerial photo of a ")
    assert sketch.train[0]["texts"][0].startswith("a sketch of a ")
    assert fashion.train[0]["texts"] == [f"a product photo of {fashion.class_names[fashion.train[0]['label']]}."]
    ids = [i for task in stream for i in _ids(task.train) + _ids(task.eval)]
    assert len(ids) == len(set(ids)), "image ids repeat across the tasks"
    assert {i.split("/")[0] for i in ids} == {"digits", "cifar10", "rsscn7", "pacs", "fashion"}


def test_mtil_bundled_full_sizes_and_label_spaces(shared_data_root) -> None:
    stream = build_stream("mtil-bundled", data_root=shared_data_root)
    assert {t.name: (len(t.train), len(t.eval)) for t in stream} == {
        k: v for k, v in BUNDLED_SIZES.items() if k != "pacs"}
    for task in stream:  # every class of every task occurs in both splits: each task is its own label space
        assert set(_labels(task.train)) == set(_labels(task.eval)) == set(range(len(task.class_names)))
    fashion = stream[4]
    source = load_split(shared_data_root / "fashion", "test")
    kept = [FASHION_SUBCATEGORIES[v] for v in source["sub_category"] if v in FASHION_SUBCATEGORIES]
    assert [fashion.class_names[label] for label in _labels(fashion.eval)] == kept


def test_mtil_bundled_eval_subsets_are_stratified(shared_data_root) -> None:
    """max_eval_per_task=300: an equal number per class (at most ceil(300 / K)); a class with fewer rows gives all
    of them (full eval splits: sketch 161/147/161/131/151/19/37, fashion 161/59/31/24/20/20/7/8/6/6/6/10)."""
    stream = build_stream("mtil-bundled", data_root=shared_data_root, max_train_per_task=300, max_eval_per_task=300)
    counts = {task.name: [Counter(_labels(task.eval))[k] for k in range(len(task.class_names))] for task in stream}
    assert counts["digits"] == counts["cifar10"] == [30] * 10
    assert sorted(counts["rsscn7"]) == [42] + [43] * 6  # 300 = 7 * 42 + 6
    assert counts["pacs-sketch"] == [43, 43, 43, 43, 43, 19, 37]  # house and person give all theirs
    assert counts["fashion"] == [25, 25, 25, 24, 20, 20, 7, 8, 6, 6, 6, 10]  # tops: 25 of 182 rows, not 45 %
    fashion_train = Counter(_labels(stream[4].train))
    assert len(stream[4].train) == 300 and fashion_train[0] > 100  # train: the random subsample, tops ~45 %
    again = build_stream("mtil-bundled", data_root=shared_data_root, tasks=["fashion"], max_eval_per_task=300)
    assert _ids(again[0].eval) == _ids(stream[4].eval)  # the same rows in every order and task list
    other = build_stream("mtil-bundled", data_root=shared_data_root, tasks=["fashion"], max_eval_per_task=300, seed=1)
    assert _ids(other[0].eval) != _ids(stream[4].eval)
    assert [Counter(_labels(other[0].eval))[k] for k in range(12)] == counts["fashion"]


def test_mtil_bundled_orders_and_options(shared_data_root) -> None:
    second = build_stream("mtil-bundled", data_root=shared_data_root, order="II", pacs_domain="all", **SMALL)
    assert second.task_names == ["rsscn7", "fashion", "cifar10", "digits", "pacs"]
    pacs = second[4]
    _check_task(pacs, PACS, 12, 8)
    assert pacs.eval_templates[0] == "an image of a {label}." and len(pacs.eval_templates) == 5
    assert {i.split("/")[1] for i in _ids(pacs.train)} == {"train"}
    picked = build_stream("mtil-bundled", data_root=shared_data_root, tasks=("fashion", "digits"), pacs_domain="photo",
                          **SMALL)
    assert picked.task_names == ["fashion", "digits"]
    photo = build_stream("mtil-bundled", data_root=shared_data_root, tasks=["pacs"], pacs_domain="photo")
    assert photo.task_names == ["pacs-photo"] and (len(photo[0].train), len(photo[0].eval)) == (1343, 327)
    for options, message in [
        ({"order": "III"}, r"order must be one of \['I', 'II'\]"),
        ({"tasks": ("digits", "svhn")}, r"tasks: unknown task\(s\) \['svhn'\]"),
        ({"tasks": ("digits", "digits")}, "tasks names a task twice: digits"),
        ({"tasks": "digits"}, "tasks must be a non-empty list"),
        ({"tasks": ()}, "tasks must be a non-empty list"),
        ({"pacs_domain": "photos"}, "pacs_domain must be one of"),
        ({"max_eval_per_task": -1}, "max_eval_per_task must be a positive integer"),
        ({"domain": "photo"}, r"Unknown option\(s\) \['domain'\] for stream 'mtil-bundled'"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_stream("mtil-bundled", data_root=shared_data_root, **options)


# ---------------------------------------------------------------- MTIL from CLIP_benchmark webdataset repos

ORDER_I = ["Aircraft", "Caltech101", "CIFAR100", "DTD", "EuroSAT", "Flowers", "Food", "MNIST", "OxfordPet",
           "StanfordCars", "SUN397"]
ORDER_II = ["StanfordCars", "Food", "MNIST", "OxfordPet", "Flowers", "SUN397", "Aircraft", "Caltech101", "DTD",
            "EuroSAT", "CIFAR100"]


def test_mtil_orders() -> None:
    assert list(MTIL_ORDERS["I"]) == ORDER_I == mtil_dataset_list("I")
    assert list(MTIL_ORDERS["II"]) == ORDER_II == mtil_dataset_list("II")
    assert sorted(ORDER_I) == sorted(ORDER_II) == sorted(MTIL_REPOS)
    assert MTIL_REPOS["StanfordCars"] == "clip-benchmark/wds_cars"
    assert MTIL_REPOS["Aircraft"] == "clip-benchmark/wds_fgvc_aircraft"
    assert all(repo.startswith("clip-benchmark/wds_") for repo in MTIL_REPOS.values())
    assert mtil_dataset_list("II", ["cars", "sun397", "Pets"]) == ["StanfordCars", "SUN397", "OxfordPet"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"order": "III"}, r"order must be one of \['I', 'II'\]"),
        ({"datasets": ["MNIST", "SVHN"]}, "datasets: unknown MTIL dataset 'SVHN'"),
        ({"datasets": ["MNIST", "mnist"]}, "datasets names a dataset twice: MNIST"),
        ({"datasets": "MNIST"}, "datasets must be a non-empty list"),
        ({"datasets": []}, "datasets must be a non-empty list"),
        ({"holdout_fraction": 1.0}, r"holdout_fraction must be a number in \(0, 1\)"),
        ({"holdout_fraction": True}, r"holdout_fraction must be a number in \(0, 1\)"),
        ({"revision": 3}, "revision must be a string, a mapping"),
        ({"revision": {"Imagenet": "main"}}, "revision: unknown MTIL dataset 'Imagenet'"),
        ({"sources": {"Cifar10": "x/y"}}, "sources: unknown MTIL dataset 'Cifar10'"),
        ({"sources": {"MNIST": ""}}, "sources.MNIST must be a Hub dataset id or a local folder"),
        ({"sources": ["x/y"]}, "sources must be a mapping"),
        ({"max_train_per_task": 0}, "max_train_per_task must be a positive integer"),
    ],
)
def test_mtil_stream_refuses_bad_options_before_any_download(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        mtil_stream(**options)  # the conftest keeps the Hub offline: a download would fail differently


def _cifar_images(shared_data_root: Path, n: int) -> list[PILImage.Image]:
    test = load_split(shared_data_root / "cifar10", "test").select(range(0, 5000, 5000 // n))
    return [image.convert("RGB") for image in test["image"]]


def _encode(image: PILImage.Image, key: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format={"webp": "WEBP", "png": "PNG", "jpg": "JPEG"}[key], lossless=True)
    return buffer.getvalue()


def _shard(samples: list[tuple[str, bytes, int]], key: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, image, label in samples:
            for member, data in ((f"{name}.{key}", image), (f"{name}.cls", str(label).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _wds_files(images, class_names, sizes, *, key="webp", per_shard=5, templates=("a photo of a {c}.",)):
    """The files of a CLIP_benchmark webdataset repo: split -> rows, in shards of `per_shard` samples."""
    files = {"classnames.txt": ("\n".join(class_names) + "\n").encode(),
             "zeroshot_classification_templates.txt": ("\n".join(templates) + "\n").encode()}
    index = 0
    for split, n_rows in sizes.items():
        rows = list(range(index, index + n_rows))
        shards = [rows[i:i + per_shard] for i in range(0, n_rows, per_shard)]
        for k, shard in enumerate(shards):
            samples = [(f"s{i:07d}", _encode(images[i % len(images)], key), i % len(class_names)) for i in shard]
            files[f"{split}/{k}.tar"] = _shard(samples, key)
        files[f"{split}/nshards.txt"] = f"{len(shards)}\n".encode()
        index += n_rows
    return files


def _push(store, repo: str, files: dict[str, bytes], message: str = "Initial upload") -> str:
    store.create_repo("dataset", repo)
    return store.commit("dataset", repo, "main", [("add", p, c) for p, c in files.items()], message)


#: A tiny stand-in for each MTIL repo: (class names, split sizes, image key, shard size). CIFAR100 has two shards
#: per split, MNIST png images, SUN397 a test split only (as on the Hub), the others one shard per split.
FAKE_REPOS = {
    name: ([f"{name.lower()} class {k}" for k in range(3)], {"train": 6, "test": 3}, "webp", 10) for name in MTIL_REPOS
}
FAKE_REPOS["CIFAR100"] = (["apple", "aquarium fish", "baby", "bear"], {"train": 8, "test": 8}, "webp", 4)
FAKE_REPOS["MNIST"] = ([str(k) for k in range(10)], {"train": 10, "test": 10}, "png", 10)
FAKE_REPOS["SUN397"] = (["abbey", "airplane cabin", "airport terminal"], {"test": 15}, "webp", 10)


@pytest.fixture
def mtil_hub(local_hub, shared_data_root):
    images = _cifar_images(shared_data_root, 20)
    commits = {}
    for name, (class_names, sizes, key, per_shard) in FAKE_REPOS.items():
        templates = (f"a photo of a {{c}}, a kind of {name}.", "a photo of the {c}.", "itap of a {c}.")
        commits[name] = _push(local_hub.store, MTIL_REPOS[name],
                              _wds_files(images, class_names, sizes, key=key, per_shard=per_shard, templates=templates))
    local_hub.commits = commits
    return local_hub


def test_mtil_stream_order_ii_from_the_local_hub(mtil_hub, tmp_path: Path) -> None:
    stream = mtil_stream("II", max_train_per_task=5, cache_dir=tmp_path / "datasets")
    assert stream.name == "mtil-II"
    assert stream.task_names == ORDER_II
    for task in stream:
        class_names, sizes, _, _ = FAKE_REPOS[task.name]
        n_train, n_eval = (min(sizes["train"], 5), sizes["test"]) if "train" in sizes else (5, 3)
        _check_task(task, class_names, n_train, n_eval)
        assert task.eval_templates == [f"a photo of a {{c}}, a kind of {task.name}.", "a photo of the {c}.",
                                       "itap of a {c}."]
        row = task.train[0]
        assert row["texts"] == [f"a photo of a {class_names[row['label']]}, a kind of {task.name}."]
        assert _ids(task.train)[0].startswith(f"{task.name.lower()}/train/")
        assert set(_labels(task.eval)) == set(range(len(class_names)))  # every class of the task is scored
    mnist = stream[2]
    assert decode_image(mnist.eval[0]["image"], "mnist").size == (32, 32)
    sun = stream[5]  # test split only on the Hub: 15 rows split 12 / 3, stratified
    assert sorted(_labels(sun.eval)) == [0, 1, 2]
    requested = {entry.path for entry in mtil_hub.request_log}
    assert not any(path.endswith("/resolve/main/README.md") for path in requested), "load_dataset(repo) was used"


def test_mtil_stream_pins_revisions_and_reads_shards_in_order(mtil_hub, tmp_path: Path) -> None:
    repo = MTIL_REPOS["CIFAR100"]
    mtil_hub.store.commit("dataset", repo, "main", [("add", "classnames.txt", b"w\nx\ny\nz\n")], "Rename")
    latest = mtil_stream(datasets=["CIFAR100", "Cars"], cache_dir=tmp_path / "a")
    assert latest.name == "mtil" and latest.task_names == ["CIFAR100", "StanfordCars"]
    assert latest[0].class_names == ["w", "x", "y", "z"]
    assert (len(latest[0].train), len(latest[0].eval)) == (8, 8)
    assert _ids(latest[0].train) == [f"cifar100/train/{i}" for i in range(8)]
    pinned = mtil_stream(datasets=["CIFAR100"], revision={"cifar100": mtil_hub.commits["CIFAR100"]},
                         cache_dir=tmp_path / "b")
    assert pinned[0].class_names == FAKE_REPOS["CIFAR100"][0]
    data = load_wds_classification(repo, revision=mtil_hub.commits["CIFAR100"], cache_dir=tmp_path / "c")
    assert data.commit == mtil_hub.commits["CIFAR100"] and data.image_column == "webp"
    assert set(data.splits) == {"train", "test"}
    assert {"webp", "cls", "__key__", "__url__"} <= set(data.splits["train"].column_names)
    assert data.splits["train"]["__key__"] == [f"s{i:07d}" for i in range(8)]  # shard 0, then shard 1


def test_shards_are_listed_per_split_in_shard_order() -> None:
    files = ["classnames.txt", "train/10.tar", "train/2.tar", "train/nshards.txt", "test/0.tar", "train/x/0.tar",
             "train/0.tar"]
    assert _shards_by_split(files, ["train", "test", "validation"]) == {
        "train": ["train/0.tar", "train/2.tar", "train/10.tar"], "test": ["test/0.tar"]}


def test_mtil_stream_from_a_local_folder(shared_data_root, tmp_path: Path) -> None:
    images = _cifar_images(shared_data_root, 10)
    folder = tmp_path / "wds_mnist"
    for path, content in _wds_files(images, [str(k) for k in range(10)], {"train": 30, "test": 20}, key="jpg",
                                    per_shard=12, templates=('a photo of the number: "{c}".',)).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(content)
    stream = mtil_stream(datasets=["MNIST"], sources={"mnist": str(folder)}, max_eval_per_task=10,
                         cache_dir=tmp_path / "datasets")
    task = stream[0]
    _check_task(task, [str(k) for k in range(10)], 30, 10)
    assert task.train[0]["texts"] == ['a photo of the number: "0".']
    with pytest.raises(ValueError, match="revision='main' given for the local folder"):
        mtil_stream(datasets=["MNIST"], sources={"MNIST": str(folder)}, revision="main")
    (folder / "classnames.txt").unlink()
    with pytest.raises(ValueError, match="has no classnames.txt"):
        mtil_stream(datasets=["MNIST"], sources={"MNIST": str(folder)})


def test_stratified_holdout() -> None:
    labels = [0] * 10 + [1] * 5 + [2] * 2 + [3]
    kept, held = stratified_holdout(labels, 0.2)
    assert sorted([*kept, *held]) == list(range(len(labels)))
    assert [labels[i] for i in held].count(0) == 2 and [labels[i] for i in held].count(1) == 1
    assert [labels[i] for i in held].count(2) == 1 and 17 in kept  # a lone class stays in train
    assert [h.tolist() for h in stratified_holdout(labels, 0.2)] == [kept.tolist(), held.tolist()]


def test_named_mtil_stream_options() -> None:
    from hf_ccl.data.named import stream_options

    assert stream_options("mtil")[-5:] == ["order", "datasets", "revision", "sources", "holdout_fraction"]
    with pytest.raises(ValueError, match=r"order must be one of \['I', 'II'\]"):
        build_stream("mtil", order="3")
