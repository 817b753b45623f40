"""The recipe entry points: `hf-ccl list`, and a short default run that prints the results matrix."""

import json
import re

import pytest

from hf_ccl.cli import main


def test_list_names_recipes_streams_and_methods(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "digits" in out and "flickr8k-random5" in out and "finetune" in out and "joint" in out
    assert re.search(r"\n  modx-flickr8k-random5 +Mod-X \(ICML 2023, paper 000\)", out)


def test_version(capsys):
    from hf_ccl import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"hf-ccl {__version__}"


def test_short_default_run_prints_matrix(tmp_path, capsys):
    overrides = [
        f"output_dir={tmp_path}", "progress=false", "training.max_steps=3", "training.per_device_train_batch_size=16",
        "stream_args.max_train_per_task=48", "stream_args.max_eval_per_task=20", "methods=[joint]",
        "model.config.hidden_size=32", "model.config.num_layers=1",
    ]
    assert main(["train", "--config", "digits", *overrides]) == 0  # a shipped recipe, by name
    out = capsys.readouterr().out
    assert "| after digits-89 |" in out and "forgetting" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == 5
    assert (tmp_path / "run_config.yaml").exists() and (tmp_path / "task-4" / "model.safetensors").exists()


def test_bad_override_fails_before_anything_is_written(tmp_path, capsys):
    output_dir = tmp_path / "run"
    code = main(["train", "--config", "recipes/configs/digits.yaml", f"output_dir={output_dir}", "methods=[nope]"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-ccl: error: Unknown method 'nope'; valid methods: ") and err.count("\n") == 1
    assert " cllclip, " in err and " finetune, " in err
    assert "Traceback" not in err and not output_dir.exists()


@pytest.mark.parametrize("raised", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6335552 vs 6335440"),  # torch.save
    OSError(28, "No space left on device"),
])
def test_a_full_disk_is_named_whatever_the_writer_raised(tmp_path, capsys, monkeypatch, raised):
    import collections

    import hf_ccl.run

    def fail(config):
        raise raised

    usage = collections.namedtuple("usage", "total used free")
    free = 10 * 2**30 if isinstance(raised, OSError) else 12_000  # ENOSPC is named even with room left now
    monkeypatch.setattr(hf_ccl.run, "run", fail)
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(2**31, 2**31 - free, free))
    assert main(["train", "--config", "digits", f"output_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"hf-ccl: error: no space left on the disk of {tmp_path / 'run'} (")
    assert "resume_from_checkpoint=true" in err and str(raised).split()[-1] in err


def test_another_failure_is_not_called_a_full_disk(tmp_path, capsys, monkeypatch):
    import hf_ccl.run

    def fail(config):
        raise RuntimeError("something else")

    monkeypatch.setattr(hf_ccl.run, "run", fail)
    assert main(["train", "--config", "digits", f"output_dir={tmp_path / 'run'}"]) == 1
    assert "no space" not in capsys.readouterr().err


def test_train_ends_the_process_group_it_created_and_keeps_one_it_was_given(monkeypatch, tmp_path):
    """Left to interpreter exit, gloo's threads can abort a process whose run succeeded (exit -6): `hf-ccl train`
    ends the process group its run created (accelerate's), and leaves alone one that existed before."""
    import torch.distributed as dist

    from hf_ccl import cli

    def run_that_starts_a_group(*_args):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
        return 0

    monkeypatch.setattr(cli, "_run_train_command", run_that_starts_a_group)
    assert cli._train_command(None, [], False, 0.0) == 0
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'given'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(cli, "_run_train_command", lambda *_args: 0)
        assert cli._train_command(None, [], False, 0.0) == 0
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
