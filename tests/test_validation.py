"""Bad input is refused before anything is built, trained or written, with one line naming the key and what to do.

Through the CLI (`hf_ccl.cli.main`, as a user types it), through `load_config` / `run()`, and through the Python
API (`ContinualArguments`, `build_methods`). Every CLI case asserts exit code 2, a single `hf-ccl: error:` line on
stderr and no output folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_ccl import cli
from hf_ccl.cli import main
from hf_ccl.config import RunConfig, continual_fields, load_config
from hf_ccl.continual import ContinualArguments
from hf_ccl.methods import METHODS, build_methods
from hf_ccl.run import check_config, run
from hf_ccl.training_options import REFUSED, default_training, training_fields
from hf_ccl.validation import ConfigError, check_value, redact_secrets

HAS_GPU = torch.accelerator.is_available()
TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"  # looks like a Hub token, is none
REPO = Path(__file__).resolve().parents[1]


def _refused(tmp_path, capsys, *overrides, config="digits"):
    """Run the CLI on bad input; returns its one stderr line after checking code 2 and that nothing was written."""
    output_dir = tmp_path / "run"
    code = main(["train", "--config", config, f"output_dir={output_dir}", "progress=false", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("hf-ccl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not output_dir.exists()
    return err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["evaluation.batch_size=0"], "evaluation.batch_size must be >= 1, got 0"),
        (["max_length=1"], "max_length must be >= 2"),
        (["samples_per_task=0"], "samples_per_task must be >= 1"),
        (["first_task_epochs=0"], "first_task_epochs must be > 0"),
        (["hub.timeout=0"], "hub.timeout must be > 0"),
        (["hub.retries=-1"], "hub.retries must be >= 0"),
        (["hub.backoff=-1"], "hub.backoff must be >= 0"),
        (["seed=1.5"], "seed must be an integer, got 1.5"),
        (["seed=-1"], "seed must be in [0, 4294967295]"),
        (["progress=maybe"], "progress must be true or false, got 'maybe'"),
        (["warmup=last_task"], "warmup must be one of ['every_task', 'first_task']"),
        (["diagnostics.spatial_disorder_task=-1"], "diagnostics.spatial_disorder_task must be >= 0"),
        (["hub.model_id=not a repo"], "hub.model_id 'not a repo' is not a Hub repository id"),
        (["resume_from_checkpoint=no/such/run"], "resume_from_checkpoint: no such folder 'no/such/run'"),
        (["training.learning_rate=abc"], "training.learning_rate must be a number, got 'abc'"),
        (["training.learning_rate=0"], "training.learning_rate must be > 0"),
        (["training.num_train_epochs=-1"], "training.num_train_epochs must be > 0, got -1"),
        (["training.max_steps=0"], "training.max_steps must be -1 (train for num_train_epochs) or >= 1"),
        (["training.per_device_train_batch_size=0"], "training.per_device_train_batch_size must be >= 1"),
        (["training.gradient_accumulation_steps=0"], "training.gradient_accumulation_steps must be >= 1"),
        (["training.warmup_steps=-1"], "training.warmup_steps must be >= 0"),
        (["training.warmup_steps=2.5"], "training.warmup_steps must be a whole number of steps"),
        (["training.weight_decay=-0.1"], "training.weight_decay must be >= 0"),
        (["training.adam_beta2=1.0"], "training.adam_beta2 must be in [0, 1)"),
        (["training.lr_scheduler_type=cosin"], "training.lr_scheduler_type must be one of ['linear', 'cosine',"),
        (["training.per_device_train_batch_size=[64]"], "training.per_device_train_batch_size must be an integer"),
        (["training.seed=3"], "training.seed is not taken: hf_ccl seeds task k with seed + k"),
        (["training.resume_from_checkpoint=true"], "set the top-level resume_from_checkpoint"),
        (["training.per_device_eval_batch_size=8"], "evaluation.batch_size"),
        (["training.label_smoothing_factor=0.1"], "training.label_smoothing_factor is not taken"),
        (["training.disable_tqdm=true"], "set the top-level progress: false"),
        (["training.save_only_model=true"], "training.save_only_model=True is not taken"),
        (["training.load_best_model_at_end=true"], "training.load_best_model_at_end is not taken"),
        (["training.logging_steps=0"], "training.logging_steps must be > 0"),
        (["training.dataloader_prefetch_factor=2"], "training: --dataloader_prefetch_factor can only be set"),
        (["training.dataloader_drop_last=false", "samples_per_task=64", "training.num_train_epochs=1"],
         "remove training.dataloader_drop_last"),
        (["training.save_steps=5"], "training.save_steps has no effect without training.save_strategy: steps or epoch"),
        (["training.hub_model_id=me/clip"], "training.hub_model_id has no effect without training.push_to_hub: true"),
        (["training.push_to_hub=true"], "training.push_to_hub needs a repository: set hub.model_id"),
        (["training.lr_scheduler_type=constant"], "training.warmup_steps has no effect without a schedule that warms up"),
        (["training.dataloader_persistent_workers=true"], "without training.dataloader_num_workers >= 1"),
        (["training.log_level=loud"], "training.log_level must be one of ['detail', 'debug',"),
        (["training.include_num_input_tokens_seen=maybe"], "must be one of ['all', 'non_padding', 'no']"),
        (["training.train_sampling_strategy=group_by_length"], "needs tokenized columns"),
        (["training.ddp_backend=gloo"], "training.ddp_backend needs several processes"),
        (["training.use_liger_kernel=true"], "Liger has no kernels for CLIP"),
        (["methods=[joint]", "method_args.joint.max_examples=abc"],
         "method_args.joint.max_examples must be an integer or null, got 'abc'"),
        (["methods=[joint]", "method_args.joint.max_examples=0"], "method_args.joint: max_examples must be >= 1"),
        (["methods=[ctp]", "method_args.ctp.cmc_weight=-1"], "method_args.ctp: cmc_weight must be >= 0"),
        (["methods=[ctp]", "method_args.ctp.momentum=1.5"], "method_args.ctp: momentum must be in [0, 1)"),
        (["methods=[lwf]", "method_args.lwf.directions=i2t"], "method_args.lwf.directions must be a list of strings"),
        (["methods=[lora]", "method_args.lora.alpha=0"], "method_args.lora: alpha must be > 0"),
        (["methods=[er]", "method_args.er.buffer_size=-5"], "method_args.er: buffer_size must be >= 0"),
        (["methods=[patching]", "method_args.patching.validation_size=2.5"], "validation_size must be a whole number"),
        (["methods=[der]", "method_args.der.alpha=-1"], "method_args.der: alpha must be >= 0"),
        (["methods=[joint, er]"], "Methods 'joint' and 'er' cannot be combined: er mixes a buffer of past examples"),
        (["methods=[er, cumulative_all]"], "Methods 'er' and 'cumulative_all' cannot be combined"),
        (["methods=[sequential, restart]"], "Methods 'sequential' and 'restart' cannot be combined"),
        (["methods=[restart, ewc]"], "there is no previous model to build on"),
        (["methods=[lwf, modx]"], "Mod-X is LwF with row selection"),
        (["methods=[lora, prompt]"], "each would freeze the other's parameters"),
        (["methods=[teir, er]"], "Put 'teir' after 'er' in the method list"),
        (["methods=[grow_vocab, cllclip]"], "Put 'cllclip' before 'grow_vocab' in the method list"),
        (["methods=[oracle]"], "Method(s) ['oracle'] need a compute budget: set samples_per_task"),
        (["model.pretrained=./no/such/checkpoint", "model.config={}"], "model.pretrained: no such folder"),
        (["model.pretrained=outputs/no-such-run/task-0", "model.config={}"], "model.pretrained: no such folder"),
        (["model.pretrained=me/clip"], "model.config describes a random model and has no effect with model.pretrained"),
        (["model.config.hidden_size=abc"], "model.config.hidden_size must be an integer, got 'abc'"),
        (["model.config.hidden_size=30", "model.config.num_heads=4"], "must be a multiple of model.config.num_heads"),
        (["model.config.patch_size=64"], "model.config.patch_size (64) must not exceed model.config.image_size (32)"),
        (["tokenizer=./no/such/tokenizer"], "tokenizer: no such folder"),
        (["data_root=./no/such/data"], "data_root: no such folder"),
        (["stream_args.max_train_per_task=abc"], "stream_args.max_train_per_task must be an integer or null"),
        (["stream_args.max_train_per_task=-3"], "stream: max_train_per_task must be a positive integer"),
        (["stream_args.max_eval_per_task=0"], "stream: max_eval_per_task must be a positive integer"),
        (["stream_args.label_space=3"], "stream_args.label_space must be a string, got 3"),
        (["stream_args.seed=3"], "stream_args.seed: set the top-level seed instead"),
        (["stream={builder: by_column, train: pacs, column: 3, values: [photo]}"], "stream.column must be a string"),
        (["stream=[digits]"], "stream must be a string or a mapping, got ['digits']"),
        (["training.epochs=3"], "Unknown training option(s) ['epochs']"),
        (["training.deepspeed=ds_config.json"], "training.deepspeed is not taken: DeepSpeed 0.19.8's ZeRO 1-3 train a"),
        (["training.optim=lomo"], "training.optim='lomo' is not taken: LOMO optimizers update each parameter inside"),
        (["training.optim=adalomo"], "training.optim='adalomo' is not taken"),
        (["training.parallelism_config={cp_size: 2}"], "training.parallelism_config is not taken: context and tensor"),
        (["learning_rate=0.1"], "Unknown config key 'learning_rate' in an override; valid keys: stream,"),
        (["training"], "is not of the form key=value"),
    ],
)
def test_bad_value_is_refused_before_anything_is_written(tmp_path, capsys, overrides, message):
    assert message in _refused(tmp_path, capsys, *overrides)


@pytest.mark.skipif(HAS_GPU, reason="this machine can run fp16 and bf16")
def test_mixed_precision_the_machine_cannot_run_is_refused(tmp_path, capsys):
    assert "training.fp16 needs a GPU, but this machine has no GPU" in _refused(tmp_path, capsys, "training.fp16=true")
    err = _refused(tmp_path, capsys, "training.bf16=true")
    assert "training.bf16 on a machine without a GPU needs training.use_cpu: true" in err
    err = _refused(tmp_path, capsys, "training.fp16=true", "training.use_cpu=true")
    assert "training.fp16 needs a GPU, but training.use_cpu is true" in err
    assert "choose one" in _refused(tmp_path, capsys, "training.fp16=true", "training.bf16=true")
    config = load_config("digits", ["training.bf16=true", "training.use_cpu=true"])  # CPU bf16 autocast: taken
    assert config.training["bf16"] is True


def test_a_token_is_never_printed(tmp_path, capsys):
    err = _refused(tmp_path, capsys, f"{TOKEN}=1")  # a token pasted as a key
    assert TOKEN not in err and "Unknown config key 'hf_***'" in err
    err = _refused(tmp_path, capsys, f"seed={TOKEN}")  # ... or as the value of another option
    assert TOKEN not in err and "seed holds what looks like a Hugging Face token" in err
    err = _refused(tmp_path, capsys, f"training.hub_token={TOKEN}")
    assert TOKEN not in err and "HF_TOKEN" in err
    path = tmp_path / "secret.yaml"
    path.write_text(f"stream: digits\n{TOKEN}: 1\n")
    assert TOKEN not in _refused(tmp_path, capsys, config=str(path))
    assert redact_secrets("hf_ccl and hf_hub stay; hf_abcdefghijklmnop12 goes") == "hf_ccl and hf_hub stay; hf_*** goes"


def test_config_file_errors_name_the_file(tmp_path, capsys):
    bad_yaml = tmp_path / "broken.yaml"
    bad_yaml.write_text("training: [1, 2\n")
    assert f"{bad_yaml} is not valid YAML" in _refused(tmp_path, capsys, config=str(bad_yaml))
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- digits\n")
    assert "must be a mapping of config keys to values" in _refused(tmp_path, capsys, config=str(not_mapping))
    typo = tmp_path / "typo.yaml"
    typo.write_text("stream: digits\ntraining:\n  learning_rate: fast\n")
    err = _refused(tmp_path, capsys, config=str(typo))
    assert f"training.learning_rate must be a number, got 'fast' (in {typo})" in err
    assert "no such file, and no recipe of that name; recipes: c_clip-flickr8k-random5, cil-caltech101-bundled," in _refused(
        tmp_path, capsys, config="digitz")


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    assert main(["--debug", "train", f"output_dir={tmp_path / 'a'}", "evaluation.batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err and err.rstrip().endswith("got 0 (in the overrides)")
    assert main(["train", "--debug", f"output_dir={tmp_path / 'b'}", "evaluation.batch_size=0"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("HF_CCL_DEBUG", "1")
    assert main(["train", f"output_dir={tmp_path / 'c'}", "evaluation.batch_size=0"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_failing_run_exits_1_in_one_line_and_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty-data-root"
    empty.mkdir()
    code = main(["train", "--config", "pacs-domains", f"output_dir={tmp_path / 'run'}", f"data_root={empty}"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("hf-ccl: error: Dataset folder") and err.count("\n") == 1

    def bug(config):
        raise TypeError(f"unsupported operand (a bug) near {TOKEN}")

    monkeypatch.setattr(cli, "execute", bug)
    assert main(["train", f"output_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "TypeError: unsupported operand (a bug)" in err and TOKEN not in err


def test_sigterm_stops_like_ctrl_c(tmp_path, capsys, monkeypatch):
    """In process: SIGTERM raises in the main thread while a run is under way, the CLI reports it (nothing to resume
    here) and exits 143; the previous SIGTERM handler is back afterwards."""
    before = signal.getsignal(signal.SIGTERM)

    def terminated(config):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this returns
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(cli, "execute", terminated)
    assert main(["train", f"output_dir={tmp_path / 'run'}"]) == 143
    err = capsys.readouterr().err
    assert "hf-ccl: interrupted by SIGTERM: no task had completed" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) is before

    def ctrl_c(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "execute", ctrl_c)
    assert main(["train", f"output_dir={tmp_path / 'run'}"]) == 130
    assert "interrupted by Ctrl-C (SIGINT)" in capsys.readouterr().err


def test_sigterm_during_a_run_reports_the_checkpoint_to_resume_from(tmp_path):
    """A real run in a subprocess (about 10 s): SIGTERM after task 0's checkpoint exists (task 1 would train for 10^6 steps)
    stops it with exit code 143, no traceback, and the command that resumes it."""
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "hf_ccl.cli", "train", "--config", "digits", f"output_dir={output_dir}",
               "progress=false", "evaluation.initial=false", "first_task_epochs=1", "training.max_steps=1000000",
               "training.per_device_train_batch_size=16", "stream_args.max_train_per_task=32",
               "stream_args.max_eval_per_task=8", "model.config.hidden_size=32", "model.config.num_layers=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err_file:  # files: never full
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=err_file)
        try:
            state = output_dir / "task-0" / "continual_state.json"
            deadline = time.monotonic() + 300
            while not state.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert state.exists(), (tmp_path / "err.txt").read_text()[-3000:]
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    err = (tmp_path / "err.txt").read_text()
    assert process.returncode == 143, err
    assert "hf-ccl: interrupted by SIGTERM. The last complete task checkpoint is" in err
    assert f"{output_dir / 'task-0'}; resume with:" in err and "resume_from_checkpoint=true" in err
    assert "Traceback" not in err
    assert not (output_dir / "task-1").exists()


# ----- the Python API -------------------------------------------------------------------------------------------
def test_run_checks_everything_before_building_or_writing(tmp_path):
    """`run()` refuses what `RunConfig` alone cannot know (methods, stream options, paths) before building the
    stream or writing run_config.yaml."""
    output_dir = tmp_path / "run"
    for bad in (
        RunConfig(output_dir=str(output_dir), methods=["joint", "er"]),
        RunConfig(output_dir=str(output_dir), stream_args={"max_train_per_task": "many"}),
        RunConfig(output_dir=str(output_dir), model={"pretrained": str(tmp_path / "missing")}),
    ):
        with pytest.raises(ConfigError):
            run(bad)
        assert not output_dir.exists()


def test_continual_arguments_check_every_value():
    with pytest.raises(ConfigError, match="evaluation.batch_size must be >= 1, got 0"):
        ContinualArguments(output_dir="x", evaluation={"batch_size": 0})
    with pytest.raises(ConfigError, match="hub.timeout must be a number, got 'soon'"):
        ContinualArguments(output_dir="x", hub={"timeout": "soon"})
    with pytest.raises(ConfigError, match="training.learning_rate must be a number, got 'abc'"):
        ContinualArguments(output_dir="x", training={"learning_rate": "abc"})
    args = ContinualArguments(output_dir="x", training={"learning_rate": "1e-3", "max_steps": 10.0})
    assert args.training == {**default_training(), "learning_rate": 1e-3, "max_steps": 10}  # YAML 1.1: a string
    assert isinstance(args.training["max_steps"], int)


def test_yaml_numbers_read_as_strings_become_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("stream: digits\ntraining:\n  learning_rate: 1e-3\n  adam_epsilon: 1.0e-6\nhub:\n  timeout: 3e1\n")
    config = load_config(path)
    assert config.training["learning_rate"] == 1e-3 and config.training["adam_epsilon"] == 1e-6
    assert config.hub.timeout == 30.0


def test_every_continual_argument_is_a_config_field_and_flows_through():
    """Every ContinualArguments field can be set from YAML and reaches the run (no hand copy to forget)."""
    from dataclasses import fields

    assert continual_fields() == [f.name for f in fields(ContinualArguments) if f.init]
    config = load_config(None, ["hub.backoff=2.5", "save_checkpoints=false", "warmup=first_task"])
    args = config.continual_arguments()
    assert (args.hub.backoff, args.save_checkpoints, args.warmup) == (2.5, False, "first_task")


def test_every_refused_training_option_is_a_training_arguments_field():
    assert set(REFUSED) <= set(training_fields())


def test_every_method_checks_the_type_of_every_option():
    """Over the registry: a value of the wrong type for any option of any method is a ConfigError naming
    method_args.<method>.<option>."""
    for name, cls in METHODS.items():
        for field in __import__("dataclasses").fields(cls.config_class):
            wrong = "text" if field.name in ("partners",) else {"not": "this"}
            with pytest.raises(ConfigError, match=rf"method_args\.{name}\.{field.name} must be "):
                build_methods([name], {name: {field.name: wrong}})


@pytest.mark.parametrize("names", [
    ["modx", "er"], ["ctp", "er"], ["cllclip", "der", "teir"], ["cllclip", "ewc", "teir"],
    ["cllclip", "grow_vocab", "teir"], ["cllclip", "grow_vocab", "er", "teir"], ["cllclip", "grow_vocab", "lora"],
    ["cllclip", "grow_vocab", "prompt", "teir"], ["dns", "ewc"], ["finetune", "lwf"], ["grow_vocab", "finetune"],
    ["lwf", "ewc"], ["restart", "grow_vocab"], ["joint", "lwf"], ["patching", "ewc"], ["grow_vocab", "modx"],
])
def test_combinations_the_papers_and_benchmarks_use_are_taken(names):
    build_methods(names)


def test_check_value_reads_annotations():
    assert check_value("k", "2", int | None) == 2 and check_value("k", 3, float) == 3
    assert check_value("k", ["a"], list[str]) == ["a"] and check_value("k", "x", str | int) == "x"
    for value, annotation, expected in [
        (True, int, "k must be an integer, got True"),
        (float("nan"), float, "k must be a number, got nan"),
        ([1, "b"], list[int], r"k\[1\] must be an integer, got 'b'"),
        ({"a": "b"}, dict[str, int], "k.a must be an integer, got 'b'"),
        ("x", int | None, "k must be an integer or null, got 'x'"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            check_value("k", value, annotation)


def test_recipe_by_name_and_by_path_and_bare_name_errors():
    assert load_config("digits") == load_config("recipes/configs/digits.yaml") == load_config("digits.yaml")
    with pytest.raises(ConfigError, match="no such file, and no recipe of that name"):
        load_config("recipes/configs/digitz.yaml")
    check_config(load_config("tic-fashion-years", ["methods=[oracle]"]))  # oracle with the recipe's budget: taken


def test_the_learner_checks_methods_built_by_hand(tmp_path, clip_tokenizer):
    """Python users who build methods themselves get the same combination and budget checks, before anything runs."""
    from hf_ccl.continual import ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor
    from hf_ccl.methods.joint import Joint
    from hf_ccl.methods.replay import ExperienceReplay
    from hf_ccl.methods.tic import Oracle
    from hf_ccl.testing import tiny_clip

    stream = build_stream("digits", max_train_per_task=8, max_eval_per_task=4)
    args = ContinualArguments(output_dir=str(tmp_path / "run"), progress=False)
    for methods, message in (([Joint(), ExperienceReplay()], "cannot be combined"), ([Oracle()], "compute budget")):
        with pytest.raises(ConfigError, match=message):
            ContinualLearner(tiny_clip(seed=0), stream, methods, load_image_processor(32), clip_tokenizer, args)
    assert not (tmp_path / "run").exists()


def test_errors_of_checks_made_after_loading_name_where_the_value_was_given(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("stream: digits\nmethods: [joint]\nmethod_args:\n  joint: {max_examples: 0}\n")
    err = _refused(tmp_path, capsys, config=str(path))
    assert f"method_args.joint: max_examples must be >= 1 or null, got 0 (in {path})" in err
    err = _refused(tmp_path, capsys, "methods=[joint, er]", config=str(path))
    assert f"(in {path} or the overrides)" in err


@pytest.mark.parametrize(("overrides", "message"), [
    (["methods=[grow_vocab]", "method_args.grow_vocab.vocab_size=1000000000"],
     "method_args.grow_vocab: vocab_size must be in [257, 1048576] (more than the 256-byte alphabet; at most 4x"),
    (["methods=[grow_vocab]", "method_args.grow_vocab.context_length=1000000000"],
     "method_args.grow_vocab: context_length must be in [2, 8192]"),
    (["methods=[ctp]", "method_args.ctp.queue_size=1000000000"], "method_args.ctp: queue_size must be in [0, 1048576]"),
    (["methods=[prompt]", "method_args.prompt.n_ctx=1000000000"], "method_args.prompt: n_ctx must be in [0, 8189]"),
])
def test_absurd_sizes_are_refused_before_anything_is_built(tmp_path, capsys, overrides, message):
    """Sizes that would allocate beyond any machine (10^9 BPE tokens aborted the process in the tokenizers trainer;
    a 10^9-row queue, position table or prompt raised a torch allocation error after the run had started)."""
    assert message in _refused(tmp_path, capsys, *overrides)


def test_a_prompt_longer_than_the_model_context_is_named_before_it_is_built(tmp_path, capsys):
    """n_ctx within the bound but beyond this model's 77 positions: one line naming the option and the most it can
    be, at the first task's start (before the prompt is allocated), not a failure inside the text tower."""
    code = main(["train", "--config", "digits", f"output_dir={tmp_path / 'run'}", "progress=false",
                 "evaluation.initial=false", "methods=[prompt]", "method_args.prompt.n_ctx=80",
                 "model.config.hidden_size=32", "model.config.num_layers=1", "stream_args.max_train_per_task=8",
                 "stream_args.max_eval_per_task=4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err == ("hf-ccl: error: method_args.prompt.n_ctx=80 leaves no room for the text in the "
                                 "model's 77 text positions (BOS, EOS and one token need 3): set it to at most 74")
