"""Time streams (TiC-CLIP): boundary and group semantics, dates, `fashion-years`, streaming train splits."""

from __future__ import annotations

import datetime as dt
import io
from collections import Counter

import pytest
from datasets import Dataset, DatasetDict, Features, IterableDataset, Value, load_dataset
from datasets import Image as ImageFeature
from PIL import Image as PILImage

import hf_ccl.data.collate as collate_module
from hf_ccl.continual import ContinualArguments, ContinualLearner, validate_stream
from hf_ccl.data import (
    CANONICAL_COLUMNS,
    CANONICAL_FEATURES,
    CLIPCollator,
    Task,
    TaskStream,
    build_stream,
    column_names,
    is_streaming,
    load_image_processor,
    load_tokenizer,
    stream_by_time,
    to_streaming,
)
from hf_ccl.data.spec import build_stream_from_spec
from hf_ccl.testing import tiny_clip

# Rows per catalogue year of the bundled fashion data, counted by hand from its `year` column (README of the folder).
FASHION_TRAIN = {2010: 30, 2011: 487, 2012: 623, 2013: 38, 2014: 4, 2015: 103, 2016: 201, 2017: 109, 2018: 12, 2019: 1}
FASHION_TEST = {2010: 9, 2011: 126, 2012: 138, 2013: 12, 2014: 2, 2015: 28, 2016: 49, 2017: 23, 2018: 3, 2019: 1}
FASHION_STEPS = {"2011": (2010, 2011), "2012": (2012,), "2013-2015": (2013, 2014, 2015), "2016": (2016,),
                 "2017-2019": (2017, 2018, 2019)}


