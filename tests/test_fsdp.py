"""FSDP2: the student sharded by transformers' Trainer and accelerate for each task's training (`hf_ccl.sharding`).

Two launches of `tests/scripts/fsdp_check.py` on 2 CPU processes (gloo), one with FSDP2 and one with DDP, train the
same tiny runs: per-step losses, final weights and method state agree within float tolerance, every Trainer of the
FSDP launch was sharded, and every task checkpoint loads with plain transformers in a process that never imports
hf_ccl. accelerate keeps its FSDP plugin only on GPU-like devices, so the FSDP launch flips that one gate
(`tests/scripts/fsdp_on_cpu.py`, which says what a CPU run cannot cover); hf_ccl refuses FSDP on a CPU machine.
The CLI launch runs as a user launches it (through the same wrapper), and one more re-checks the limits on CPU.
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from method_matrix import METHOD_CLASSES
from safetensors.torch import load_file
from test_distributed import SCRIPT as DISTRIBUTED_SCRIPT
from test_distributed import launch_two_processes

import hf_ccl.training_options as training_options
from hf_ccl.checks import check_fsdp_methods
from hf_ccl.continual import ContinualArguments
from hf_ccl.families import FAMILIES
from hf_ccl.methods import build_methods
from hf_ccl.sharding import scalars_to_vectors, wrap_classes
from hf_ccl.testing import tiny_model
from hf_ccl.validation import ConfigError

SCRIPTS = DISTRIBUTED_SCRIPT.parent
CHECK_SCRIPT, CLI_SCRIPT, LIMITS_SCRIPT = SCRIPTS / "fsdp_check.py", SCRIPTS / "fsdp_on_cpu.py", SCRIPTS / "fsdp_limits.py"
#: Methods that train sharded (`fsdp_refusal = None`), by the step mechanism they share.
SHARDED_METHODS = sorted(name for name, cls in METHOD_CLASSES.items() if cls.fsdp_refusal is None)
#: The default launch: CLIP (its 0-d logit_scale reshaped) with finetune, SigLIP (the sigmoid loss, a (1,) logit_bias)
#: with Mod-X's teacher, ZSCL (a weight mean kept as shards) and EWC (a penalty over each process's shards); every
#: family and every method that trains sharded under `-m slow`.
DEFAULT_RUNS = ["clip:finetune", "siglip:modx", "clip:zscl", "clip:ewc"]
SLOW_RUNS = ([f"{family}:finetune" for family in FAMILIES if family != "clip"]
             + [f"clip:{name}" for name in SHARDED_METHODS if f"clip:{name}" not in DEFAULT_RUNS])


# ----- refused before anything is built ----------------------------------------------------------------------------
@pytest.fixture
def two_gpu_processes(monkeypatch):
    """What hf_ccl's check sees on a GPU machine launched with 2 processes."""
    monkeypatch.setattr(training_options, "launched_processes", lambda: 2)
    monkeypatch.setattr(training_options, "accelerate_keeps_fsdp", lambda training: True)


