"""Resume: a stopped run continues from its last complete task, or mid-task from the Trainer's checkpoint, with every
method's state, and ends with the same results matrix as an uninterrupted run with the same seed.

That every registered method resumes exactly after a task (parameters, method state, matrix) is checked over the
registry in `tests/test_method_registry.py`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_ccl.continual import latest_task_checkpoint

SCRIPT = Path(__file__).parent / "scripts" / "resumable_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import resumable_run  # noqa: E402

# CPU training of the same model on the same batches is bit-for-bit reproducible; allow float noise anyway.
TOLERANCE = 1e-6


def _matrix(results) -> np.ndarray:
    return np.array([[m for task in row.metrics.values() for m in task.values()] for row in results.rows])


def _run(output_dir: Path, methods: str, resume: bool = False, callbacks=()):
    learner = resumable_run.build_learner(str(output_dir), methods.split("+"), resume, None, list(callbacks))
    return learner, learner.fit()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per method set, shared by the tests."""
    runs = {}
    for methods in ("ctp+er", "si"):
        output_dir = tmp_path_factory.mktemp(methods.replace("+", "_"))
        runs[methods] = (output_dir, _run(output_dir, methods)[1])
    return runs


@pytest.mark.parametrize("methods", ["ctp+er"])  # single methods: test_method_registry's every-method resume
def test_resume_after_a_complete_task_matches_uninterrupted(reference, tmp_path, methods):
    source, expected = reference[methods]
    shutil.copytree(source / "task-0", tmp_path / "task-0")  # stopped after task 0
    learner, results = _run(tmp_path, methods, resume=True)
    assert [row.label for row in results.rows] == [row.label for row in expected.rows]
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=TOLERANCE)
    assert not (tmp_path / "trainer" / "task-0").exists(), "a finished task must never be trained twice"


class _Stop(Exception):
    pass


class _StopAtSave(resumable_run.KillAt):
    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.task_seen == self.task and state.global_step >= self.step:
            raise _Stop


@pytest.mark.parametrize("methods", ["ctp+er", "si"])
def test_resume_mid_task_matches_uninterrupted(reference, tmp_path, methods):
    _, expected = reference[methods]
    with pytest.raises(_Stop):
        _run(tmp_path, methods, callbacks=[_StopAtSave([], task=1, step=3)])
    assert latest_task_checkpoint(tmp_path).name == "task-0"
    assert (tmp_path / "trainer" / "task-1" / "checkpoint-3" / "hf_ccl" / "method_state.json").exists()
    _, results = _run(tmp_path, methods, resume=True)
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=TOLERANCE)
    counted = [[(task["samples_seen"], task["macs"]) for task in run.cost] for run in (results, expected)]
    assert counted[0] == counted[1]  # the resumed task's steps before the stop are counted once, as measured


def test_sigkill_mid_task_then_resume_in_a_new_process(reference, tmp_path):
    """A process killed with SIGKILL mid-task (no cleanup at all) resumes and ends with the uninterrupted matrix."""
    _, expected = reference["ctp+er"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    killed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ctp+er", "--kill-task", "1",
                             "--kill-at-step", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "final_results.json").exists()
    resumed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ctp+er", "--resume"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from hf_ccl.evaluation.matrix import ResultsMatrix

    results = ResultsMatrix.from_dict(json.loads((tmp_path / "final_results.json").read_text())["matrix"])
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=TOLERANCE)


def test_corrupt_checkpoint_is_a_clear_error_not_a_fresh_start(reference, tmp_path):
    source, _ = reference["si"]
    shutil.copytree(source / "task-1", tmp_path / "task-1")
    weights = tmp_path / "task-1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors"):
        _run(tmp_path, "si", resume=True)
    shutil.rmtree(tmp_path / "task-1")
    shutil.copytree(source / "task-1", tmp_path / "task-1")
    (tmp_path / "task-1" / "method_state.json").write_text("{ not json", encoding="utf-8")
    with pytest.raises(ValueError, match="method_state.json"):
        _run(tmp_path, "si", resume=True)


def test_resume_with_other_methods_or_nothing_to_resume_fails(reference, tmp_path):
    source, _ = reference["si"]
    with pytest.raises(ValueError, match="no complete task checkpoint"):
        _run(tmp_path, "si", resume=True)
    shutil.copytree(source / "task-0", tmp_path / "task-0")
    with pytest.raises(ValueError, match="same methods"):
        _run(tmp_path, "ctp+er", resume=True)


