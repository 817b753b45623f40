"""Users' own data: single data files, image paths relative to their file, streaming for every builder, and the
report of dropped rows. The files are written to tmp_path from the bundled fashion images (never into the repo)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from datasets import Dataset, DatasetDict, IterableDataset, load_dataset
from datasets import Image as ImageFeature

from hf_ccl.cli import main
from hf_ccl.data import (
    NO_TASK,
    MissingImageError,
    TaskSource,
    decode_image,
    is_streaming,
    load_split,
    stream_by_class,
    stream_by_column,
    stream_by_time,
    stream_from_datasets,
    stream_random_split,
    to_streaming,
)
from hf_ccl.data.spec import build_stream_from_spec

N_ROWS, N_TRAIN = 48, 36
CATEGORIES = ("a", "b", "c")  # "c" is in no task of the by_column streams below
KINDS = ("x", "y")


def _row(index: int, title: str, image: str) -> dict[str, Any]:
    """Row `index` of the toy table: empty, blank or real captions, three categories, years with gaps, kinds."""
    caption = None if index % 8 == 0 else "   " if index % 8 == 4 else title
    return {
        "image": image,
        "caption": caption,
        "category": CATEGORIES[index % 3],
        "year": None if index % 11 == 5 else 2010 + index % 4,
        "kind": None if index % 7 == 3 else KINDS[index % 2],
    }


@pytest.fixture(scope="module")
def own_data(tmp_path_factory, shared_data_root) -> dict[str, Any]:
    """`mydata/images/<i>.jpg` and the table as train/test files of every format, image paths relative to them;
    row 1 holds an absolute path."""
    folder = tmp_path_factory.mktemp("own") / "mydata"
    (folder / "images").mkdir(parents=True)
    raw = load_dataset(str(shared_data_root / "fashion"), split="train").select(range(N_ROWS))
    raw = raw.cast_column("image", ImageFeature(decode=False))
    rows = []
    for index, (image, title) in enumerate(zip(raw["image"], raw["title"], strict=True)):
        (folder / "images" / f"{index}.jpg").write_bytes(image["bytes"])
        path = str(folder / "images" / f"{index}.jpg") if index == 1 else f"images/{index}.jpg"
        rows.append(_row(index, title, path))
    splits = {"train": Dataset.from_list(rows[:N_TRAIN]), "test": Dataset.from_list(rows[N_TRAIN:])}
    for split, table in splits.items():
        table.to_csv(folder / f"{split}.csv", index=False)
        table.to_csv(folder / f"{split}.tsv", index=False, sep="\t")
        table.to_json(folder / f"{split}.jsonl")
        table.to_json(folder / f"{split}.json", lines=False)
        table.to_parquet(folder / f"{split}.parquet")
    return {"folder": folder, "rows": rows, "train": rows[:N_TRAIN], "test": rows[N_TRAIN:]}


def _usable(row: dict[str, Any]) -> bool:
    return bool(row["caption"] and row["caption"].strip())


def _expected_by_category(rows: list[dict[str, Any]], category: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(row["image"], (row["caption"].strip(),)) for row in rows if row["category"] == category and _usable(row)]


def _pairs(split: Dataset | IterableDataset, folder: Path) -> Counter:
    """(image path relative to `folder`, texts, label) of every row."""
    return Counter((Path(r["image"]["path"]).relative_to(folder).as_posix(), tuple(r["texts"]), r["label"])
                   for r in split)


def _relative(image: str, folder: Path) -> str:
    return Path(image).relative_to(folder).as_posix() if os.path.isabs(image) else image


# ---------------------------------------------------------------- single-file sources and relative paths


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet"])
def test_single_files_of_every_format_with_paths_relative_to_the_file(own_data, suffix, tmp_path, monkeypatch):
    folder = own_data["folder"]
    monkeypatch.chdir(tmp_path)  # another working directory: paths must resolve against the file's folder
    stream = stream_by_column(folder / f"train{suffix}", folder / f"test{suffix}", "category", ["a", "b"],
                              text_column="caption")
    assert stream.name == f"train{suffix}-by-category" and stream.task_names == ["a", "b"]
    for task in stream:
        for split, rows in ((task.train, own_data["train"]), (task.eval, own_data["test"])):
            expected = Counter((_relative(image, folder), texts, -1)
                               for image, texts in _expected_by_category(rows, task.name))
            assert _pairs(split, folder) == expected
    first = stream[0].train[0]
    assert first["image_id"] == f"train{suffix}/train/3"  # row 0 has no caption
    assert decode_image(first["image"], first["image_id"]).size == (64, 64)
    absolute = [r for r in stream[1].train if r["image_id"].endswith("/1")]  # row 1: an absolute path, kept
    assert absolute[0]["image"]["path"] == own_data["train"][1]["image"]


def test_source_errors_name_the_file_and_what_was_expected(own_data, tmp_path):
    folder = own_data["folder"]
    with pytest.raises(ValueError, match=r"train.csv'.*holds a single split.*pass `eval`"):
        stream_by_column(folder / "train.csv", None, "category", ["a"], text_column="caption")
    with pytest.raises(FileNotFoundError, match=r"'.*trian.csv' not found: expected .*\.parquet, \.csv.*Hub"):
        stream_by_column(str(folder / "trian.csv"), folder / "test.csv", "category", ["a"], text_column="caption")
    with pytest.raises(FileNotFoundError, match="'./nowhere/data' not found"):
        load_split("./nowhere/data", "train")
    notes = tmp_path / "notes.txt"
    notes.write_text("image,caption\n")
    with pytest.raises(ValueError, match=r"notes.txt' has suffix '.txt'; expected one of .parquet, .csv, .tsv"):
        load_split(notes, "train")
    with pytest.raises(ValueError, match=r"has no split 'validation'.*set train_split/eval_split"):
        stream_by_column(folder / "train.csv", folder, "category", ["a"], text_column="caption",
                         eval_split="validation")


def _table(images: list[str]) -> Dataset:
    return Dataset.from_dict({"image": images, "caption": [f"row {i}" for i in range(len(images))]})


def test_missing_image_names_the_file_and_the_row(own_data, tmp_path):
    folder = own_data["folder"]
    bad = _table(["images/0.jpg", "images/1.jpg", "images/2.jpg", "images/404.jpg"])
    bad.to_csv(folder / "bad.csv", index=False)
    with pytest.raises(MissingImageError) as error:
        stream_from_datasets([TaskSource("t", folder / "bad.csv", folder / "test.csv", text_column="caption")])
    message = str(error.value)
    for part in (str(folder / "bad.csv"), "row 3", "'images/404.jpg'", str(folder / "images" / "404.jpg"),
                 f"relative paths resolve against {folder}"):
        assert part in message
    _table(["images/0.jpg", "https://example.com/cat.jpg"]).to_json(folder / "urls.jsonl")
    with pytest.raises(MissingImageError, match=r"urls.jsonl, row 1, column 'image': .* is a URL"):
        stream_from_datasets([TaskSource("t", folder / "urls.jsonl", folder / "test.csv", text_column="caption")])


def test_save_to_disk_folders_and_a_folder_of_csv_files(own_data, tmp_path):
    folder, train = own_data["folder"], own_data["train"]
    csv_folder = tmp_path / "csvs"
    (csv_folder / "pics").mkdir(parents=True)
    for index in range(N_ROWS):
        (csv_folder / "pics" / f"{index}.jpg").write_bytes((folder / "images" / f"{index}.jpg").read_bytes())
    tables = {split: Dataset.from_list([{**r, "image": f"pics/{i}.jpg"} for i, r in rows])
              for split, rows in (("train", enumerate(train)), ("test", enumerate(own_data["test"], N_TRAIN)))}
    for split, table in tables.items():
        table.to_csv(csv_folder / f"{split}.csv", index=False)
    by_folder = stream_by_column(csv_folder, None, "category", ["a"], text_column="caption")  # eval: its test.csv
    assert len(by_folder[0].eval) == len(_expected_by_category(own_data["test"], "a"))
    assert Path(by_folder[0].train[0]["image"]["path"]).parent == csv_folder / "pics"
    # paths in a save_to_disk folder resolve against that folder
    saved = DatasetDict({s: t.map(lambda r: {"image": f"../{r['image']}"}) for s, t in tables.items()})
    saved["train"].save_to_disk(csv_folder / "saved-train")
    saved.save_to_disk(csv_folder / "saved-dict")
    single = stream_by_column(csv_folder / "saved-train", csv_folder / "saved-dict", "category", ["a"],
                              text_column="caption")
    assert single.name == "saved-train-by-category"
    assert _pairs(single[0].train, csv_folder) == _pairs(by_folder[0].train, csv_folder)
    assert len(single[0].eval) == len(by_folder[0].eval)


# ---------------------------------------------------------------- streaming, every builder


def _content(split: Dataset | IterableDataset) -> Counter:
    """Rows by content: image (path or bytes), texts, label (streamed ids differ from row numbers)."""
    return Counter((r["image"]["path"] or r["image"]["bytes"], tuple(r["texts"]), r["label"]) for r in split)


def _assert_same_rows(plain, streamed, *, same_ids: bool) -> None:
    assert plain.task_names == streamed.task_names
    for a, b in zip(plain, streamed, strict=True):
        assert not is_streaming(a.train) and is_streaming(b.train) and not is_streaming(b.eval)
        assert _content(b.train) == _content(a.train)
        assert b.eval["image_id"] == a.eval["image_id"] and b.class_names == a.class_names
        if same_ids:
            assert Counter(r["image_id"] for r in b.train) == Counter(a.train["image_id"])


def test_every_builder_streams_the_same_rows(own_data):
    folder = own_data["folder"]
    train, test = folder / "train.csv", folder / "test.jsonl"
    caption = {"text_column": "caption"}
    builds = {
        "by_column": lambda **o: stream_by_column(train, test, "category", ["a", ["b", "c"]], **caption, **o),
        "by_class": lambda **o: stream_by_class(train, test, [["x"], ["y"]], label_column="kind",
                                                class_names=list(KINDS), **o),
        "by_time": lambda **o: stream_by_time(train, test, "year", [2011, 2013], **caption, **o),
        "datasets": lambda **o: stream_from_datasets(
            [TaskSource("b", train, test, where={"category": "b"}, **caption),
             TaskSource("kinds", folder / "train.parquet", folder / "test.parquet", label_column="kind",
                        class_names=list(KINDS))], **o),
    }
    for name, build in builds.items():
        plain, streamed = build(), build(streaming=True, shuffle_buffer=8)
        assert isinstance(streamed[0].train, IterableDataset), name
        _assert_same_rows(plain, streamed, same_ids=False)
    # a random equal split needs the row count: the source is read once, then the train splits stream from Arrow
    plain = stream_random_split(train, test, 2, seed=3, **caption)
    _assert_same_rows(plain, stream_random_split(train, test, 2, seed=3, streaming=True, num_shards=2, **caption),
                      same_ids=True)
    # in-memory sources (their relative paths resolve against the working directory) stream from their Arrow
    # files, with the same image ids
    memory = {name: load_split(path, "train").map(lambda r: {"image": str(folder / r["image"])})
              for name, path in (("train", folder / "train.jsonl"), ("test", test))}
    _assert_same_rows(stream_by_column(memory["train"], memory["test"], "category", ["a"], **caption),
                      stream_by_column(memory["train"], memory["test"], "category", ["a"], streaming=True, **caption),
                      same_ids=True)
    first = stream_by_column(train, test, "category", ["a"], streaming=True, shuffle_buffer=None,
                             max_train_per_task=3, **caption)
    assert [r["texts"] for r in first[0].train] == [[c] for _, (c,) in _expected_by_category(own_data["train"],
                                                                                          "a")[:3]]


def test_streaming_refuses_bad_options_before_reading(own_data):
    folder = own_data["folder"]
    with pytest.raises(ValueError, match="num_shards must be a positive integer, got 0"):
        stream_random_split(folder / "train.csv", folder / "test.csv", 2, text_column="caption", streaming=True,
                            num_shards=0)
    with pytest.raises(ValueError, match="shuffle_buffer must be a non-negative integer or None, got -1"):
        stream_by_column(folder / "train.csv", folder / "test.csv", "category", ["a"], text_column="caption",
                         streaming=True, shuffle_buffer=-1)
    with pytest.raises(ValueError, match="streaming must be true or false, got 'yes'"):
        stream_by_class(folder / "train.csv", folder / "test.csv", [["x"]], label_column="kind", streaming="yes")
    with pytest.raises(ValueError, match="pass class_names for label column 'kind'"):
        stream_by_class(folder / "train.csv", folder / "test.csv", [["x"]], label_column="kind", streaming=True)


# ---------------------------------------------------------------- the drop report


def _count(rows: list[dict[str, Any]], keep) -> int:  # noqa: ANN001
    return sum(1 for row in rows if keep(row))


def test_dropped_rows_are_counted_per_task_split_and_reason(own_data, caplog):
    folder = own_data["folder"]
    train, test = own_data["train"], own_data["test"]
    caplog.set_level(logging.INFO, logger="hf_ccl.data.dropped")
    stream = stream_by_column(folder / "train.csv", folder / "test.csv", "category", ["a", "b"],
                              text_column="caption", max_train_per_task=5)
    no_caption = {split: {c: _count(rows, lambda r, c=c: r["category"] == c and not _usable(r)) for c in "ab"}
                  for split, rows in (("train", train), ("eval", test))}
    usable_a = _count(train, lambda r: r["category"] == "a" and _usable(r))
    assert stream.dropped == {
        "a": {"train": {"no caption": no_caption["train"]["a"], "over max_train_per_task": usable_a - 5},
              "eval": {"no caption": no_caption["eval"]["a"]}},
        "b": {"train": {"no caption": no_caption["train"]["b"], "over max_train_per_task":
                        _count(train, lambda r: r["category"] == "b" and _usable(r)) - 5},
              "eval": {"no caption": no_caption["eval"]["b"]}},
        NO_TASK: {"train": {"category value in no task": _count(train, lambda r: r["category"] == "c")},
                  "eval": {"category value in no task": _count(test, lambda r: r["category"] == "c")}},
    }
    assert min(no_caption["train"].values()) > 0 and json.loads(json.dumps(stream.dropped)) == stream.dropped
    records = [r for r in caplog.records if r.name == "hf_ccl.data.dropped"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "task 'a': train: no caption" in records[0].getMessage()
    assert to_streaming(stream).dropped == stream.dropped

    timed = stream_by_time(folder / "train.csv", folder / "test.csv", "year", [2011, 2012], text_column="caption")
    no_year = _count(train, lambda r: r["year"] is None)
    assert no_year > 0 and timed.unassigned["train"] == {
        "no timestamp": no_year, "after the last time step": _count(train, lambda r: r["year"] == 2013)}
    assert timed.dropped["2011"]["train"] == {
        "no caption": _count(train, lambda r: r["year"] in (2010, 2011) and not _usable(r))}

    classes = stream_by_class(folder / "train.csv", folder / "test.csv", [["x"]], label_column="kind")
    assert classes.unassigned["train"] == {"no label": _count(train, lambda r: r["kind"] is None),
                                           "class in no task": _count(train, lambda r: r["kind"] == "y")}
    split = stream_random_split(folder / "train.csv", folder / "test.csv", 2, text_column="caption")
    assert split.dropped == {NO_TASK: {"train": {"no caption": _count(train, lambda r: not _usable(r))},
                                       "eval": {"no caption": _count(test, lambda r: not _usable(r))}}}


# ---------------------------------------------------------------- YAML specs and a run


def _spec(**extra: Any) -> dict[str, Any]:
    return {"builder": "by_column", "train": "mydata/train.csv", "eval": "mydata/test.csv", "column": "category",
            "values": ["a", "b"], "text_column": "caption", **extra}


def test_yaml_spec_with_files_under_the_data_root(own_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = own_data["folder"].parent
    plain = build_stream_from_spec(_spec(), data_root=root, max_eval_per_task=2)
    streamed = build_stream_from_spec(_spec(streaming=True), data_root=root, max_eval_per_task=2)
    assert plain.task_names == streamed.task_names == ["a", "b"]
    assert [len(t.eval) for t in plain] == [2, 2] and is_streaming(streamed[1].train)
    assert _content(streamed[1].train) == _content(plain[1].train)
    assert plain.dropped[NO_TASK]["eval"] == {"category value in no task": _count(own_data["test"],
                                                                                  lambda r: r["category"] == "c")}


def test_short_run_on_a_csv_stream_from_another_working_directory(own_data, tmp_path, monkeypatch):
    config = {
        "stream": _spec(name="my-csv"), "data_root": str(own_data["folder"].parent), "methods": ["finetune"],
        "output_dir": str(tmp_path / "run"), "progress": False, "evaluation": {"initial": False},
        "model": {"pretrained": None, "config": {"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                                  "image_size": 32, "patch_size": 8, "projection_dim": 32}},
        "training": {"max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1},
    }
    path = tmp_path / "csv-run.yaml"
    path.write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--config", str(path)]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [row["label"] for row in results["rows"]] == ["a", "b"]
    assert (tmp_path / "run" / "task-1" / "model.safetensors").is_file() and not any(elsewhere.iterdir())


def _write_bad_file(folder: Path, case: str) -> Path:
    """A train file that cannot give a task: 0 bytes, a parquet schema without rows, an integer image column."""
    path = folder / f"{case}.parquet"
    rows = [{"image": index, "caption": f"a photo {index}", "category": "a"} for index in range(4)]
    if case == "empty":
        path.write_bytes(b"")
    elif case == "no-rows":
        Dataset.from_list(rows).select([]).to_parquet(path)
    else:
        Dataset.from_list(rows).to_parquet(path)
    return path


@pytest.mark.parametrize(("case", "message"), [
    ("empty", r"Data file '.*empty.parquet' is empty \(0 bytes\)"),
    ("no-rows", r"Data file '.*no-rows.parquet' has no rows"),
    ("int-image", r".*int-image.parquet: image column 'image' holds int64 values; it must hold images"),
])
def test_a_data_file_that_cannot_give_a_task_is_one_line_naming_it(own_data, tmp_path, capsys, case, message):
    """Through the CLI with a YAML spec (README "Your own data"): exit 1 before any model is built or anything
    written, one line naming the file (and the column), never a pyarrow or datasets traceback."""
    train = _write_bad_file(tmp_path, case)
    config = {"stream": {**_spec(), "train": str(train), "eval": str(own_data["folder"] / "test.csv")},
              "output_dir": str(tmp_path / "run"), "progress": False}
    path = tmp_path / "bad-data.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hf-ccl: error: ") and re.search(message, err), err
    assert not (tmp_path / "run").exists()
