"""The method plugin interface: registry errors, config validation, state round trip, joint's data union."""

import pytest
import torch
from datasets import Dataset

from hf_ccl.data.task import Task, TaskStream
from hf_ccl.methods import (
    ContinualMethod,
    MethodConfig,
    TaskContext,
    available_methods,
    build_methods,
    load_method_states,
    save_method_states,
)


def test_builtin_methods_registered():
    assert {"finetune", "joint"} <= set(available_methods())


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="valid methods: .*finetune.*joint"):
        build_methods(["finetune", "modx-typo"])


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match="valid options: \\['max_examples'\\]") as caught:
        build_methods(["joint"], {"joint": {"max_exampels": 3}})
    assert "method_args.joint.max_exampels" in str(caught.value) and caught.value.key == "method_args.joint.max_exampels"
    with pytest.raises(ValueError, match="not in the method list"):
        build_methods(["finetune"], {"joint": {}})
    with pytest.raises(ValueError, match="twice"):
        build_methods(["finetune", "finetune"])


class _Stateful(ContinualMethod):
    name = "stateful-test"

    def __init__(self, config: MethodConfig | None = None):
        super().__init__(config)
        self.fisher = {"w": torch.arange(6.0).reshape(2, 3)}
        self.counts = {"seen": 3, "names": ["a", "b"]}

    def state_dict(self):
        return {"fisher": self.fisher, "counts": self.counts, "buffer": [torch.tensor([1, 2]), 7]}

    def load_state_dict(self, state):
        self.fisher, self.counts, self.buffer = state["fisher"], state["counts"], state["buffer"]


def test_state_round_trip(tmp_path):
    saved = _Stateful()
    save_method_states([saved], tmp_path)
    assert (tmp_path / "method_state.safetensors").exists()
    loaded = _Stateful()
    loaded.fisher = {}
    load_method_states([loaded], tmp_path)
    assert torch.equal(loaded.fisher["w"], torch.arange(6.0).reshape(2, 3))
    assert loaded.counts == {"seen": 3, "names": ["a", "b"]}
    assert torch.equal(loaded.buffer[0], torch.tensor([1, 2])) and loaded.buffer[1] == 7


def test_corrupt_state_names_the_file(tmp_path):
    save_method_states([_Stateful()], tmp_path)
    (tmp_path / "method_state.safetensors").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="method_state.safetensors"):
        load_method_states([_Stateful()], tmp_path)


def _task(name, n):
    rows = {"image": [None] * n, "texts": [[f"{name} {i}"] for i in range(n)], "image_id": [f"{name}/{i}" for i in range(n)],
            "label": [-1] * n}
    dataset = Dataset.from_dict(rows)
    return Task(name=name, train=dataset, eval=dataset)


def test_joint_trains_on_union_of_seen_tasks(tiny_model, tmp_path):
    stream = TaskStream("s", [_task("a", 3), _task("b", 4), _task("c", 5)])
    (joint,) = build_methods(["joint"])
    context = TaskContext(task_index=1, task=stream[1], stream=stream, model=tiny_model, output_dir=tmp_path)
    union = joint.train_dataset(context, stream[1].train)
    assert sorted(union["image_id"]) == sorted([f"a/{i}" for i in range(3)] + [f"b/{i}" for i in range(4)])
    (capped,) = build_methods(["joint"], {"joint": {"max_examples": 5}})
    assert len(capped.train_dataset(context, stream[1].train)) == 5
