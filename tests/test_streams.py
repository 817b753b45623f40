"""Stream builders and named streams on the real bundled data (small per-task sizes keep this fast)."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from datasets import ClassLabel, Dataset, Features, Image, List, Value, load_dataset
from PIL import Image as PILImage

from hf_ccl.data import (
    CANONICAL_COLUMNS,
    DIGIT_CLASS_NAMES,
    NAMED_STREAMS,
    CorruptImageError,
    TaskSource,
    build_stream,
    decode_image,
    stream_by_class,
    stream_by_column,
    stream_from_datasets,
    stream_random_split,
    to_canonical,
    validate_images,
)
from hf_ccl.data.builders import load_split, stratified_subsample, subsample

SMALL = {"max_train_per_task": 40, "max_eval_per_task": 30}
EXPECTED = {
    "digits": (["digits-01", "digits-23", "digits-45", "digits-67", "digits-89"], ["classification"] * 5),
    "flickr8k-random5": ([f"flickr8k-{i}" for i in range(5)], ["retrieval"] * 5),
    "domains5": (
        ["flickr8k", "fashion", "rsscn7", "pacs-art_painting", "pacs-sketch"],
        ["retrieval", "retrieval", "classification", "classification", "classification"],
    ),
    "pacs-domains": (["photo", "art_painting", "cartoon", "sketch"], ["classification"] * 4),
    "fashion-categories": (["apparel", "accessories", "footwear", "personal-care"], ["retrieval"] * 4),
}


def _png(color: int = 128) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (8, 8), (color, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def _ids(dataset: Dataset) -> list[str]:
    return dataset.with_format("arrow")["image_id"].to_pylist()


# ---------------------------------------------------------------- named streams


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_stream_builds(name: str, shared_data_root) -> None:
    stream = build_stream(name, data_root=shared_data_root, **SMALL)
    names, kinds = EXPECTED[name]
    assert stream.name == name
    assert stream.task_names == names
    assert [task.kind for task in stream] == kinds
    all_ids: list[str] = []
    for task in stream:
        for split in (task.train, task.eval):
            assert tuple(split.column_names) == CANONICAL_COLUMNS
            assert 0 < len(split) <= 40
            assert split.features["image"] == Image(decode=False)
            row = split[0]
            assert row["texts"] and all(isinstance(t, str) and t for t in row["texts"])
            assert decode_image(row["image"], row["image_id"]).mode == "RGB"
        labels = set(task.train["label"]) | set(task.eval["label"])
        if task.kind == "classification":
            assert task.class_names and labels <= set(range(len(task.class_names)))
            assert task.eval_templates and all("{label}" in t for t in task.eval_templates)
            assert len(task.eval_templates) >= 3
        else:
            assert labels == {-1} and task.class_names is None
        all_ids += _ids(task.train)
    assert len(all_ids) == len(set(all_ids)), "image ids repeat across the tasks of a stream"


def test_named_stream_registry_and_unknown_name() -> None:
    assert set(EXPECTED) <= set(NAMED_STREAMS)
    with pytest.raises(ValueError, match="Unknown stream 'nope'.*digits.*domains5"):
        build_stream("nope")


def test_named_stream_texts_and_templates(shared_data_root) -> None:
    stream = build_stream("domains5", data_root=shared_data_root, max_train_per_task=5, max_eval_per_task=5)
    flickr, fashion, rsscn7, art, sketch = stream.tasks
    assert len(flickr.train[0]["texts"]) == 5
    assert len(fashion.train[0]["texts"]) == 1
    assert rsscn7.train[0]["texts"][0].startswith("an aerial photo of a ")
    assert art.train[0]["texts"][0].startswith("a painting of a ")
    assert sketch.eval[0]["texts"][0].startswith("a sketch of a ")
    assert sketch.class_names == ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]
    assert _ids(sketch.train)[0].startswith("pacs/train/") and _ids(sketch.eval)[0].startswith("pacs/test/")


def test_full_sizes_of_named_streams(shared_data_root) -> None:
    stream = build_stream("fashion-categories", data_root=shared_data_root)
    assert [(len(t.train), len(t.eval)) for t in stream] == [(779, 217), (388, 80), (344, 73), (90, 20)]
    pacs = build_stream("pacs-domains", data_root=shared_data_root)
    assert [(len(t.train), len(t.eval)) for t in pacs] == [(1343, 327), (1612, 436), (1882, 462), (3122, 807)]


def test_digits_label_spaces() -> None:
    stream = build_stream("digits", max_train_per_task=20)
    task = stream[1]
    assert task.class_names == ["two", "three"]
    assert set(task.train["label"]) == {0, 1}
    assert task.train[0]["texts"] == [f"a photo of the digit {task.class_names[task.train[0]['label']]}."]
    image = decode_image(task.train[0]["image"], "digits")
    assert image.size == (32, 32) and image.mode == "RGB"
    everything = build_stream("digits", max_train_per_task=20, label_space="all")
    assert everything[1].class_names == list(DIGIT_CLASS_NAMES)
    assert set(everything[1].train["label"]) == {2, 3}
    full = build_stream("digits")
    assert sum(len(t.train) for t in full) + sum(len(t.eval) for t in full) == 1797
    assert [len(t.eval) for t in full] == [72, 72, 72, 72, 71]


# ---------------------------------------------------------------- generic builders


def test_random_split_is_an_equal_reproducible_partition(shared_data_root) -> None:
    path = shared_data_root / "flickr8k"
    first = stream_random_split(path, None, 5, seed=1, text_column="en")
    train_ids = [_ids(task.train) for task in first]
    eval_ids = [_ids(task.eval) for task in first]
    assert [len(ids) for ids in train_ids] == [1200] * 5 and [len(ids) for ids in eval_ids] == [200] * 5
    for ids, n_rows, split in ((train_ids, 6000, "train"), (eval_ids, 1000, "test")):
        union = {i for part in ids for i in part}
        assert len(union) == n_rows, "parts overlap or miss rows"
        assert union == {f"flickr8k/{split}/{row}" for row in range(n_rows)}
    again = stream_random_split(path, None, 5, seed=1, text_column="en")
    assert [_ids(task.train) for task in again] == train_ids
    other = stream_random_split(path, None, 5, seed=2, text_column="en")
    assert [_ids(task.train) for task in other] != train_ids


def test_subsample_is_seeded(shared_data_root) -> None:
    path = shared_data_root / "pacs"
    kwargs = dict(label_column="label", max_train_per_task=25, max_eval_per_task=10)
    a = stream_by_column(path, None, "domain", ["sketch"], seed=0, **kwargs)
    b = stream_by_column(path, None, "domain", ["sketch"], seed=0, **kwargs)
    c = stream_by_column(path, None, "domain", ["sketch"], seed=5, **kwargs)
    assert _ids(a[0].train) == _ids(b[0].train) != _ids(c[0].train)
    assert len(a[0].train) == 25 and len(a[0].eval) == 10


def test_stratified_subsample_takes_an_equal_number_per_class() -> None:
    labels = ["a"] * 50 + ["b"] * 30 + ["c"] * 4 + ["d"] * 16
    rows = np.arange(100, 200)
    chosen = stratified_subsample(rows, labels, 30, 0, "stream", "task", "eval")
    counts = Counter(labels[row - 100] for row in chosen)
    # 30 // 4 = 7 per class, c gives its 4 and keeps its share; 30 % 4 = 2 classes among a, b, d get an 8th row
    assert counts["c"] == 4 and sorted(counts[k] for k in "abd") == [7, 8, 8] and len(chosen) == 27
    assert list(chosen) == sorted(set(chosen)) and set(chosen) <= set(rows)
    assert np.array_equal(chosen, stratified_subsample(rows, labels, 30, 0, "stream", "task", "eval"))
    assert not np.array_equal(chosen, stratified_subsample(rows, labels, 30, 1, "stream", "task", "eval"))
    assert not np.array_equal(chosen, stratified_subsample(rows, labels, 30, 0, "stream", "other", "eval"))
    few = stratified_subsample(rows, labels, 3, 0, "k")  # fewer rows than classes: one row from each of 3 classes
    assert len(few) == 3 and len({labels[row - 100] for row in few}) == 3
    assert np.array_equal(stratified_subsample(rows, labels, 100, 0, "k"), rows)
    assert np.array_equal(stratified_subsample(rows, labels, None, 0, "k"), rows)


def test_only_classification_eval_splits_are_stratified(shared_data_root) -> None:
    limits = dict(max_train_per_task=40, max_eval_per_task=14, seed=3)
    sketch = stream_by_column(shared_data_root / "pacs", None, "domain", ["sketch"], label_column="label", **limits)[0]
    eval_counts = Counter(sketch.eval["label"])
    assert sorted(eval_counts.values()) == [2] * 7  # 14 // 7 classes
    assert len(sketch.train) == 40 and max(Counter(sketch.train["label"]).values()) > 6  # train: at random
    # captioned (retrieval) eval rows: the seeded random subsample, keyed by stream, task and split
    footwear = stream_by_column(shared_data_root / "fashion", None, "master_category", ["Footwear"],
                                text_column="title", **limits)[0]
    test = load_split(shared_data_root / "fashion", "test")
    rows = np.asarray([i for i, (category, title) in enumerate(zip(test["master_category"], test["title"],
                                                                    strict=True)) if category == "Footwear" and title])
    expected = subsample(rows, 14, 3, "fashion-by-master_category", "Footwear", "eval")
    assert _ids(footwear.eval) == [f"fashion/test/{row}" for row in expected]


def test_by_column_with_grouped_values(shared_data_root) -> None:
    path = shared_data_root / "fashion"
    stream = stream_by_column(path, None, "year", [[2011, 2012], "2016"], text_column="title")
    assert stream.task_names == ["2011+2012", "2016"]
    raw = load_dataset(str(path), split="train")
    years = raw["year"]
    assert len(stream[0].train) == sum(1 for y in years if y in (2011, 2012))
    assert len(stream[1].train) == sum(1 for y in years if y == 2016)
    first_row = int(_ids(stream[1].train)[0].rsplit("/", 1)[1])
    assert raw[first_row]["year"] == 2016
    assert stream[1].train[0]["texts"] == [raw[first_row]["title"]]


def test_stream_by_class_names_and_groups(shared_data_root) -> None:
    path = shared_data_root / "cifar10"
    stream = stream_by_class(
        path, None, [["cat", "dog"], [0, 1]], max_train_per_task=30, max_eval_per_task=30
    )
    assert stream.task_names == ["cat+dog", "airplane+automobile"]
    assert stream[0].class_names == ["cat", "dog"] and set(stream[0].train["label"]) == {0, 1}


def test_stream_from_datasets_accepts_mappings_and_tuples(shared_data_root) -> None:
    root = shared_data_root
    stream = stream_from_datasets(
        [
            {"name": "rs", "train": root / "rsscn7", "label_column": "label"},
            ("fl", root / "flickr8k", root / "flickr8k", {"text_column": "de", "eval_split": "validation"}),
            TaskSource(
                name="cartoon", train=root / "pacs", label_column="label", where={"domain": "cartoon"}
            ),
        ],
        name="mixed",
        max_train_per_task=10,
        max_eval_per_task=10,
    )
    assert stream.task_names == ["rs", "fl", "cartoon"]
    assert [t.kind for t in stream] == ["classification", "retrieval", "classification"]
    assert stream[0].train[0]["texts"][0].startswith("a photo of a ")
    assert _ids(stream[1].eval)[0].startswith("flickr8k/validation/")


# ---------------------------------------------------------------- canonical conversion


def _captioned() -> Dataset:
    features = Features({"picture": Image(), "caps": List(Value("string")), "kind": Value("string")})
    return Dataset.from_dict(
        {
            "picture": [{"bytes": _png(c), "path": None} for c in (10, 20, 30, 40)],
            "caps": [["one", "uno"], [], ["three"], ["", "four"]],
            "kind": ["a", "b", "a", "b"],
        },
        features=features,
    )


def test_to_canonical_captions_drop_empty_and_keep_row_ids() -> None:
    out = to_canonical(_captioned(), source="toy", split="train", text_column="caps", image_column="picture")
    assert tuple(out.column_names) == CANONICAL_COLUMNS
    assert out["texts"] == [["one", "uno"], ["three"], ["four"]]
    assert out["image_id"] == ["toy/train/0", "toy/train/2", "toy/train/3"]
    assert out["label"] == [-1, -1, -1]
    subset = to_canonical(
        _captioned(), source="toy", split="train", text_column="caps", image_column="picture", indices=[3, 2]
    )
    assert subset["image_id"] == ["toy/train/3", "toy/train/2"]


def test_to_canonical_labels_from_strings_and_classlabel() -> None:
    by_string = to_canonical(
        _captioned(),
        source="toy",
        split="train",
        label_column="kind",
        image_column="picture",
        train_templates=["a {label} thing", "the {label}"],
    )
    assert by_string["label"] == [0, 1, 0, 1]
    assert by_string[1]["texts"] == ["a b thing", "the b"]
    ordered = to_canonical(
        _captioned(),
        source="toy",
        split="train",
        label_column="kind",
        image_column="picture",
        class_names=["b", "a"],
    )
    assert ordered["label"] == [1, 0, 1, 0]
    labelled = Dataset.from_dict(
        {"image": [{"bytes": _png(), "path": None}] * 2, "y": [1, 0]},
        features=Features({"image": Image(), "y": ClassLabel(names=["cat", "dog"])}),
    )
    out = to_canonical(labelled, source="pets", split="test", label_column="y")
    assert out["texts"] == [["a photo of a dog."], ["a photo of a cat."]] and out["label"] == [1, 0]


# ---------------------------------------------------------------- errors raised before training


def test_missing_column_error_names_dataset_split_and_columns(shared_data_root) -> None:
    with pytest.raises(ValueError) as error:
        stream_by_column(
            shared_data_root / "fashion", None, "master_category", ["Apparel"], text_column="caption"
        )
    message = str(error.value)
    for part in ("'fashion'", "'train'", "'caption'", "title", "master_category"):
        assert part in message
    with pytest.raises(ValueError, match="'pacs', split 'train' has no column 'area'.*domain"):
        stream_by_column(shared_data_root / "pacs", None, "area", ["x"], label_column="label")
    with pytest.raises(ValueError, match="'toy', split 'train' has no column 'text'.*picture, caps, kind"):
        to_canonical(_captioned(), source="toy", split="train", text_column="text", image_column="picture")


def test_empty_task_error_lists_occurring_values(shared_data_root) -> None:
    path = shared_data_root / "fashion"
    with pytest.raises(ValueError) as error:
        stream_by_column(path, None, "master_category", ["Apparel", "Toys"], text_column="title", name="shop")
    message = str(error.value)
    for part in ("'shop'", "task 'Toys'", "split 'train'", "'fashion'", "'Apparel' (779)", "'Footwear'"):
        assert part in message
    with pytest.raises(ValueError, match="task 'Free Items', split 'test'.*Personal Care"):
        stream_by_column(path, None, "master_category", ["Free Items"], text_column="title")


def _corrupt() -> Dataset:
    images = [
        {"bytes": _png(), "path": None},
        {"bytes": _png(), "path": None},
        {"bytes": b"not an image at all", "path": None},
    ]
    return Dataset.from_dict(
        {"image": images, "caption": ["a", "b", "c"]},
        features=Features({"image": Image(), "caption": Value("string")}),
    )


def test_corrupt_image_is_named() -> None:
    with pytest.raises(CorruptImageError, match="bad/train, row 2"):
        validate_images(_corrupt(), "bad/train")
    canonical = to_canonical(_corrupt(), source="bad", split="train", text_column="caption")
    assert validate_images(canonical.select([0, 1]), "ok") == 2
    with pytest.raises(CorruptImageError, match="task 'only', split 'train'.*bad/train/2"):
        stream_from_datasets(
            [
                TaskSource(
                    name="only",
                    train=_corrupt(),
                    eval=_corrupt().select([0]),
                    text_column="caption",
                    source="bad",
                )
            ],
            validate_images=True,
        )


def test_missing_data_root_is_a_clear_error_not_a_hub_lookup(tmp_path):
    with pytest.raises(FileNotFoundError, match="pacs not found. Point data_root"):
        build_stream("pacs-domains", data_root=tmp_path)
