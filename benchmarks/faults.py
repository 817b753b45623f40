"""Faults and bad inputs, met as a user meets them: the `hf-ccl train` CLI in a subprocess, killed (`kill -9`,
SIGTERM, SIGINT) at set points, run out of disk, run twice on one folder, resumed from damaged files, pushed to a
Hub that fails, and given values that make no sense. Every case is judged by what the user ends up with:

- `refused before work`: exit 2, a one-line message naming what to fix, nothing written;
- `clear error`: a non-zero exit, a message naming the file / key / revision at fault, nothing silently lost;
- `recovered`: the run (or its resume) ends with exit 0 and the results matrix of the uninterrupted run, bit for bit;
- `SILENT WRONG RESULT`: exit 0 with a result that differs from the truth, or an option that did nothing;
- `DATA LOST`: finished work is gone, or a failure left no way back;
- `UNCLEAR ERROR`: a non-zero exit whose message does not say what to fix (a traceback, a message not naming it).

The runs are tiny (a random 1-layer CLIP on 5 `digits` tasks of 48 images, 4 steps a task, ER): the point is the
behaviour, not the model. Kill points are set inside the process (`--child`), so they fall at the same place every
time. The disk-full cases mount a small tmpfs and need root; without it they are listed as not run.

    python benchmarks/faults.py [--only SUBSTRING] [--shared ../shared]

Writes benchmarks/results/faults.md (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_TOKEN = "hf_faultsSuiteSecretToken0123456789"
#: A small run: 5 tasks x 4 steps of 16 images, ER (a method with state files), a Trainer checkpoint every 2 steps.
BASE = [
    "--config", "digits", "progress=false", "methods=[er]", "training.max_steps=4",
    "training.per_device_train_batch_size=16", "stream_args.max_train_per_task=48", "stream_args.max_eval_per_task=20",
    "model.config.hidden_size=32", "model.config.num_layers=1", "training.save_strategy=steps", "training.save_steps=2",
]
STEPS_PER_TASK = 4
GOOD = ("refused before work", "clear error", "recovered")


@dataclass
class Outcome:
    outcome: str
    exit: str
    seen: str


@dataclass
class Case:
    group: str
    name: str
    fault: str
    run: Callable[[Path], Outcome]


# ----- running the CLI ---------------------------------------------------------------------------------------------
@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def message(self) -> str:
        """The last non-empty line of stderr (the CLI's one-line error), else of stdout."""
        for text in (self.err, self.out):
            lines = [line for line in text.strip().splitlines() if line.strip()]
            if lines:
                return lines[-1].strip()
        return ""

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_TOKEN": FAKE_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_CCL_DEBUG", None)
    return {**env, **(extra or {})}


def cli(output_dir: Path | None, *overrides: str, child: str | None = None, env: dict[str, str] | None = None,
        base: list[str] | None = None, timeout: float = 600) -> Ran:
    """`hf-ccl train` with `BASE` + overrides (and `output_dir`), or this script's `--child POINT` wrapper."""
    args = [*(BASE if base is None else base), *overrides]
    if output_dir is not None:
        args.append(f"output_dir={output_dir}")
    command = [sys.executable, "-m", "hf_ccl.cli", "train", *args]
    if child is not None:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", child, "--", *args]
    done = subprocess.run(command, cwd=REPO, env=environment(env), capture_output=True, text=True, timeout=timeout)
    return Ran(done.returncode, done.stdout, done.stderr)


def rows(output_dir: Path) -> list | None:
    path = output_dir / "results.json"
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return None


def exit_text(code: int) -> str:
    return f"{code}" if code >= 0 else f"killed ({signal.Signals(-code).name})"


def short(text: str, limit: int = 150) -> str:
    text = text.replace("|", "\\|").replace(FAKE_TOKEN, "**THE TOKEN**")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----- judging -----------------------------------------------------------------------------------------------------
class Judge:
    """Outcomes from a finished command, against the uninterrupted run's matrix."""

    def __init__(self, reference: list):
        self.reference = reference

    def resumed(self, ran: Ran, output_dir: Path, before: str = "") -> Outcome:
        """A resume (or a run that should have coped): recovered with the reference matrix, or an error."""
        prefix = f"{before}; resume: " if before else ""
        if ran.code == 0:
            got = rows(output_dir)
            if got == self.reference:
                return Outcome("recovered", prefix + "0", "identical results matrix")
            return Outcome("SILENT WRONG RESULT", prefix + "0", "exit 0, results matrix differs from the "
                           "uninterrupted run" if got else "exit 0, no results")
        return self.error(ran, prefix)

    def error(self, ran: Ran, prefix: str = "", names: str | None = None) -> Outcome:
        """A non-zero exit: clear when one line says what went wrong (and names `names` when given)."""
        if ran.code == 0:
            return Outcome("SILENT WRONG RESULT", prefix + "0", "exit 0: " + (ran.message or "accepted"))
        clear = not ran.traceback and ran.message and (names is None or names in ran.message)
        return Outcome("clear error" if clear else "UNCLEAR ERROR", prefix + exit_text(ran.code), ran.message)

    @staticmethod
    def refused(ran: Ran, output_dir: Path, names: str) -> Outcome:
        """A bad input: exit 2, one line naming `names`, nothing written."""
        written = output_dir.exists() and any(output_dir.iterdir())
        if ran.code == 0:
            return Outcome("SILENT WRONG RESULT", "0", "accepted")
        if ran.traceback or names.lower() not in ran.message.lower():
            return Outcome("UNCLEAR ERROR", exit_text(ran.code), ran.message)
        if written:
            return Outcome("clear error", exit_text(ran.code), "(files written first) " + ran.message)
        return Outcome("refused before work" if ran.code == 2 else "clear error", exit_text(ran.code), ran.message)