def test_restore_takes_a_saved_tokenizer_of_the_same_length_with_other_merges(tmp_path):
    """`grow_vocab` may append merges without adding tokens: restore compares the tokenizers by content, not by
    length, so the resumed run tokenizes with the checkpoint's merges."""
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
    from hf_ccl.methods import build_methods
    from hf_ccl.testing import tiny_clip

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=8)
    stream.tasks = stream.tasks[:1]

    def learner(resume: bool) -> ContinualLearner:
        args = ContinualArguments(output_dir=str(tmp_path),
                                  training={"max_steps": 1, "per_device_train_batch_size": 16, "warmup_steps": 0},
                                  progress=False, seed=1, evaluation={"initial": False}, resume_from_checkpoint=resume or None)
        return ContinualLearner(tiny_clip(seed=1), stream, build_methods(["grow_vocab"]), load_image_processor(32),
                                load_tokenizer(), args)

    def merges(tokenizer) -> list:  # noqa: ANN001
        return json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]

    trained = learner(resume=False)
    trained.fit()
    original = load_tokenizer()
    assert len(trained.tokenizer) == len(original) and len(merges(trained.tokenizer)) > len(merges(original))
    resumed = learner(resume=True)
    assert resumed.restore(tmp_path / "task-0") == 0
    assert merges(resumed.tokenizer) == merges(trained.tokenizer)


# ----- checkpoints that cannot be resumed as they are: one line naming what to fix ---------------------------------
GROWN_RUN = ["stream={builder: random_split, train: cifar10, n_tasks: 2, label_column: label}", "progress=false",
             "evaluation.initial=false", "training.max_steps=1", "training.warmup_steps=0",
             "training.per_device_train_batch_size=8",
             "stream_args.max_train_per_task=16", "stream_args.max_eval_per_task=8", "model.config.hidden_size=32",
             "model.config.num_layers=1", "methods=[grow_vocab]", "method_args.grow_vocab.vocab_size=300",
             "method_args.grow_vocab.context_length=100", "method_args.grow_vocab.report_captions=0",
             "method_args.grow_vocab.skip_languages=[cifar10-1]"]  # the context grows at task 0


@pytest.fixture(scope="module")
def grown_altclip(tmp_path_factory):
    """`hf-ccl train --config digits` (on 2 tasks of CIFAR-10) of an AltCLIP whose context `grow_vocab` grows to 100
    tokens (RoBERTa numbers positions after its padding id: the table holds 102 rows); the run folder."""
    from hf_ccl.cli import main

    output_dir = tmp_path_factory.mktemp("grown-altclip")
    assert main(["train", "--config", "digits", f"output_dir={output_dir}", "model.family=altclip", *GROWN_RUN]) == 0
    return output_dir


