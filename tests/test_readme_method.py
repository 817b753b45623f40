"""The README's "Write your own method" section, run as written: its method file is imported as a module (as the
package imports a file of `hf_ccl/methods/`), its run trains on the digits stream, and its YAML config is checked.
The method's loss term must be logged and added to the loss, its state must round-trip through a task checkpoint,
and its options must be checked like a shipped method's."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from method_matrix import LogRecorder
from safetensors.torch import load_file

from hf_ccl import continual
from hf_ccl.config import load_config
from hf_ccl.methods import METHODS, build_methods, load_method_states
from hf_ccl.run import check_config
from hf_ccl.validation import ConfigError

README = Path(__file__).resolve().parents[1] / "docs" / "methods" / "write-your-own.md"  # the README's former section
SECTION = "# Write your own method"
NAME = "l2_anchor"
TERM = f"loss/{NAME}/pull"


def section_blocks(language: str) -> list[str]:
    """The ```<language> code blocks of the README's "Write your own method" section, in order."""
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return re.findall(rf"^```{language}[^\n]*\n(.*?)^```", text[start:end if end > 0 else None], flags=re.S | re.M)


@pytest.fixture
def readme_method(tmp_path):
    """The section's method file, imported as a module of its own; unregistered afterwards, so that the tests that
    run over the registry never see it."""
    assert NAME not in METHODS
    path = tmp_path / f"{NAME}.py"
    path.write_text(section_blocks("python")[0], encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"readme_{NAME}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        METHODS.pop(NAME, None)
        sys.modules.pop(spec.name, None)


def test_the_section_holds_a_method_a_run_and_a_config():
    python, yaml = section_blocks("python"), section_blocks("yaml")
    assert len(python) == 2 and len(yaml) == 1
    assert "@register_method" in python[0] and f'name = "{NAME}"' in python[0]
    assert f'build_methods(["{NAME}"]' in python[1] and f"methods: [{NAME}]" in yaml[0]


def test_the_readme_method_trains_logs_its_term_and_round_trips(readme_method, tmp_path, monkeypatch):
    assert NAME in METHODS and METHODS[NAME] is readme_method.L2Anchor
    recorder = LogRecorder()
    build = continual.ContinualLearner.__init__

    def recording_init(self, *args, **kwargs):  # the README builds its learner itself: add the recorder to it
        build(self, *args, **kwargs)
        self.callbacks.append(recorder)

    monkeypatch.setattr(continual.ContinualLearner, "__init__", recording_init)
    monkeypatch.chdir(tmp_path)  # the README's output_dir is relative
    namespace: dict = {"__name__": "readme_run"}
    exec(compile(section_blocks("python")[1], "README.md (Write your own method: run)", "exec"), namespace)
    learner = namespace["learner"]
    method = learner.methods[0]
    assert isinstance(method, readme_method.L2Anchor) and method.config.weight == 0.5
    tasks = len(learner.stream)
    assert tasks > 1 and learner.results.num_trained == tasks

    # the term: absent on the first task (no previous weights), then logged at every step and added to the loss
    steps = [(task, logs) for task, logs in recorder.logs if "loss" in logs]
    assert {task for task, _ in steps} == set(range(tasks))
    assert all(TERM not in logs for task, logs in steps if task == 0)
    for task in range(1, tasks):
        pulls = [logs[TERM] for number, logs in steps if number == task]
        assert len(pulls) == 4, f"task {task}: {TERM} is logged at every step"
        assert pulls[0] == 0.0 < pulls[-1] and all(math.isfinite(p) for p in pulls), pulls
    for task, logs in steps:
        if task:
            assert logs["loss"] == pytest.approx(logs["loss/contrastive"] + logs[TERM], rel=1e-4, abs=1e-4)

    # the state: read back from the last task checkpoint by a fresh instance, it is the checkpoint's own weights
    checkpoint = tmp_path / "outputs" / "digits-l2-anchor" / f"task-{tasks - 1}"
    assert (checkpoint / "method_state.safetensors").is_file()
    fresh = build_methods([NAME])
    assert fresh[0].anchor == {}
    load_method_states(fresh, checkpoint)
    weights = load_file(str(checkpoint / "model.safetensors"))
    trainable = {name for name, param in learner.model.named_parameters() if param.requires_grad}
    assert set(fresh[0].anchor) == set(method.anchor) == trainable
    for name, tensor in fresh[0].anchor.items():
        assert torch.equal(tensor, method.anchor[name]), name
        if name in weights:  # (a weight tied to another is saved once)
            assert torch.equal(tensor, weights[name]), name
    assert sum(name in weights for name in fresh[0].anchor) > len(trainable) // 2


def test_the_readme_method_is_configured_like_a_shipped_one(readme_method, tmp_path):
    config_file = tmp_path / "my-run.yaml"
    config_file.write_text(section_blocks("yaml")[0], encoding="utf-8")
    checked = check_config(load_config(config_file), check_paths=False)
    assert [m.name for m in checked.methods] == [NAME] and checked.methods[0].config.weight == 0.5
    with pytest.raises(ConfigError, match=rf"^method_args\.{NAME}\.weight must be a number, got 'abc'$"):
        build_methods([NAME], {NAME: {"weight": "abc"}})
    with pytest.raises(ConfigError, match=rf"^method_args\.{NAME}: weight must be >= 0, got -1"):
        build_methods([NAME], {NAME: {"weight": -1}})