# ----- the cases ---------------------------------------------------------------------------------------------------
BAD_INPUTS: list[tuple[str, list[str], str]] = [
    ("evaluation batch of 0", ["evaluation.batch_size=0"], "evaluation.batch_size"),
    ("negative epochs", ["training.num_train_epochs=-1", "training.max_steps=-1"], "num_train_epochs"),
    ("learning rate not a number", ["training.learning_rate=abc"], "learning_rate"),
    ("batch size 0", ["training.per_device_train_batch_size=0"], "per_device_train_batch_size"),
    ("gradient accumulation 0", ["training.gradient_accumulation_steps=0"], "gradient_accumulation_steps"),
    ("TrainingArguments seed (ignored by the loop)", ["training.seed=1"], "training.seed"),
    ("TrainingArguments resume (ignored by the loop)", ["training.resume_from_checkpoint=x"], "resume_from_checkpoint"),
    ("fp16 on a CPU", ["training.fp16=true"], "fp16"),
    ("bf16 without use_cpu on a CPU", ["training.bf16=true"], "bf16"),
    ("joint with replay", ["methods=[joint,er]"], "joint"),
    ("unknown method", ["methods=[nope]"], "nope"),
    ("method option of the wrong type", ["method_args.er.buffer_size=lots"], "buffer_size"),
    ("unknown method option", ["method_args.er.bufer_size=100"], "bufer_size"),
    ("mistyped local model path", ["model.pretrained=./no/such/model", "model.config={}"], "no/such/model"),
    ("unknown stream", ["stream=nope"], "nope"),
    ("negative subsample", ["stream_args.max_train_per_task=-3"], "max_train_per_task"),
    ("negative seed", ["seed=-1"], "seed"),
    ("max_length 1", ["max_length=1"], "max_length"),
    ("unknown integration", ["training.report_to=[nope]"], "report_to"),
    ("a token in the training section", [f"training.hub_token={FAKE_TOKEN}"], "hub_token"),
    ("a token under a mistyped key", [f"hub_tokn={FAKE_TOKEN}"], "hub_tokn"),
    ("unknown top-level key", ["sed=3"], "sed"),
    ("warmup with a constant schedule", ["training.lr_scheduler_type=constant", "training.warmup_steps=2"], "warmup"),
    ("a token as hub.model_id", [f"hub.model_id=someone/{FAKE_TOKEN}"], "hub.model_id"),
    ("a token as card.license", [f"card.license={FAKE_TOKEN}"], "card.license"),
    ("a token as training.run_name", [f"training.run_name={FAKE_TOKEN}"], "training.run_name"),
    ("a token as model.pretrained", [f"model.pretrained={FAKE_TOKEN}", "model.config={}"], "model.pretrained"),
    ("a token as a method option's name", [f"method_args.er.{FAKE_TOKEN}=1"], "method_args.er"),
    ("10^5 MoE experts", ["methods=[moe_adapters]", "method_args.moe_adapters.num_experts=100000"], "num_experts"),
    ("MoE bottleneck 10^5", ["methods=[moe_adapters]", "method_args.moe_adapters.bottleneck=100000"], "bottleneck"),
    ("LoRA rank 10^6", ["methods=[lora]", "method_args.lora.r=1000000"], "r <= "),
    ("LoRA rank above the layers' rank", ["methods=[lora]", "method_args.lora.r=33"], "r <= "),
    ("grow_vocab with 10^9 tokens", ["methods=[grow_vocab]", "method_args.grow_vocab.vocab_size=1000000000"],
     "vocab_size"),
    ("grow_vocab to a 10^9 context", ["methods=[grow_vocab]", "method_args.grow_vocab.context_length=1000000000"],
     "context_length"),
    ("a CTP queue of 10^9", ["methods=[ctp]", "method_args.ctp.queue_size=1000000000"], "queue_size"),
    ("10^9 prompt vectors", ["methods=[prompt]", "method_args.prompt.n_ctx=1000000000"], "n_ctx"),
    ("a model of 2 * 10^11 parameters", ["model.config.hidden_size=65536"], "model.config"),
    ("a model whose tensors overflow", ["model.config.hidden_size=1000000000"], "model.config"),
    ("a YAML alias bomb in an override",
     ["training.report_to=[&a [x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
      "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e], "
      "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g], [*h,*h,*h,*h,*h,*h,*h,*h,*h]]"], "report_to"),
    ("push without a repository", ["training.push_to_hub=true"], "push_to_hub"),
    ("bad Hub repository id", ["hub.model_id=not a repo"], "hub.model_id"),
]


def bad_input_case(name: str, overrides: list[str], names: str) -> Case:
    def run(tmp: Path) -> Outcome:
        output_dir = tmp / "run"
        ran = cli(output_dir, *overrides)
        outcome = Judge.refused(ran, output_dir, names)
        if FAKE_TOKEN in ran.out + ran.err:
            return Outcome("SILENT WRONG RESULT", outcome.exit, "the token was echoed")
        return outcome

    return Case("bad input", name, " ".join(overrides), run)


def config_file_cases() -> list[Case]:
    def missing(tmp: Path) -> Outcome:
        ran = cli(tmp / "run", base=["--config", str(tmp / "nope.yaml")])
        return Judge.refused(ran, tmp / "run", "nope.yaml")

    def broken(tmp: Path) -> Outcome:
        config = tmp / "broken.yaml"
        config.write_text("stream: digits\nmethods: [er\n")
        ran = cli(tmp / "run", base=["--config", str(config)])
        return Judge.refused(ran, tmp / "run", "broken.yaml")

    def output_is_a_file(tmp: Path) -> Outcome:
        target = tmp / "run"
        target.write_text("not a folder")
        ran = cli(target)
        return Judge.refused(ran, tmp / "none", "output_dir")

    def newline_task_name(tmp: Path) -> Outcome:
        config = tmp / "newline.yaml"
        config.write_text("stream:\n  builder: datasets\n  name: pacs-two\n  entries:\n"
                          "    - {name: \"photo\\nart\", train: pacs, where: {domain: photo}, label_column: label}\n"
                          "    - {name: sketch, train: pacs, where: {domain: sketch}, label_column: label}\n"
                          "stream_args: {max_train_per_task: 32, max_eval_per_task: 10}\n")
        ran = cli(tmp / "run", base=["--config", str(config), "progress=false", "training.max_steps=2",
                                     "model.config.hidden_size=32", "model.config.num_layers=1"])
        return Judge.refused(ran, tmp / "none", "task name")

    def read_only_disk(tmp: Path) -> Outcome:
        if os.geteuid() != 0:
            return Outcome("not run", "-", "needs root to mount a read-only tmpfs")
        mount = tmp / "read-only"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mount)], check=True)
        try:
            ran = cli(mount / "run")
            if "space" in ran.message.lower():
                return Outcome("UNCLEAR ERROR", exit_text(ran.code), "called a full disk: " + ran.message)
            return Judge.refused(ran, tmp / "none", "read-only")
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)

    def alias_bomb_file(tmp: Path) -> Outcome:
        config = tmp / "bomb.yaml"
        levels = ["a: &l0 [x, x, x, x, x, x, x, x, x]"]
        levels += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 9)]
        config.write_text("stream: digits\nbomb:\n" + "\n".join("  " + line for line in levels) + "\n")
        ran = cli(tmp / "run", base=["--config", str(config)], timeout=120)
        return Judge.refused(ran, tmp / "none", "bomb.yaml")

    def bad_data_file(case: str) -> Callable[[Path], Outcome]:
        def run(tmp: Path) -> Outcome:
            import numpy as np
            from datasets import Dataset, Features, Image, Value
            from PIL import Image as PILImage

            train, evaluation = tmp / f"{case}.parquet", tmp / "eval.parquet"
            pictures = [PILImage.fromarray(np.full((8, 8, 3), 40 * n, dtype=np.uint8)) for n in range(4)]
            Dataset.from_dict({"image": pictures, "caption": [f"a photo {n}" for n in range(4)]},
                              features=Features({"image": Image(), "caption": Value("string")})).to_parquet(evaluation)
            rows = [{"image": index, "caption": f"a photo {index}"} for index in range(4)]
            if case == "empty":
                train.write_bytes(b"")
            elif case == "no-rows":
                Dataset.from_list(rows).select([]).to_parquet(train)
            else:
                Dataset.from_list(rows).to_parquet(train)
            config = tmp / "bad-data.yaml"
            config.write_text(f"stream: {{builder: random_split, train: {train}, eval: {evaluation}, n_tasks: 2, "
                              "text_column: caption}\n")
            ran = cli(tmp / "run", base=["--config", str(config), "progress=false"])
            return Judge.refused(ran, tmp / "run", train.name)

        return run

    return [Case("bad input", "missing config file", "--config nope.yaml", missing),
            Case("bad input", "a YAML alias bomb in a config file", "9 levels of 9 aliases (435M values)",
                 alias_bomb_file),
            Case("bad input", "an empty parquet file", "a stream spec whose train file has 0 bytes",
                 bad_data_file("empty")),
            Case("bad input", "a parquet file without rows", "a stream spec whose train file has a schema, no rows",
                 bad_data_file("no-rows")),
            Case("bad input", "an integer image column", "a stream spec whose image column holds int64",
                 bad_data_file("int-image")),
            Case("bad input", "newline in a task name", "a stream entry named 'photo\\nart'", newline_task_name),
            Case("bad input", "read-only output disk", "output_dir on a read-only tmpfs", read_only_disk),
            Case("bad input", "YAML syntax error", "an unclosed list", broken),
            Case("bad input", "output_dir is a file", "output_dir=<a file>", output_is_a_file)]