def test_an_altclip_context_grows_and_loads_in_plain_transformers(grown_altclip):
    import torch
    from transformers import AltCLIPModel, AutoTokenizer

    folder = grown_altclip / "task-1"
    model = AltCLIPModel.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.text_model.roberta.embeddings.position_embeddings.num_embeddings == 102
    assert tokenizer.model_max_length == 100
    texts = tokenizer(["a photo of " * 40], truncation=True, return_tensors="pt")
    assert texts.input_ids.shape[1] == 100
    with torch.no_grad():
        assert torch.isfinite(model.get_text_features(**texts).pooler_output).all()


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.family=siglip", "model.config.projection_dim=32"],
     "holds a model of family 'altclip', but this run builds one of family 'siglip': resume with the family the run "
     "started with (model.family=altclip)"),
    (["model.family=altclip", "model.config.num_heads=4"],
     "holds a model of another size than this run builds (saved -> now: text_config.num_attention_heads 2 -> 4"),
])
def test_resuming_with_another_model_names_the_difference(grown_altclip, tmp_path, capsys, overrides, message):
    """Compared with the checkpoint's config.json before the run is built (was: a size-mismatch traceback)."""
    from hf_ccl.cli import main

    shutil.copytree(grown_altclip / "task-0", tmp_path / "task-0")
    code = main(["train", "--config", "digits", f"output_dir={tmp_path}", *GROWN_RUN, *overrides,
                 "resume_from_checkpoint=true"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(f"hf-ccl: error: {tmp_path / 'task-0'} ") and message in err, err


def _fresh_altclip():
    from hf_ccl.families import ContinualAltCLIPModel, tiny_config

    return ContinualAltCLIPModel(tiny_config("altclip", hidden_size=32, num_layers=1))


def test_weights_load_from_what_the_checkpoint_wrote(grown_altclip, tmp_path):
    """`load_model_weights` reads the files the checkpoint's manifest lists (an index.json copied in beside
    model.safetensors is ignored; without a manifest both are an error naming them), reads a sharded save through
    its index, and regrows vocabulary and context either way."""
    import torch
    from safetensors.torch import load_file

    from hf_ccl.checkpointing import load_model_weights

    source = grown_altclip / "task-1"
    saved = load_file(source / "model.safetensors")
    folder = tmp_path / "task-1"
    shutil.copytree(source, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"logit_scale": "other.bin"}}))
    model = _fresh_altclip()
    load_model_weights(model, folder)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in saved.items())
    (folder / "checkpoint_manifest.json").unlink()
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_model_weights(_fresh_altclip(), folder)

    sharded = tmp_path / "sharded"
    rows = model.get_input_embeddings().num_embeddings + 5
    model.resize_token_embeddings(rows)  # as a vocabulary grown further
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert not (sharded / "model.safetensors").exists()
    reloaded = _fresh_altclip()
    load_model_weights(reloaded, sharded)
    assert reloaded.max_text_positions == 100 and reloaded.get_input_embeddings().num_embeddings == rows
    assert all(torch.equal(reloaded.state_dict()[key], value) for key, value in model.state_dict().items())
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"names shard\\(s\\) \\['{shard.name}'\\] that are not in"):
        load_model_weights(_fresh_altclip(), sharded)


def test_method_state_errors_name_the_file_and_the_tensor(reference, tmp_path):
    """A method_state.safetensors that is gone (a checkpoint without its manifest) or lacks a tensor the JSON refers
    to: an error naming the file and the tensor (was: KeyError 'si/omega/...')."""
    from safetensors.torch import load_file, save_file

    from hf_ccl.methods import build_methods
    from hf_ccl.methods.state import load_method_states

    folder = tmp_path / "task-1"
    shutil.copytree(reference["si"][0] / "task-1", folder)
    tensors = load_file(folder / "method_state.safetensors")
    dropped = sorted(tensors)[0]
    save_file({key: value for key, value in tensors.items() if key != dropped}, folder / "method_state.safetensors")
    with pytest.raises(ValueError, match=f"lacks tensor\\(s\\) \\['{dropped}'\\] of method 'si'"):
        load_method_states(build_methods(["si"]), folder)
    (folder / "method_state.safetensors").unlink()
    with pytest.raises(ValueError, match=r"Method state file .*method_state.safetensors is missing \(.*refers to"):
        load_method_states(build_methods(["si"]), folder)


def test_every_family_grows_its_context_and_a_fresh_model_reloads_it(tmp_path):
    """`resize_position_embeddings` on each family's own position table (CLIP-style `position_embedding`, BERT and
    RoBERTa `position_embeddings` with their buffers and padding offset); `load_model_weights` regrows a fresh model
    to the saved table and reads every weight back."""
    import torch

    from hf_ccl.checkpointing import load_model_weights
    from hf_ccl.families import FAMILIES, tiny_config
    from hf_ccl.tokenization import resize_position_embeddings

    for family, cls in FAMILIES.items():
        model = cls(tiny_config(family, hidden_size=32, num_layers=1, projection_dim=32)).eval()
        resize_position_embeddings(model, 100, init="normal")
        ids = torch.randint(3, 400, (2, 100))
        with torch.no_grad():
            features = model.get_text_features(input_ids=ids, attention_mask=torch.ones_like(ids)).pooler_output
        assert model.max_text_positions == 100 and torch.isfinite(features).all(), family
        model.save_pretrained(tmp_path / family)
        fresh = cls(tiny_config(family, hidden_size=32, num_layers=1, projection_dim=32))
        load_model_weights(fresh, tmp_path / family)
        assert fresh.max_text_positions == 100, family
        assert all(torch.equal(fresh.state_dict()[key], value) for key, value in model.state_dict().items()), family