@pytest.mark.parametrize("training", [{"fsdp": True, "fsdp_config": {"version": 1}},
                                      {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_version": 1}}])
def test_fsdp1_is_refused(tmp_path, training):
    with pytest.raises(ConfigError, match="training.fsdp: FSDP1 is not taken: transformers deprecates FSDP1") as raised:
        ContinualArguments(output_dir=str(tmp_path), training=training)
    assert raised.value.key == "training.fsdp"


def test_fsdp_on_one_process_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="FSDP shards the model across processes, and this is one process"):
        ContinualArguments(output_dir=str(tmp_path), training={"fsdp": True})


def test_fsdp_on_a_machine_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(training_options, "launched_processes", lambda: 2)
    with pytest.raises(ConfigError, match="FSDP2 needs a GPU: accelerate keeps its FSDP plugin only on GPU-like"):
        training_options.check_fsdp({"fsdp": True})
    with pytest.raises(ConfigError, match="FSDP2 needs a GPU"):
        training_options.check_fsdp({"fsdp": True, "use_cpu": True})


def test_fsdp_from_the_launcher_is_checked_by_its_version(tmp_path, monkeypatch):
    """`accelerate launch --use_fsdp` reaches the Trainer through the environment; without `--fsdp_version 2` the
    launcher asks for FSDP1."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ConfigError, match=r"accelerate launch with FSDP \(ACCELERATE_USE_FSDP\): FSDP1 is not taken"):
        ContinualArguments(output_dir=str(tmp_path))
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ConfigError, match="this is one process"):
        ContinualArguments(output_dir=str(tmp_path))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    ContinualArguments(output_dir=str(tmp_path))


@pytest.mark.usefixtures("two_gpu_processes")
@pytest.mark.parametrize(("training", "match"), [
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps > 1 is not taken with FSDP"),
    ({"save_strategy": "steps"}, "mid-task checkpoints .* are not taken with FSDP: accelerate 1.15 forgets"),
    ({"fsdp_config": {"version": 3}}, "FSDP version '3' does not exist"),
])
def test_fsdp2_combinations_that_do_not_work_are_refused(training, match):
    with pytest.raises(ConfigError, match=match):
        training_options.check_fsdp({"fsdp": True, **training})
    training_options.check_fsdp({"fsdp": True})  # FSDP2 on 2 GPU processes is taken


def test_methods_that_cannot_train_sharded_are_refused_with_their_reason():
    args = SimpleNamespace(training={"fsdp": True})
    check_fsdp_methods(args, build_methods(["finetune", "modx", "er"]))
    with pytest.raises(ConfigError, match="method 'si' cannot train under FSDP2: its importance accumulates each step"):
        check_fsdp_methods(args, build_methods(["finetune", "si"]))
    check_fsdp_methods(SimpleNamespace(training={}), build_methods(["si"]))  # without FSDP: taken


def test_every_method_says_whether_it_trains_sharded_and_each_that_does_is_launched():
    for name, cls in METHOD_CLASSES.items():
        assert cls.fsdp_refusal is None or (isinstance(cls.fsdp_refusal, str) and cls.fsdp_refusal), name
    launched = {run.split(":")[1] for run in DEFAULT_RUNS + SLOW_RUNS}
    assert set(SHARDED_METHODS) <= launched
    assert {"finetune", "modx", "derpp", "lwf", "er", "der", "zscl", "ctp", "ewc", "mas"} <= set(SHARDED_METHODS)


# ----- the model readied for sharding ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_readied_for_fully_shard(family):
    """0-d parameters become [1] (same value, same requires_grad); the wrapped layer classes are transformers'
    `_no_split_modules` less the one holding the token embedding."""
    model = tiny_model(family, seed=0)
    scalars = {name: value.detach().clone() for name, value in model.named_parameters() if value.dim() == 0}
    assert set(scalars_to_vectors(model)) == set(scalars)
    for name, value in scalars.items():
        assert model.get_parameter(name).shape == (1,) and model.get_parameter(name).item() == value.item()
    assert not [name for name, value in model.named_parameters() if value.dim() == 0]
    classes = wrap_classes(model)
    assert classes and set(classes) < set(model._no_split_modules)
    embedding = model.get_input_embeddings()
    for module in model.modules():
        if type(module).__name__ in classes:
            assert all(inner is not embedding for inner in module.modules())
    if family in ("clip", "altclip", "chinese_clip", "metaclip_2"):
        assert "logit_scale" in scalars  # the scalar fully_shard refuses
    else:
        assert not scalars  # SigLIP stores logit_scale and logit_bias with shape (1,)


# ----- 2 CPU processes: FSDP2 against DDP --------------------------------------------------------------------------
def plain_load(folder: Path) -> dict[str, list]:
    """The checkpoint loaded by plain transformers in a process that never imports hf_ccl: its class, and the
    shape and value of each 0-d parameter."""
    code = (
        "import json, sys, transformers\n"
        f"model = transformers.AutoModel.from_pretrained({str(folder)!r})\n"
        "assert not [m for m in sys.modules if m.startswith('hf_ccl')]\n"
        "print(json.dumps({'class': type(model).__name__, 'logit_scale': list(model.logit_scale.shape)}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_against_ddp(output_dir: Path, runs: list[str]) -> None:
    for run in runs:
        key = run.replace(":", "_")
        sharded, plain = (json.loads((output_dir / f"{mode}-{key}.json").read_text()) for mode in ("fsdp", "ddp"))
        assert sharded["sharded"] == [True, True] and plain["sharded"] == [False, False], run
        assert sharded["model_class"] == plain["model_class"], run  # the gathered model is the plain class
        assert len(sharded["losses"]) == len(plain["losses"]) >= 4, run  # 2 tasks x 2 steps (oracle: t x 2)
        for (task, loss), (other_task, other) in zip(sharded["losses"], plain["losses"], strict=True):
            assert task == other_task and abs(loss - other) <= 1e-5 * max(1.0, abs(other)), (run, loss, other)
        weights, reference = (load_file(output_dir / f"{mode}-{key}.safetensors") for mode in ("fsdp", "ddp"))
        assert weights.keys() == reference.keys(), run
        for name, value in reference.items():
            assert weights[name].shape == value.shape, (run, name)
            if value.is_floating_point():  # float32 sums in another order (plain SGD: no Adam amplification)
                assert torch.allclose(weights[name], value, rtol=1e-4, atol=1e-5), (run, name)
            else:
                assert torch.equal(weights[name], value), (run, name)
        assert weights["logit_scale"].dim() == reference["logit_scale"].dim()
        loaded = plain_load(Path(sharded["checkpoint"]))
        assert loaded["logit_scale"] == list(reference["logit_scale"].shape), run


@pytest.mark.multiprocess
@pytest.mark.parametrize("runs", [pytest.param(DEFAULT_RUNS, id="default"),
                                  pytest.param(SLOW_RUNS, id="families-and-siblings", marks=pytest.mark.slow)])
def test_fsdp2_trains_as_ddp_does(tmp_path, runs):
    for mode in ("fsdp", "ddp"):
        launch_two_processes(CHECK_SCRIPT, str(tmp_path), mode, ",".join(runs))
    check_against_ddp(tmp_path, runs)


CLI_ARGS = ["train", "--config", "digits", "model.config.hidden_size=32", "model.config.num_layers=1",
            "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=16", "training.max_steps=2",
            "training.per_device_train_batch_size=8", "training.fsdp=true", "progress=false"]


@pytest.mark.multiprocess
def test_the_cli_trains_sharded_and_its_checkpoints_load_with_plain_transformers(tmp_path):
    """`hf-ccl train ... training.fsdp=true` on 2 processes (the GPU gate flipped): every task checkpoint is the
    single-process format (0-d `logit_scale`) and loads with plain transformers."""
    launch_two_processes(CLI_SCRIPT, *CLI_ARGS, f"output_dir={tmp_path / 'run'}")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results and (tmp_path / "run" / "task-4").is_dir()
    loaded = plain_load(tmp_path / "run" / "task-4")
    assert loaded == {"class": "CLIPModel", "logit_scale": []}


@pytest.mark.slow  # two processes, ~25 s
@pytest.mark.multiprocess
def test_a_sharded_run_resumes_exactly_from_a_task_checkpoint(tmp_path):
    """The task checkpoints are written from the gathered model: a run resumed from task-1 ends as the uninterrupted
    run does (plain SGD)."""
    args = [*CLI_ARGS, "training.optim=sgd", "training.learning_rate=0.05"]
    launch_two_processes(CLI_SCRIPT, *args, f"output_dir={tmp_path / 'whole'}")
    launch_two_processes(CLI_SCRIPT, *args, f"output_dir={tmp_path / 'cut'}")
    for index in (2, 3, 4):
        subprocess.run(["rm", "-rf", str(tmp_path / "cut" / f"task-{index}")], check=True)
    launch_two_processes(CLI_SCRIPT, *args, f"output_dir={tmp_path / 'cut'}", "resume_from_checkpoint=true")
    whole, resumed = (load_file(tmp_path / run / "task-4" / "model.safetensors") for run in ("whole", "cut"))
    for name, value in whole.items():
        assert torch.allclose(resumed[name], value, rtol=1e-5, atol=1e-6), name


@pytest.mark.slow  # two processes, ~15 s; the refusal itself is tested above
@pytest.mark.multiprocess
def test_a_method_that_cannot_train_sharded_is_refused_on_every_process_before_anything_is_built(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", str(CLI_SCRIPT), *CLI_ARGS, "methods=[si]",
               f"output_dir={tmp_path / 'run'}"]
    from test_distributed import user_env

    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=user_env())
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("hf-ccl: error:")]
    assert len(errors) == 2 and all("method 'si' cannot train under FSDP2" in line for line in errors), errors
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two processes, ~25 s (CI time); the refusals themselves are tested above
@pytest.mark.multiprocess
def test_the_limits_still_hold_on_two_cpu_processes(tmp_path):
    """FSDP2 runs on gloo (an MLP shards, steps and gathers), refuses a 0-d parameter (what `scalars_to_vectors`
    fixes), and accelerate drops its FSDP plugin on CPU (what the CPU refusal says) and cannot build FSDP1 there."""
    launch_two_processes(LIMITS_SCRIPT, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["world_size"] == 2
        assert report["mlp_dtensor"] and report["mlp_local_rows"] == 4  # 8 rows sharded over 2 processes
        assert report["mlp_full_keys"] == (["0.bias", "0.weight", "1.bias", "1.weight"] if rank == 0 else [])
        assert "fully_shard doesn't support scalar parameters" in report["clip_error"]
        assert report["distributed_type"] == "DistributedType.MULTI_CPU" and not report["fsdp_plugin_kept"]
        assert "no available devices" in report["fsdp1_error"]