def _png(shade: int) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (8, 8), (shade, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def _timed(times: list, time_type: Value | None = None) -> DatasetDict:
    """Rows with a caption `row <i>` and the given timestamps, the same rows in train and test."""
    features = Features({"image": ImageFeature(), "caption": Value("string"),
                         "t": time_type or Value("int64")})
    data = {"image": [{"bytes": _png(i), "path": None} for i in range(len(times))],
            "caption": [f"row {i}" for i in range(len(times))], "t": times}
    table = Dataset.from_dict(data, features=features)
    return DatasetDict({"train": table, "test": table})


def _rows(split: Dataset) -> list[int]:
    return sorted(int(i.rsplit("/", 1)[1]) for i in split["image_id"])


def _steps(stream: TaskStream) -> dict[str, list[int]]:
    for task in stream:
        assert _rows(task.train) == _rows(task.eval)
    return {task.name: _rows(task.train) for task in stream}


# ---------------------------------------------------------------- boundary semantics


def test_year_boundaries_include_their_end_and_drop_later_rows() -> None:
    data = _timed([2009, 2010, 2011, 2011, 2012, 2013, 2015, 2016, None])
    stream = stream_by_time(data, None, "t", [2010, 2012, 2015], text_column="caption", source="toy")
    assert stream.name == "toy-by-t"
    # step 0: t <= 2010; step i: b[i-1] < t <= b[i]; 2016 (after the last boundary) and the null are dropped
    assert _steps(stream) == {"2010": [0, 1], "2011-2012": [2, 3, 4], "2013-2015": [5, 6]}
    task = stream[1]
    assert task.kind == "retrieval" and task.source == "toy" and task.headline_metric == "R_mean"
    assert tuple(task.train.column_names) == CANONICAL_COLUMNS
    assert task.train["texts"] == [["row 2"], ["row 3"], ["row 4"]]


def test_explicit_groups_and_float_boundaries() -> None:
    data = _timed([2009, 2010, 2011, 2012, 2013, 2015, 2016])
    groups = stream_by_time(data, None, "t", [[2009, 2010], [2012], [2013, 2015]], text_column="caption")
    assert _steps(groups) == {"2009-2010": [0, 1], "2012": [3], "2013+2015": [4, 5]}
    floats = _timed([1.0, 1.5, 1.5000001, 2.5, 3.0], Value("float64"))
    stream = stream_by_time(floats, None, "t", [1.5, 2.5], text_column="caption", task_names=["early", "late"])
    assert _steps(stream) == {"early": [0, 1], "late": [2, 3]}


def test_iso_date_strings_name_whole_periods() -> None:
    times = ["2010-12-31T23:59:59Z", "2011-01-01", "2011-06-30T23:30:00-01:00", "2011-06-30T12:00:00+02:00",
             "2011-07-01", "2011-12-31T23:59:59", "2012-01-01T00:00:00", "2011"]
    data = _timed(times, Value("string"))
    # "2010": up to the end of 2010; "2011-06-30": to the end of that day (UTC); 2011: to the end of 2011
    stream = stream_by_time(data, None, "t", ["2010", "2011-06-30", 2011], text_column="caption")
    # 23:30 at UTC-1 is 00:30 UTC on July 1st; a bare "2011" is January 1st 2011; 2012-01-01 is dropped
    assert _steps(stream) == {"2010": [0], "2010..2011-06-30": [1, 3, 7], "2011-06-30..2011": [2, 4, 5]}


def test_arrow_timestamps_with_datetime_and_date_boundaries() -> None:
    times = [dt.datetime(2011, 3, 1, 12), dt.datetime(2011, 3, 2), dt.datetime(2011, 3, 2, 0, 0, 1),
             dt.datetime(2011, 3, 3, 18)]
    data = _timed(times, Value("timestamp[us]"))
    # a datetime boundary is an exact instant (included); a date covers its whole day
    stream = stream_by_time(data, None, "t", [dt.datetime(2011, 3, 2), dt.date(2011, 3, 3)], text_column="caption")
    assert _steps(stream) == {"2011-03-02T00:00:00": [0, 1], "2011-03-02T00:00:00..2011-03-03": [2, 3]}


@pytest.mark.parametrize(
    ("boundaries", "message"),
    [
        ([2012, 2011], "increase strictly"),
        ([2011, [2012]], "mixes end points and groups"),
        ([[2011], [2011, 2012]], "more than one group"),
        ([], "non-empty list"),
        ([2011.5, "x"], "is not a number"),
    ],
)
def test_bad_boundaries(boundaries, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        stream_by_time(_timed([2010, 2011, 2012]), None, "t", boundaries, text_column="caption")


def test_dates_reject_float_and_unreadable_boundaries() -> None:
    data = _timed(["2011-01-01", "2012-01-01"], Value("string"))
    with pytest.raises(TypeError, match="is not a date"):
        stream_by_time(data, None, "t", [2011.5], text_column="caption")
    with pytest.raises(ValueError, match="Cannot read 'soon' as an ISO-8601 date"):
        stream_by_time(data, None, "t", ["soon"], text_column="caption")


# ---------------------------------------------------------------- errors


def test_empty_step_names_the_step_and_counts_rows_per_step() -> None:
    data = _timed([2010, 2011, 2012, 2015, 2016, 2019])
    with pytest.raises(ValueError) as error:
        stream_by_time(data, None, "t", [2011, 2012, 2014, 2016], text_column="caption", source="toy")
    message = str(error.value)
    for part in ("time step '2013-2014'", "split 'train'", "'toy'", "2011: 2, 2012: 1, 2013-2014: 0, 2015-2016: 2",
                 "in no step (after the last boundary or no timestamp): 1"):
        assert part in message


def test_column_errors_name_the_column_and_the_existing_ones() -> None:
    data = _timed([2010, 2011])
    with pytest.raises(ValueError, match=r"no column 'year'; its columns are: image, caption, t"):
        stream_by_time(data, None, "year", [2011], text_column="caption")
    with pytest.raises(ValueError, match=r"no column 'title'"):
        stream_by_time(data, None, "t", [2011], text_column="title")
    flagged = data.map(lambda row: {"flag": row["t"] > 2010})
    with pytest.raises(ValueError, match="Time column 'flag' has feature Value.'bool'.; it must hold numbers"):
        stream_by_time(flagged, None, "flag", [1], text_column="caption")
    with pytest.raises(ValueError, match="task_names has 1 names for 2 time steps"):
        stream_by_time(data, None, "t", [2010, 2011], text_column="caption", task_names=["a"])


# ---------------------------------------------------------------- fashion-years


def test_fashion_years_counts_match_the_year_column(shared_data_root) -> None:
    raw = load_dataset(str(shared_data_root / "fashion"))
    assert dict(Counter(raw["train"]["year"])) == FASHION_TRAIN and dict(Counter(raw["test"]["year"])) == FASHION_TEST
    stream = build_stream("fashion-years", data_root=shared_data_root)
    assert stream.name == "fashion-years" and stream.task_names == list(FASHION_STEPS)
    for task, years in zip(stream, FASHION_STEPS.values(), strict=True):
        assert task.kind == "retrieval" and task.source == "fashion"
        assert len(task.train) == sum(FASHION_TRAIN[y] for y in years)
        assert len(task.eval) == sum(FASHION_TEST[y] for y in years)
        assert len(task.train) > 100 and len(task.eval) > 25
    first = stream[0].train[0]
    titles = dict(zip(raw["train"]["id"], raw["train"]["title"], strict=True))
    assert first["texts"] == [titles[first["image_id"].rsplit("/", 1)[1]]]  # captions = product titles


def test_by_time_spec(shared_data_root) -> None:
    spec = {"builder": "by_time", "train": "fashion", "time_column": "year", "boundaries": [[2016], [2017, 2018]],
            "text_column": "title"}
    stream = build_stream_from_spec(spec, data_root=shared_data_root, max_train_per_task=10)
    assert stream.task_names == ["2016", "2017-2018"] and [len(t.train) for t in stream] == [10, 10]


# ---------------------------------------------------------------- streaming


def _stream_ids(dataset: IterableDataset) -> Counter:
    return Counter(row["image_id"] for row in dataset)


def test_streaming_yields_the_same_rows(shared_data_root) -> None:
    mapped = build_stream("fashion-years", data_root=shared_data_root)
    streamed = build_stream("fashion-years", data_root=shared_data_root, streaming=True)  # load_dataset(streaming)
    local = load_dataset(str(shared_data_root / "fashion"))
    from_dataset = stream_by_time(local, None, "year", [2011, 2012, 2015, 2016, 2019], text_column="title",
                                  streaming=True, num_shards=3)  # Dataset.to_iterable_dataset
    plain = stream_by_time(local, None, "year", [2011, 2012, 2015, 2016, 2019], text_column="title")
    validate_stream(streamed)
    for a, b, c, d in zip(mapped, streamed, from_dataset, plain, strict=True):
        assert is_streaming(b.train) and is_streaming(c.train) and not is_streaming(b.eval)
        assert b.train.features == CANONICAL_FEATURES and column_names(b.train) == list(CANONICAL_COLUMNS)
        assert _stream_ids(b.train) == Counter(a.train["image_id"])
        assert _stream_ids(c.train) == Counter(d.train["image_id"])
        assert b.eval["image_id"] == a.eval["image_id"]
    rows = list(streamed[4].train.take(3))
    assert all(isinstance(row["image"], dict) and row["image"]["bytes"] for row in rows)  # never decoded
    batch = CLIPCollator(load_image_processor(32), load_tokenizer())(rows)
    assert batch["pixel_values"].shape == (3, 3, 32, 32)
    again = to_streaming(plain, shuffle_buffer=None)
    assert [row["image_id"] for row in again[0].train] == plain[0].train["image_id"]  # no shuffle: row order


def test_streaming_from_a_folder_without_ids_hashes_images(shared_data_root) -> None:
    path = shared_data_root / "fashion"
    stream = stream_by_time(path, None, "year", [[2019]], text_column="title", streaming=True)
    (row,) = list(stream[0].train)
    assert row["image_id"].startswith("fashion/train/") and len(row["image_id"].rsplit("/", 1)[1]) == 16


def test_validate_stream_on_streams() -> None:
    def rows(n: int, columns: tuple[str, ...] = CANONICAL_COLUMNS):
        values = {"image": {"bytes": _png(1), "path": None}, "texts": ["x"], "image_id": "a/b/0", "label": -1}
        for _ in range(n):
            yield {c: values.get(c, 0) for c in columns}

    evaluation = Dataset.from_dict({"image": [{"bytes": _png(1), "path": None}], "texts": [["x"]],
                                    "image_id": ["e"], "label": [-1]}, features=CANONICAL_FEATURES)

    def one_task(train: IterableDataset) -> TaskStream:
        return TaskStream("s", [Task("t", train, evaluation)])

    validate_stream(one_task(IterableDataset.from_generator(rows, gen_kwargs={"n": 2})))
    with pytest.raises(ValueError, match="the train split is empty"):
        validate_stream(one_task(IterableDataset.from_generator(rows, gen_kwargs={"n": 0})))
    with pytest.raises(ValueError, match=r"missing column\(s\) \['texts'\]"):
        validate_stream(one_task(IterableDataset.from_generator(
            rows, gen_kwargs={"n": 1, "columns": ("image", "image_id", "label")})))
    no_budget = ContinualArguments(output_dir="unused", progress=False)
    with pytest.raises(ValueError, match="streaming tasks need samples_per_task or training.max_steps"):
        validate_stream(one_task(IterableDataset.from_generator(rows, gen_kwargs={"n": 1})), no_budget)
    validate_stream(one_task(IterableDataset.from_generator(rows, gen_kwargs={"n": 1})),
                    ContinualArguments(output_dir="unused", training={"max_steps": 2}))


class _CountingCollator(CLIPCollator):
    """Records the size of every training batch it builds."""

    sizes: list[int] = []

    def __call__(self, rows):  # noqa: ANN001, ANN204
        if self.train:
            _CountingCollator.sizes.append(len(rows))
        return super().__call__(rows)


@pytest.mark.parametrize("streaming", [True, False])
def test_short_run_spends_the_budget(tmp_path, shared_data_root, monkeypatch, streaming) -> None:
    # 20 rows per step and batches of 16 (drop_last): a stream is read again (3 passes) to spend 3 steps
    stream = build_stream("fashion-years", data_root=shared_data_root, streaming=streaming, max_train_per_task=20,
                          max_eval_per_task=12)
    stream.tasks = stream.tasks[:2]
    monkeypatch.setattr(collate_module, "CLIPCollator", _CountingCollator)  # what the task kind batches with
    _CountingCollator.sizes = []
    args = ContinualArguments(
        output_dir=str(tmp_path), samples_per_task=48, progress=False, save_checkpoints=False,
        evaluation={"initial": False, "batch_size": 64}, training={"per_device_train_batch_size": 16, "logging_steps": 100},
    )
    learner = ContinualLearner(tiny_clip(seed=0), stream, [], load_image_processor(32), load_tokenizer(), args)
    results = learner.fit()
    assert [c.samples_seen for c in learner.compute] == [48, 48]
    assert [c.optimizer_steps for c in learner.compute] == [3, 3]
    assert _CountingCollator.sizes == [16, 16, 16] * 2  # three full batches (MACs are measured on the steps)
    assert [row.label for row in results.rows] == ["2011", "2012"]


def test_streaming_run_without_budget_fails_before_training(tmp_path, shared_data_root) -> None:
    stream = build_stream("fashion-years", data_root=shared_data_root, streaming=True, max_eval_per_task=4)
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, training={"num_train_epochs": 1})
    with pytest.raises(ValueError, match="streaming tasks need samples_per_task or training.max_steps"):
        ContinualLearner(tiny_clip(seed=0), stream, [], load_image_processor(32), load_tokenizer(), args)


def test_stream_shorter_than_one_batch_is_an_error(tmp_path, shared_data_root) -> None:
    stream = build_stream("fashion-years", data_root=shared_data_root, streaming=True, max_train_per_task=10,
                          max_eval_per_task=4)
    args = ContinualArguments(output_dir=str(tmp_path), samples_per_task=16, progress=False, evaluation={"initial": False},
                              training={"per_device_train_batch_size": 16})
    learner = ContinualLearner(tiny_clip(seed=0), stream, [], load_image_processor(32), load_tokenizer(), args)
    with pytest.raises(ValueError, match="Task 0 .'2011'. has no training examples .a stream must hold at least one"):
        learner.fit()
