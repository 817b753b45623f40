"""Arguments by concern: the loop's own and one section per part that reads options (`hf_ccl.arguments`), an
import-light module; the checks that cross concerns in one place (`hf_ccl.checks`), run once per run."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hf_ccl.checks
from hf_ccl.arguments import ContinualArguments, HubArguments
from hf_ccl.checks import check_plan, check_run
from hf_ccl.cli import main
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.methods import build_methods
from hf_ccl.resume_settings import settings_diff
from hf_ccl.validation import ConfigError


def test_the_arguments_module_imports_no_torch_transformers_datasets_or_accelerate():
    code = ("import sys, hf_ccl.arguments; hf_ccl.arguments.HubArguments(); "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_config_keys_help_imports_no_torch_and_names_every_family():
    code = ("import sys, hf_ccl.config as c; c.config_keys_help(); "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from hf_ccl.config import FAMILY_NAMES
    from hf_ccl.families import FAMILIES

    assert FAMILY_NAMES == tuple(FAMILIES)


def test_the_old_import_paths_still_work():
    import hf_ccl
    import hf_ccl.continual

    assert hf_ccl.ContinualArguments is hf_ccl.continual.ContinualArguments is ContinualArguments
    assert hf_ccl.HubArguments is HubArguments


def test_a_checkpoint_with_the_settings_keys_of_an_earlier_version_resumes_unchanged():
    """Checkpoints written before the sections stored `spatial_disorder_task` and `eval_max_examples` at the top."""
    saved = {"seed": 0, "spatial_disorder_task": None, "eval_max_examples": 8}
    now = {"seed": 0, "diagnostics": {"spatial_disorder_task": None}, "evaluation": {"max_examples": 8}}
    assert settings_diff(saved, now) == []
    assert settings_diff({**saved, "eval_max_examples": 4}, now) == [("evaluation.max_examples", 4, 8)]


def test_a_cross_concern_error_exits_2_before_anything_is_built(tmp_path, capsys):
    """A method that replaces the contrastive loss with classification_loss=cross_entropy: refused by the CLI's
    check (`check_plan`), not by the learner after the stream and model were built."""
    output_dir = tmp_path / "run"
    assert main(["train", f"output_dir={output_dir}", "methods=[cllclip]", "classification_loss=cross_entropy"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "hf-ccl: error: classification_loss: cross_entropy replaces the contrastive loss, and so does cllclip")
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def digits():
    return build_stream("digits", max_train_per_task=8, max_eval_per_task=8)


def test_the_learner_checks_once_what_the_cli_checked(digits, monkeypatch, tmp_path):
    from hf_ccl.continual import ContinualLearner
    from hf_ccl.data import load_tokenizer
    from hf_ccl.families import tiny_config
    from hf_ccl.modeling import ContinualCLIPModel

    calls: list[str] = []
    plan_check = hf_ccl.checks.check_plan
    monkeypatch.setattr(hf_ccl.checks, "check_plan", lambda *a, **k: calls.append("plan") or plan_check(*a, **k))
    args = ContinualArguments(output_dir=str(tmp_path), progress=False)
    methods = build_methods(["finetune"])
    model = ContinualCLIPModel(tiny_config("clip", hidden_size=32, num_layers=1))
    processor, tokenizer = load_image_processor(32), load_tokenizer()
    plan = check_plan(args, methods, "clip")  # what `hf-ccl train` checked before building anything
    learner = ContinualLearner(model, digits, methods, processor, tokenizer, args, plan=plan)
    assert calls == [] and learner.plan is plan
    ContinualLearner(model, digits, methods, processor, tokenizer, args)  # from Python, nothing checked before
    assert calls == ["plan"]
    other = ContinualArguments(output_dir=str(tmp_path), progress=False)  # a plan covers its own arguments only
    assert check_run(model, digits, methods, other, processor, plan) is not plan and calls == ["plan", "plan"]


def test_the_stream_checks_name_the_section_key(digits):
    args = ContinualArguments(output_dir="x", diagnostics={"spatial_disorder_task": 99})
    with pytest.raises(ConfigError, match=r"^diagnostics.spatial_disorder_task must index a task of the stream"):
        check_run("clip", digits, build_methods(["finetune"]), args, load_image_processor(32))
