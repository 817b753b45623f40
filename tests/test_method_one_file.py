"""A new method is one file: a method file added to a copy of the package, with no test edit and no test declaration,
is selected by the default checks of every matrix test module (`tests/method_matrix.py` reads every default from the
method class), and trains through the matrix (a real tiny run, and the option checks) in a pytest run of its own that
imports the copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_ccl.methods import ContinualMethod, MethodConfig
from hf_ccl.paths import SHARED_ENV, shared_root

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_ccl"
NAME = "shrink_logits"
#: The matrix modules: each parametrizes its default checks over the registry.
MATRIX_MODULES = ["test_method_registry.py", "test_accumulation.py", "test_compile_and_precision.py",
                  "test_sync_count.py"]
METHOD_FILE = f'''"""A tiny method for the one-file test: the contrastive loss plus a pull of the logits towards zero."""

from dataclasses import dataclass, field

import torch

from .base import ContinualMethod, MethodConfig
from .registry import register_method


@dataclass
class ShrinkLogitsConfig(MethodConfig):
    weight: float = field(default=0.01, metadata={{"help": "Weight of the squared logits."}})

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {{self.weight}}")


@register_method
class ShrinkLogits(ContinualMethod[ShrinkLogitsConfig]):
    name = "{NAME}"
    config_class = ShrinkLogitsConfig

    def loss_terms(self, model, inputs, outputs, context) -> dict[str, torch.Tensor]:
        return {{"shrink": self.config.weight * outputs.logits_per_image.pow(2).mean()}}
'''


#: A pytest plugin for the run in the copy: it writes what a `-k <name>` run of the matrix modules selects by default
#: (after `-k` and `-m 'not slow'`) beside itself, then keeps the cheap checks of that selection to run: one real tiny
#: training run (the sync-count step) and the option checks.
PLUGIN = """import json
from pathlib import Path

import pytest

RUN = {run!r}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    Path(__file__).with_name("selected.json").write_text(json.dumps([item.nodeid for item in items]))
    keep = [item for item in items if any(part in item.nodeid for part in RUN)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
"""
RUN = ["test_training_step_does_not_synchronize", "refuses_a_wrong_type", "refuses_an_unknown_option"]


def test_a_method_file_alone_is_collected_and_trained_by_the_matrix(tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(PACKAGE, copy / "hf_ccl", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "hf_ccl" / "methods" / f"{NAME}.py").write_text(METHOD_FILE, encoding="utf-8")
    (copy / "one_file_plugin.py").write_text(PLUGIN.format(run=RUN), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1", SHARED_ENV: str(shared_root())}
    # Run from the copy (`-m` puts the working folder first on the path), on the repository's tests and config.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO),
         "-p", "no:cacheprovider", "-p", "one_file_plugin", "-q", "-rA", "-k", NAME,
         *(str(REPO / "tests" / module) for module in MATRIX_MODULES)],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )
    output = ran.stdout[-3000:] + ran.stderr[-3000:]
    assert ran.returncode == 0, output

    selected = json.loads((copy / "selected.json").read_text())
    for module in MATRIX_MODULES:  # every matrix module runs its default checks on the new method
        assert any(node.startswith(f"tests/{module}::") and f"{NAME}]" in node for node in selected), (module, selected)
    assert f"tests/test_method_registry.py::test_every_method_resumes_exactly_after_a_task[clip-{NAME}]" in selected
    passed = {line.split()[1].rpartition("tests/")[2] for line in ran.stdout.splitlines() if line.startswith("PASSED ")}
    assert {f"test_sync_count.py::test_training_step_does_not_synchronize[{NAME}]",
            f"test_method_registry.py::test_every_option_of_every_method_refuses_a_wrong_type_in_one_line[{NAME}]",
            } <= passed, output


def test_a_method_is_generic_in_its_config():
    """`ContinualMethod[ItsConfig]` sets `config_class` (typing `self.config`); a `config_class` that is another
    config is refused when the class is defined."""

    @dataclass
    class PullConfig(MethodConfig):
        weight: float = 1.0

    class Pull(ContinualMethod[PullConfig]):
        name = "pull"

    assert Pull.config_class is PullConfig
    assert Pull({"weight": 0.5}).config == PullConfig(weight=0.5)
    with pytest.raises(TypeError, match="config_class"):
        class Mismatched(ContinualMethod[PullConfig]):  # noqa: F841 (defining it is the test)
            config_class = MethodConfig