def python_case(group: str, name: str, fault: str, code: str, names: str, expect: str = "error") -> Case:
    """A fault met through the Python API (`code` run in a fresh process): an exception whose last line names
    `names` is a clear error; `expect="ok"`: the code must end with exit 0 (its asserts hold)."""

    def run(tmp: Path) -> Outcome:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=environment({"HF_HUB_OFFLINE": "1"}),
                              capture_output=True, text=True, timeout=600)
        ran = Ran(done.returncode, done.stdout, done.stderr)
        if expect == "ok":
            return Outcome("recovered", "0", ran.out.strip()[-150:] or "as expected") if ran.code == 0 else \
                Outcome("SILENT WRONG RESULT", exit_text(ran.code), ran.message)
        if ran.code == 0:
            return Outcome("SILENT WRONG RESULT", "0", "no error: " + ran.out.strip()[-150:])
        clear = names in ran.message
        return Outcome("clear error" if clear else "UNCLEAR ERROR", exit_text(ran.code), ran.message)

    return Case(group, name, fault, run)


_METRIC = "import math, hf_ccl.metrics as m; "
PYTHON_CASES = [
    python_case("metrics", "NaN image embedding in zero_shot_accuracy", "one NaN row of 4",
                "import torch; from hf_ccl.evaluation.zeroshot import zero_shot_accuracy as z; e = torch.eye(4); "
                "e[2] = float('nan'); print(z(e, torch.arange(4), torch.eye(4)))", "row 2"),
    python_case("metrics", "NaN image embedding in the evaluate module", "one NaN row of 4, evaluate.load",
                "import torch, hf_ccl.metrics as m; e = torch.eye(4); e[2] = float('nan'); "
                "print(m.load('zero_shot_accuracy').compute(predictions=e.tolist(), references=[0, 1, 2, 3], "
                "class_embeds=torch.eye(4).tolist()))", "row 2"),
    python_case("metrics", "an infinite cell", "R[1][0] = -inf in the forgetting module",
                _METRIC + "print(m.load('forgetting').compute(predictions=[[50.0, 10.0], [-math.inf, 60.0]]))",
                "R[1, 0]"),
    python_case("metrics", "a score above 100", "R[1][1] = 130 in final_average",
                "from hf_ccl.evaluation.continual_metrics import final_average; "
                "print(final_average([[50.0, 10.0], [40.0, 130.0]]))", "130"),
    python_case("metrics", "scores as fractions", "a 0-1 matrix given to the mtil module",
                _METRIC + "print(m.load('mtil').compute(predictions=[[0.5, 0.1], [0.4, 0.6]], initial=[0.1, 0.1]))",
                "fraction"),
    python_case("metrics", "the tic module's name", "evaluate.load(path('tic')).name",
                "import evaluate, hf_ccl.metrics as m; names = [evaluate.load(m.path(n)).name for n in m.METRIC_MODULES]; "
                "assert names == list(m.METRIC_MODULES), names; print('every module loads by its name')", "", "ok"),
]


