"""Streams described as data in a config: built from the bundled folders; bad specs fail before any data is read."""

import pytest

from hf_ccl.config import RunConfig, load_config
from hf_ccl.data.spec import build_stream_from_spec, check_stream_spec
from hf_ccl.run import build_run_stream, check_config


def test_by_column_spec_on_a_bundled_folder(shared_data_root):
    spec = {"builder": "by_column", "train": "pacs", "column": "domain", "values": ["photo", "sketch"],
            "label_column": "label", "train_templates": ["a {label}."]}
    stream = build_stream_from_spec(spec, data_root=shared_data_root, max_train_per_task=20, max_eval_per_task=10)
    assert stream.task_names == ["photo", "sketch"]
    assert all(task.kind == "classification" and len(task.class_names) == 7 for task in stream)
    assert len(stream[0].train) == 20 and len(stream[1].eval) == 10


def test_recipe_with_a_datasets_spec():
    config = load_config("recipes/configs/custom-stream.yaml", ["stream_args.max_train_per_task=8"])
    check_config(config)
    stream = build_run_stream(config)
    assert stream.name == "photo-sketch-aerial" and stream.task_names == ["photo", "sketch", "aerial"]
    assert [len(task.train) for task in stream] == [8, 8, 8]
    assert stream[2].class_names[0] != stream[0].class_names[0]  # RSSCN7's own classes


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"train": "pacs"}, "needs `builder`, one of: by_column, random_split"),
        ({"builder": "by_column", "train": "pacs", "column": "domain", "valuez": []}, "Unknown argument.*'valuez'"),
        ({"builder": "by_column", "train": "pacs", "column": "domain"}, "needs argument.*'values'"),
    ],
)
def test_bad_spec_is_rejected_before_reading_data(spec, message):
    with pytest.raises(ValueError, match=message):
        check_stream_spec(spec)


def test_run_config_checks_spec_and_stream_args():
    with pytest.raises(ValueError, match="Unknown stream_args"):
        check_config(RunConfig(stream={"builder": "random_split", "train": "flickr8k", "n_tasks": 2},
                               stream_args={"label_space": "all"}))
    with pytest.raises(ValueError, match="or a mapping with `builder`"):
        check_config(RunConfig(stream="no-such-stream"))