class Faults:
    """The cases that need runs: interruptions, disk, folders, damaged files, the Hub."""

    def __init__(self, tmp: Path):
        self.tmp = tmp

    @functools.cached_property
    def judge(self) -> Judge:
        """Judged against the uninterrupted run (made on first use)."""
        reference = cli(self.tmp / "reference")
        if reference.code != 0:
            raise RuntimeError(f"the reference run failed: {reference.err[-3000:]}")
        return Judge(rows(self.tmp / "reference"))

    @functools.cached_property
    def killed_run(self) -> Path:
        """A run killed mid task 3: task-2 is its newest complete checkpoint, with a Trainer checkpoint of task 3."""
        killed = self.tmp / "killed"
        cli(killed, child=f"step:{3 * STEPS_PER_TASK + 3}")
        return killed

    # --- interruptions ---
    def interrupted(self, point: str, expect_code: int | None = None, resume: str = "true"
                    ) -> Callable[[Path], Outcome]:
        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            first = cli(output_dir, child=point)
            before = exit_text(first.code)
            if expect_code is not None and first.code != expect_code:
                return Outcome("UNCLEAR ERROR", before, f"expected exit {expect_code}: {first.message}")
            return self.judge.resumed(cli(output_dir, f"resume_from_checkpoint={resume}"), output_dir, before)

        return run

    def resume_right_after_kill(self, tmp: Path) -> Outcome:
        """The lock of a `kill -9`ed run must not block the resume."""
        output_dir = tmp / "run"
        shutil.copytree(self.killed_run, output_dir)
        return self.judge.resumed(cli(output_dir, "resume_from_checkpoint=true"), output_dir, "killed")

    # --- disk full ---
    def disk_full(self, tmp: Path) -> Outcome:
        if os.geteuid() != 0:
            return Outcome("not run", "-", "needs root to mount a small tmpfs")
        mount = tmp / "small-disk"
        mount.mkdir()
        size_kb = max(256, folder_kb(self.killed_run) // 2)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)], check=True)
        try:
            output_dir = mount / "run"
            first = cli(output_dir)
            if first.code == 0:
                return Outcome("SILENT WRONG RESULT", "0", f"a run on a {size_kb} KiB disk ended with exit 0")
            said = first.message
            subprocess.run(["mount", "-o", f"remount,size={size_kb * 20}k", str(mount)], check=True)
            resumed = self.judge.resumed(cli(output_dir, "resume_from_checkpoint=true"), output_dir,
                                         exit_text(first.code))
            clear = "space" in said.lower() and not first.traceback
            return Outcome(resumed.outcome if clear else "UNCLEAR ERROR", resumed.exit,
                           f"full: {said} / then {resumed.seen}")
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)

    # --- folders ---
    @staticmethod
    def during_a_run(output_dir: Path, first_overrides: list[str], *second_overrides: str
                     ) -> tuple[subprocess.CompletedProcess, Ran, bool]:
        """Start a run in `output_dir`, run a second one there once the first has written run_config.yaml; the
        first's result, the second's, and whether the first was still running when the second ended."""
        first = subprocess.Popen([sys.executable, "-m", "hf_ccl.cli", "train", *BASE, *first_overrides,
                                  f"output_dir={output_dir}"], cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not (output_dir / "run_config.yaml").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        second = cli(output_dir, *first_overrides, *second_overrides)
        still_running = first.poll() is None
        out, err = first.communicate(timeout=900)
        return subprocess.CompletedProcess(first.args, first.returncode, out, err), second, still_running

    def concurrent(self, tmp: Path) -> Outcome:
        output_dir = tmp / "run"
        first, second, _ = self.during_a_run(output_dir, ["training.max_steps=12"])
        if first.returncode != 0:
            return Outcome("DATA LOST", f"{first.returncode}/{second.code}", "the first run failed: " +
                           first.stderr[-200:])
        if second.code == 0:
            return Outcome("SILENT WRONG RESULT", "0/0", "both runs ran on one folder")
        return self.judge.error(second, "first 0; second ")

    def new_run_over_old(self, tmp: Path) -> Outcome:
        output_dir = tmp / "run"
        shutil.copytree(self.killed_run, output_dir)
        ran = cli(output_dir, "seed=1")
        if ran.code == 0:
            return Outcome("SILENT WRONG RESULT", "0", "a new run wrote into another run's folder")
        if ran.code != 2:
            return Outcome("UNCLEAR ERROR", exit_text(ran.code), "not refused before the run was built: " + ran.message)
        return Outcome("refused before work", "2", ran.message) if "resume" in ran.message else self.judge.error(ran)

    def concurrent_overwrite(self, tmp: Path) -> Outcome:
        """`overwrite_output_dir=true` while another run trains in the folder: refused; the first run undisturbed."""
        output_dir = tmp / "run"
        first, second, still_running = self.during_a_run(output_dir, ["training.max_steps=40"],
                                                         "overwrite_output_dir=true")
        if not still_running:
            return Outcome("case failed", f"{first.returncode}/{second.code}", "the first run ended before the second "
                           "was checked: make it longer")
        if second.code == 0:
            return Outcome("SILENT WRONG RESULT", f"{first.returncode}/0", "the overwrite ran over a running run")
        if first.returncode != 0 or rows(output_dir) is None or not (output_dir / "task-4").is_dir():
            return Outcome("DATA LOST", f"{first.returncode}/{second.code}", "the first run was disturbed: " +
                           first.stderr[-200:])
        outcome = Judge.refused(second, tmp / "none", "in use by another run")
        return Outcome(outcome.outcome, f"first 0; second {outcome.exit}", outcome.seen)

    def leftover_of_failed_run(self, tmp: Path) -> Outcome:
        """A first run that failed before its first checkpoint left run_config.yaml and an empty trainer/: the
        rerun (not a resume) starts there."""
        output_dir = tmp / "run"
        (output_dir / "trainer" / "task-0").mkdir(parents=True)
        (output_dir / "run_config.yaml").write_text("seed: 3\n")
        return self.judge.resumed(cli(output_dir), output_dir)

    def sigterm_first_task(self, tmp: Path) -> Outcome:
        """SIGTERM in task 0 after its first Trainer checkpoint: the message must point at that checkpoint."""
        output_dir = tmp / "run"
        first = cli(output_dir, child="sigterm:3")
        if first.code != 143 or "resume with" not in first.err:
            return Outcome("UNCLEAR ERROR", exit_text(first.code), "no way to resume named: " + first.message)
        return self.judge.resumed(cli(output_dir, "resume_from_checkpoint=true"), output_dir, "143")

    def planted_link(self, tmp: Path) -> Outcome:
        """compute.json, results.json and run_config.yaml of the run folder replaced by links to a file outside it."""
        output_dir = tmp / "run"
        shutil.copytree(self.killed_run, output_dir)
        outside = tmp / "outside.txt"
        outside.write_text("keep me")
        for name in ("compute.json", "results.json", "run_config.yaml"):
            (output_dir / name).unlink(missing_ok=True)
            (output_dir / name).symlink_to(outside)
        outcome = self.judge.resumed(cli(output_dir, "resume_from_checkpoint=true"), output_dir)
        if outside.read_text() != "keep me":
            return Outcome("DATA LOST", outcome.exit, "a file outside the run folder was overwritten through a link")
        return outcome

    def resumed_with_other_model(self, *overrides: str, names: str) -> Callable[[Path], Outcome]:
        """A resume whose model is of another family or size than the checkpoint's: refused before it is built."""

        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            shutil.copytree(self.killed_run, output_dir)
            ran = cli(output_dir, "resume_from_checkpoint=true", *overrides)
            if ran.code == 0:
                return Outcome("SILENT WRONG RESULT", "0", "resumed into another model")
            outcome = Judge.refused(ran, tmp / "none", names)
            return outcome

        return run

    def two_cpu_processes(self, tmp: Path, *extra: str) -> Outcome:
        """The README's `accelerate launch --multi_gpu --num_processes 2 recipes/train.py` on this CPU machine."""
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        output_dir = tmp / "run"
        env = {key: value for key, value in environment().items() if not key.startswith("ACCELERATE_")}
        # one epoch of 32 rows in batches of 16 a process: one step of 32 samples when the rows are split, two steps
        # of 64 (each row twice) when both processes read them all
        epoch = ["methods=[finetune]", "stream_args.max_train_per_task=32", "training.max_steps=-1",
                 "training.num_train_epochs=1", "training.warmup_steps=0"]  # (no replay: the task's own rows only)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                   str(port), str(REPO / "recipes" / "train.py"), *BASE, *epoch, f"output_dir={output_dir}", *extra]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        ran = Ran(done.returncode, done.stdout, done.stderr)
        if extra:  # a setting that keeps each process's Trainer alone: refused
            if ran.code == 0:
                return Outcome("SILENT WRONG RESULT", "0", "two processes trained alone")
            said = [line for line in ran.err.splitlines() if line.startswith("hf-ccl: error:")]
            if not said or "use_cpu" not in said[0] or (output_dir.exists() and any(output_dir.iterdir())):
                return Outcome("UNCLEAR ERROR", exit_text(ran.code), said[0] if said else ran.message)
            return Outcome("refused before work", f"{exit_text(ran.code)} (each process: 2)", said[0])
        if ran.code != 0:
            return self.judge.error(ran)
        tasks = json.loads((output_dir / "compute.json").read_text())["tasks"]
        seen = [(task["optimizer_steps"], task["samples_seen"]) for task in tasks]
        if seen != [(1, 32)] * 5:
            return Outcome("SILENT WRONG RESULT", "0", f"(steps, samples) per task {seen}: one epoch of 32 rows over "
                           "2 processes is 1 step of 32")
        return Outcome("recovered", "0", f"one DDP run: (steps, samples) per task {seen}")

    def partial_batches(self, tmp: Path) -> Outcome:
        """20 rows a task in batches of 16, one epoch: 20 samples seen, not 32."""
        output_dir = tmp / "run"
        ran = cli(output_dir, "methods=[finetune]", "stream_args.max_train_per_task=20", "training.max_steps=-1",
                  "training.num_train_epochs=1")  # (no replay: the task's own rows only)
        if ran.code != 0:
            return self.judge.error(ran)
        tasks = json.loads((output_dir / "compute.json").read_text())["tasks"]
        seen = [task["samples_seen"] for task in tasks]
        if seen != [20] * 5:
            return Outcome("SILENT WRONG RESULT", "0", f"samples seen per task {seen}, 20 rows each")
        return Outcome("recovered", "0", f"samples seen per task {seen}; MACs measured: "
                       f"{all(task.get('macs_measured') for task in tasks)}")

    def pretrained_without_tokenizer(self, tmp: Path) -> Outcome:
        """A saved model folder (a 1,000-token vocabulary) without tokenizer files, given as model.pretrained."""
        folder = tmp / "model"
        code = ("import sys; from hf_ccl.testing import tiny_model; "
                "tiny_model('clip', vocab_size=1000).save_pretrained(sys.argv[1])")
        subprocess.run([sys.executable, "-c", code, str(folder)], cwd=REPO, env=environment(), check=True,
                       capture_output=True)
        ran = cli(tmp / "run", f"model.pretrained={folder}", "model.config={}")
        return Judge.refused(ran, tmp / "run", "tokenizer")

    def diverged_then_sane(self, tmp: Path) -> Outcome:
        """The last update of task 0 overflows (lr 1e30): an error naming the step, nothing of the bad weights saved;
        a resume with a sane learning rate ends as the uninterrupted run."""
        output_dir = tmp / "run"
        first = cli(output_dir, "training.learning_rate=1e30")
        if first.code == 0:
            return Outcome("SILENT WRONG RESULT", "0", "a diverging run exited 0")
        if "step" not in first.message or list(output_dir.glob("task-*")):
            return Outcome("UNCLEAR ERROR", exit_text(first.code), first.message)
        ran = cli(output_dir, "resume_from_checkpoint=auto", "resume_allow_changes=[training.learning_rate]",
                  "training.learning_rate=0.001")
        return self.judge.resumed(ran, output_dir, exit_text(first.code))

    def refused_before_training(self, overrides: tuple[str, ...], names: str) -> Callable[[Path], Outcome]:
        """A run that cannot train as asked, known from the stream: an error before any task trains."""

        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            ran = cli(output_dir, *overrides)
            if ran.code == 0:
                return Outcome("SILENT WRONG RESULT", "0", "accepted: " + ran.message)
            if list(output_dir.glob("task-*")) or list(output_dir.glob("trainer/task-*/checkpoint-*")):
                return Outcome("UNCLEAR ERROR", exit_text(ran.code), "refused only after training: " + ran.message)
            return self.judge.error(ran, names=names)

        return run

    def overwrite(self, tmp: Path) -> Outcome:
        output_dir = tmp / "run"
        shutil.copytree(self.killed_run, output_dir)
        return self.judge.resumed(cli(output_dir, "overwrite_output_dir=true"), output_dir)

    def changed_on_resume(self, override: str, key: str) -> Callable[[Path], Outcome]:
        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            shutil.copytree(self.killed_run, output_dir)
            ran = cli(output_dir, "resume_from_checkpoint=true", override)
            if ran.code == 0:
                return Outcome("SILENT WRONG RESULT", "0", f"resumed with a changed {key}")
            return self.judge.error(ran, names=key)

        return run

    def allowed_change(self, overrides: tuple[str, ...], key_part: str, card: bool = False
                       ) -> Callable[[Path], Outcome]:
        """A resume with a change `resume_allow_changes` lets through: it must be recorded (a key containing
        `key_part` in continual_state.json's resume_changes, and with `card` in the model card)."""

        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            shutil.copytree(self.killed_run, output_dir)
            ran = cli(output_dir, "resume_from_checkpoint=true", *overrides)
            if ran.code != 0:
                return self.judge.error(ran)
            state = json.loads((latest_task(output_dir) / "continual_state.json").read_text())
            recorded = [change.get("key") for change in state.get("resume_changes", [])]
            text = (latest_task(output_dir) / "README.md").read_text()
            if not any(key_part in key for key in recorded) or (card and not any(key in text for key in recorded)):
                return Outcome("SILENT WRONG RESULT", "0", f"the change is not recorded (resume_changes: {recorded})")
            return Outcome("recovered", "0", "resumed; the change is recorded in continual_state.json" +
                           (" and the card" if card else ""))

        return run

    def finished_run_resumed(self, tmp: Path) -> Outcome:
        output_dir = tmp / "run"
        first = cli(output_dir)
        if first.code != 0:
            return self.judge.error(first)
        (output_dir / "results.json").unlink()
        again = cli(output_dir, "resume_from_checkpoint=true")
        outcome = self.judge.resumed(again, output_dir, "0")
        if outcome.outcome == "recovered" and "nothing to train" not in again.err:
            return Outcome("SILENT WRONG RESULT", outcome.exit, "the matrix is printed with no word that nothing "
                           "was trained")
        return Outcome(outcome.outcome, outcome.exit, outcome.seen + ("; says nothing was trained"
                                                                       if outcome.outcome == "recovered" else ""))

    # --- damaged files ---
    def damaged(self, damage: Callable[[Path], str], expect: str) -> Callable[[Path], Outcome]:
        """`damage(run_folder)` returns the name the error must give; `expect`: 'error' or 'recovered'."""

        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            shutil.copytree(self.killed_run, output_dir)
            names = damage(output_dir)
            ran = cli(output_dir, "resume_from_checkpoint=true")
            if expect == "recovered":
                return self.judge.resumed(ran, output_dir)
            if ran.code == 0:
                same = rows(output_dir) == self.judge.reference
                return Outcome("SILENT WRONG RESULT", "0", "resumed from a damaged checkpoint" +
                               ("" if same else " and the matrix differs"))
            return self.judge.error(ran, names=names)

        return run

    # --- the Hub ---
    def hub(self, faults: dict[str, float], expect: str, extra: tuple[str, ...] = ()) -> Callable[[Path], Outcome]:
        from hf_ccl.testing.hub_server import FaultPlan, local_hub_process

        def run(tmp: Path) -> Outcome:
            output_dir = tmp / "run"
            with local_hub_process(tmp / "hub", faults=FaultPlan(**faults)) as endpoint:
                env = hub_env(endpoint)
                ran = cli(output_dir, "hub.model_id=hf-ccl-test/faults", "hub.retries=1", "hub.backoff=0.1",
                          "hub.timeout=10", *extra, env=env)
                leaked = leak(ran, output_dir)
                if leaked:
                    return Outcome("SILENT WRONG RESULT", exit_text(ran.code), leaked)
                local_done = (output_dir / "task-4").is_dir()
                branches = remote_branches(endpoint, "hf-ccl-test/faults")
                if expect == "pushed":
                    missing = [f"task-{k}" for k in range(5) if f"task-{k}" not in branches]
                    if ran.code == 0 and not missing:
                        return Outcome("recovered", "0", "every task pushed; " + ran.message)
                    if ran.code == 0:
                        return Outcome("SILENT WRONG RESULT", "0", f"exit 0 with {missing} not on the Hub")
                    return self.judge.error(ran)
                if not local_done:
                    return Outcome("DATA LOST", exit_text(ran.code), "local checkpoints incomplete: " + ran.message)
                if ran.code == 0:
                    return Outcome("SILENT WRONG RESULT", "0", "pushes failed, exit 0")
                return self.judge.error(ran, names="task-")

        return run

    def hub_download_damaged(self, tmp: Path) -> Outcome:
        """Resume from the Hub (an empty local folder) when a pushed file's bytes were changed on the server."""
        from hf_ccl.testing.hub_server import local_hub_process

        with local_hub_process(tmp / "hub") as endpoint:
            env = hub_env(endpoint)
            first = cli(tmp / "first", "hub.model_id=hf-ccl-test/faults", env=env)
            if first.code != 0:
                return self.judge.error(first, "push run: ")
            blob = largest_blob(tmp / "hub")
            flip_bytes(blob)
            ran = cli(tmp / "again", "hub.model_id=hf-ccl-test/faults", "resume_from_checkpoint=true", env=env)
            if ran.code == 0:
                return Outcome("SILENT WRONG RESULT", "0", "resumed from a damaged download")
            return self.judge.error(ran, names="safetensors")

    def unreachable_hub(self, tmp: Path) -> Outcome:
        output_dir = tmp / "run"
        ran = cli(output_dir, "hub.model_id=hf-ccl-test/faults", "hub.retries=1", "hub.backoff=0.1",
                  "hub.timeout=5", env=hub_env("http://127.0.0.1:9"))
        if not (output_dir / "task-4").is_dir() and not (output_dir.exists() and ran.code == 2):
            if ran.code != 0 and not output_dir.exists():
                return self.judge.error(ran)
            return Outcome("DATA LOST", exit_text(ran.code), "local checkpoints incomplete: " + ran.message)
        if ran.code == 0:
            return Outcome("SILENT WRONG RESULT", "0", "no Hub, exit 0")
        return self.judge.error(ran)


# ----- file helpers ------------------------------------------------------------------------------------------------
def folder_kb(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) // 1024


def latest_task(output_dir: Path) -> Path:
    tasks = sorted((p for p in output_dir.glob("task-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    return tasks[-1]


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) * 3 // 4
    for i in range(middle, min(middle + 64, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def trainer_checkpoint(output_dir: Path) -> Path:
    found = sorted(output_dir.glob("trainer/task-*/checkpoint-*"))
    if not found:
        raise RuntimeError(f"no Trainer checkpoint under {output_dir}/trainer")
    return found[-1]


def largest_blob(hub_root: Path) -> Path:
    return max((p for p in hub_root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def hub_env(endpoint: str) -> dict[str, str]:
    return {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


def remote_branches(endpoint: str, repo: str) -> set[str]:
    from huggingface_hub import HfApi

    try:
        refs = HfApi(endpoint=endpoint, token=FAKE_TOKEN).list_repo_refs(repo)
    except Exception:  # noqa: BLE001 (no repo: no branches)
        return set()
    return {branch.name for branch in refs.branches}


def leak(ran: Ran, output_dir: Path) -> str:
    """Where the token was written, if anywhere (the output and every file of the run)."""
    if FAKE_TOKEN in ran.out + ran.err:
        return "the token was printed"
    for path in output_dir.rglob("*") if output_dir.exists() else ():
        if path.is_file() and FAKE_TOKEN.encode() in path.read_bytes():
            return f"the token was written to {path.relative_to(output_dir)}"
    return ""


# ----- the child: kill points inside the process -------------------------------------------------------------------
def child(point: str, args: list[str]) -> int:
    """Run the CLI with a fault at `point`: `step:N` (SIGKILL after the N-th training step), `sigterm:N` / `sigint:N`
    (the signal before the N-th step), `task-save:K` (SIGKILL after task K's weights are written into its `.partial`
    folder) or `trainer-save:N` (SIGKILL in the N-th Trainer checkpoint: weights written, optimizer state not)."""
    from hf_ccl import cli as hf_cli
    from hf_ccl.modeling import ContinualCLIPModel
    from hf_ccl.trainer import ContinualTrainer

    kind, _, value = point.partition(":")
    number = int(value)
    if kind == "step":
        patch(ContinualTrainer, "training_step", number, signal.SIGKILL, after=True)
    elif kind in ("sigterm", "sigint"):
        patch(ContinualTrainer, "training_step", number, getattr(signal, kind.upper()), after=False)
    elif kind == "task-save":
        patch(ContinualCLIPModel, "save_pretrained", 1, signal.SIGKILL, after=True,
              when=lambda folder: str(folder).endswith(f"task-{number}.partial"))
    elif kind == "trainer-save":
        patch(ContinualTrainer, "_save_optimizer_and_scheduler", number, signal.SIGKILL, after=False)
    else:
        raise SystemExit(f"unknown kill point {point!r}")
    return hf_cli.main(["train", *args])


def patch(owner: type, name: str, nth: int, signum: int, after: bool,
          when: Callable[[object], bool] = lambda first: True) -> None:
    """Send `signum` to this process at the `nth` call of `owner.name` whose first argument passes `when`, before
    or after the call."""
    original = getattr(owner, name)
    calls = {"n": 0}

    def wrapped(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        hit = False
        if when(args[0] if args else None):
            calls["n"] += 1
            hit = calls["n"] == nth
        if hit and not after:
            os.kill(os.getpid(), signum)
        result = original(self, *args, **kwargs)
        if hit and after:
            os.kill(os.getpid(), signum)
        return result

    setattr(owner, name, wrapped)


# ----- the suite ---------------------------------------------------------------------------------------------------
def build_cases(faults: Faults) -> list[Case]:
    k, s = faults, STEPS_PER_TASK
    state = "continual_state.json"
    cases = [bad_input_case(*case) for case in BAD_INPUTS] + config_file_cases()
    cases += [
        Case("interruption", "kill -9 mid-task", f"SIGKILL at step {2 * s + 3} (task 2), resume",
             k.interrupted(f"step:{2 * s + 3}")),
        Case("interruption", "kill -9 in the first step", "SIGKILL at step 1, resume: auto",
             k.interrupted("step:1", resume="auto")),
        Case("interruption", "kill -9 before any task checkpoint", "SIGKILL at step 3 (task 0), resume",
             k.interrupted("step:3")),
        Case("interruption", "kill -9 while a task checkpoint is written",
             "SIGKILL after task 1's weights, before its other files, resume", k.interrupted("task-save:1")),
        Case("interruption", "kill -9 while a Trainer checkpoint is written",
             "SIGKILL in the 3rd Trainer checkpoint, before its optimizer state, resume",
             k.interrupted("trainer-save:3")),
        Case("interruption", "SIGTERM mid-task", f"SIGTERM at step {s + 2}, resume", k.interrupted(f"sigterm:{s + 2}", 143)),
        Case("interruption", "Ctrl-C mid-task", f"SIGINT at step {3 * s + 1}, resume",
             k.interrupted(f"sigint:{3 * s + 1}", 130)),
        Case("interruption", "resume at once after kill -9", "the killed run's lock left behind, resume",
             k.resume_right_after_kill),
        Case("disk", "disk full", "a tmpfs of half the run's size, then more room and resume", k.disk_full),
        Case("folder", "two runs on one folder", "a second run started while the first trains", k.concurrent),
        Case("folder", "new run over another run's folder", "seed=1 without resume", k.new_run_over_old),
        Case("folder", "overwrite_output_dir", "a new run told to overwrite", k.overwrite),
        Case("folder", "resume with another seed", "seed=1", k.changed_on_resume("seed=1", "seed")),
        Case("folder", "resume with another learning rate", "training.learning_rate=0.002",
             k.changed_on_resume("training.learning_rate=0.002", "learning_rate")),
        Case("folder", "resume with another method option", "method_args.er.buffer_size=7",
             k.changed_on_resume("method_args.er.buffer_size=7", "buffer_size")),
        Case("folder", "resume with another subsample", "stream_args.max_train_per_task=40",
             k.changed_on_resume("stream_args.max_train_per_task=40", "max_train_per_task")),
        Case("folder", "resume with an allowed change", "resume_allow_changes=[training.learning_rate]",
             k.allowed_change(("training.learning_rate=0.002", "resume_allow_changes=[training.learning_rate]"),
                              "training.learning_rate")),
        Case("folder", "resume a finished run", "results.json deleted, resume", k.finished_run_resumed),
        Case("damaged", "bytes flipped in model.safetensors", "64 bytes inverted, resume",
             k.damaged(lambda d: flip_bytes(latest_task(d) / "model.safetensors") or "model.safetensors", "error")),
        Case("damaged", "model.safetensors cut in half", "truncated, resume",
             k.damaged(lambda d: truncate(latest_task(d) / "model.safetensors") or "model.safetensors", "error")),
        Case("damaged", "tokenizer.json deleted", "resume",
             k.damaged(lambda d: (latest_task(d) / "tokenizer.json").unlink() or "tokenizer.json", "error")),
        Case("damaged", "compute.json deleted", "resume",
             k.damaged(lambda d: (latest_task(d) / "compute.json").unlink() or "compute.json", "error")),
        Case("damaged", "method state deleted", "method_state.json removed, resume",
             k.damaged(lambda d: next(latest_task(d).glob("method_state*.json")).unlink() or "method_state", "error")),
        Case("damaged", f"{state} not JSON", "garbage written, resume",
             k.damaged(lambda d: (latest_task(d) / state).write_text("{oops") and state, "error")),
        Case("damaged", "results.json deleted from the checkpoint", "resume",
             k.damaged(lambda d: (latest_task(d) / "results.json").unlink() or "results.json", "error")),
        Case("damaged", "Trainer checkpoint missing its optimizer", "optimizer.pt removed, resume",
             k.damaged(lambda d: (trainer_checkpoint(d) / "optimizer.pt").unlink(), "recovered")),
        Case("damaged", "bytes flipped in a Trainer checkpoint", "model.safetensors of the mid-task checkpoint, resume",
             k.damaged(lambda d: flip_bytes(trainer_checkpoint(d) / "model.safetensors"), "recovered")),
        Case("damaged", "newest task checkpoint deleted", "task-2 removed, resume",
             k.damaged(lambda d: shutil.rmtree(latest_task(d)), "recovered")),
        Case("damaged", "manifest deleted and weights damaged", "task-2 without checkpoint_manifest.json, resume",
             k.damaged(lambda d: (latest_task(d) / "checkpoint_manifest.json").unlink()
                       or flip_bytes(latest_task(d) / "model.safetensors"), "recovered")),
        Case("damaged", "a file placed in a task folder", "special_tokens_map.json with another pad token, resume",
             k.damaged(lambda d: (latest_task(d) / "special_tokens_map.json").write_text('{"pad_token": "!"}') and None,
                       "recovered")),
        Case("damaged", "a sharded-weights index placed in a task folder", "model.safetensors.index.json, resume",
             k.damaged(lambda d: (latest_task(d) / "model.safetensors.index.json").write_text("{}") and None,
                       "recovered")),
        Case("damaged", "hand-edited model card", "README.md edited, resume",
             k.damaged(lambda d: (latest_task(d) / "README.md").write_text("# my notes\n") and None, "recovered")),
        Case("folder", "overwrite while another run trains", "overwrite_output_dir=true during a run",
             k.concurrent_overwrite),
        Case("folder", "rerun after a run that failed in task 0", "run_config.yaml and an empty trainer/ left",
             k.leftover_of_failed_run),
        Case("folder", "links planted in the run folder", "compute.json, results.json, run_config.yaml -> outside",
             k.planted_link),
        Case("folder", "resume with another model family", "model.family=siglip",
             k.resumed_with_other_model("model.family=siglip", "model.config.projection_dim=32", names="family")),
        Case("folder", "resume with another model size", "model.config.hidden_size=64",
             k.resumed_with_other_model("model.config.hidden_size=64", "model.config.projection_dim=64",
                                        names="another size")),
        Case("damaged", "method tensors and manifest deleted", "method_state.safetensors and the manifest removed, resume",
             k.damaged(lambda d: (latest_task(d) / "method_state.safetensors").unlink()
                       or (latest_task(d) / "checkpoint_manifest.json").unlink(), "recovered")),
        Case("folder", "resume with another label space", "stream_args.label_space=all",
             k.changed_on_resume("stream_args.label_space=all", "label_space")),
        Case("folder", "resume with an allowed label-space change", "resume_allow_changes=[stream*]",
             k.allowed_change(("stream_args.label_space=all", "resume_allow_changes=[stream*]"), ".labels.",
                              card=True)),
        Case("interruption", "SIGTERM in the first task", "SIGTERM at step 3 (after a Trainer checkpoint), resume",
             k.sigterm_first_task),
        Case("processes", "two CPU processes, the README's command", "accelerate launch --multi_gpu "
             "--num_processes 2 recipes/train.py (no ACCELERATE_USE_CPU)", lambda tmp: k.two_cpu_processes(tmp)),
        Case("processes", "two CPU processes that would train alone", "the same with training.use_cpu=false",
             lambda tmp: k.two_cpu_processes(tmp, "training.use_cpu=false")),
        Case("cost", "the last partial batch of every epoch", "20 rows a task, batches of 16, 1 epoch",
             k.partial_batches),
        Case("bad input", "a checkpoint without its tokenizer", "model.pretrained=<a model-only save, 1,000 tokens>",
             k.pretrained_without_tokenizer),
        Case("late failure", "a diverging last update", "training.learning_rate=1e30, then resume with 0.001",
             k.diverged_then_sane),
        Case("late failure", "weight ensemble longer than a task", "methods=[zscl] (ensemble_every 100, 4 steps)",
             k.refused_before_training(("methods=[zscl]",), "ensemble_every")),
        Case("late failure", "one-step task with a fractional warmup", "training.max_steps=1 (warmup 0.1)",
             k.refused_before_training(("training.max_steps=1",), "warmup_steps")),
        Case("hub", "every push fails", "HTTP 500 on every write", k.hub({"fail_every": 1}, "failed")),
        Case("hub", "flaky Hub", "HTTP 500 on every 3rd write (retried)", k.hub({"fail_every": 3}, "pushed")),
        Case("hub", "reply lost after a commit", "every 4th write committed, then the connection dropped",
             k.hub({"lose_reply_every": 4}, "pushed")),
        Case("hub", "every 2nd reply lost", "every 2nd write committed, then the connection dropped",
             k.hub({"lose_reply_every": 2}, "pushed")),
        Case("hub", "Hub unreachable", "HF_ENDPOINT at a closed port", k.unreachable_hub),
        Case("hub", "damaged download", "a pushed blob's bytes changed on the server, resume from the Hub",
             k.hub_download_damaged),
    ]
    return cases + PYTHON_CASES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="run the cases whose group or name contains one of these (comma-separated)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "faults.md"))
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if options.child:
        sys.exit(child(options.child, [a for a in options.rest if a != "--"]))

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hf-ccl-faults-") as tmp_name:
        tmp = Path(tmp_name)
        faults = Faults(tmp)
        table = []
        for number, case in enumerate(build_cases(faults)):
            if options.only and not any(part in f"{case.group} {case.name}" for part in options.only.split(",")):
                continue
            case_dir = tmp / f"case-{number}"
            case_dir.mkdir()
            began = time.time()
            try:
                outcome = case.run(case_dir)
            except Exception as error:  # noqa: BLE001 (a broken case is reported, not fatal)
                outcome = Outcome("case failed", "-", f"{type(error).__name__}: {error}")
            print(f"[{time.time() - began:5.1f} s] {case.group:12} {case.name:48} {outcome.outcome}: {outcome.seen}",
                  flush=True)
            table.append((case, outcome))
            shutil.rmtree(case_dir, ignore_errors=True)
    write_table(Path(options.output), table, time.time() - started, " ".join(sys.argv[1:]))


def write_table(path: Path, table: list[tuple[Case, Outcome]], seconds: float, argv: str) -> None:
    counts: dict[str, int] = {}
    for _, outcome in table:
        counts[outcome.outcome] = counts.get(outcome.outcome, 0) + 1
    lines = [
        "# Faults and bad inputs through the CLI",
        "",
        f"`python benchmarks/faults.py {argv}`".replace(" `", "`"),
        f"({len(table)} cases, {seconds / 60:.1f} min; tiny random CLIP, 5 `digits` tasks x 4 steps, ER).",
        "",
        "Summary: " + ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ".",
        f"Goal: only {', '.join(GOOD)}.",
        "",
        "| group | case | fault or input | exit | outcome | what the user sees |",
        "|---|---|---|---|---|---|",
    ]
    for case, outcome in table:
        mark = outcome.outcome if outcome.outcome in GOOD else f"**{outcome.outcome}**"
        lines.append(f"| {case.group} | {case.name} | {short(case.fault, 80)} | {short(outcome.exit, 30)} | {mark} | "
                     f"{short(outcome.seen)} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
