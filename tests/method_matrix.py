"""The one matrix the tests that must hold for every method run over (accumulation, compile, mixed precision,
exact resume, bad options, two processes): every registered method, with the options that let it train in seconds
on a tiny CLIP, on the first tasks of the bundled `digits` stream (68 training examples each: a whole batch of 64
even when `patching` holds 4 out).

Everything per method is read from the method class itself (`ContinualMethod`'s test declarations, each from the
class's own body): `test_options` (its options for 64-example tasks), `test_stream` (methods that attach learner
heads run on a pair stream), `same_step_as`, `variant_of` and `test_families`. A new method is covered by every one of those
tests as soon as its file is in `hf_ccl/methods/`, with no edit here: with no declaration it trains on CLIP with its
default options, in every default check, as the representative of a step of its own (`tests/test_method_one_file.py`
proves it). `tests/scripts/` read the options too (`method_args`)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import ModelPart, build_stream, load_tokenizer
from hf_ccl.families import FAMILIES, default_image_processor
from hf_ccl.methods import METHODS as METHOD_CLASSES
from hf_ccl.methods import available_methods, build_methods
from hf_ccl.methods.base import ContinualMethod
from hf_ccl.testing import tiny_model


def declared(name: str, attribute: str) -> Any:
    """A test declaration of method `name` as its own class body sets it (a subclass is another method: its parent's
    declarations are not its own), else `ContinualMethod`'s default."""
    return vars(METHOD_CLASSES[name]).get(attribute, getattr(ContinualMethod, attribute))


METHODS = sorted(available_methods())
#: Each method's `test_options`: small buffers and queues, so that replay and momentum contrast engage on
#: 64-example tasks; MAS's importance pass on 8 examples of a task.
METHOD_ARGS: dict[str, dict[str, Any]] = {name: dict(declared(name, "test_options")) for name in METHODS
                                          if declared(name, "test_options")}
#: Methods that are another matrix method's class with another formula or alias (`variant_of`; TiC's names for the
#: same loop): their runs of the every-method matrices (resume, accumulation, compile, bf16) are marked `slow`, the
#: method named beside each runs by default; `pytest -m slow` runs them all. Bad-option and two-process checks cover
#: every method.
MATRIX_SIBLINGS = {name: declared(name, "variant_of") for name in METHODS if declared(name, "variant_of")}
#: Every method as a pytest parameter, the siblings marked `slow`.
MATRIX = [pytest.param(name, marks=pytest.mark.slow) if name in MATRIX_SIBLINGS else name for name in METHODS]
#: Methods whose training step is another method's (`same_step_as`: the same losses, hooks and state per step; they
#: differ in data, aliases, formulas or task-end work), with that method. The expensive every-method checks (two
#: processes, the compiled step, bf16, exact accumulation, the sync count) run every other method by default
#: (`REPRESENTATIVE`: one per step mechanism, and any new method) and these under `-m slow`.
SAME_STEP_AS = {name: declared(name, "same_step_as") for name in METHODS
                if declared(name, "same_step_as") not in (None, name)}
assert set(SAME_STEP_AS.values()) <= set(METHODS), f"same_step_as names an unknown method: {SAME_STEP_AS}"
assert set(MATRIX_SIBLINGS.values()) <= set(METHODS), f"variant_of names an unknown method: {MATRIX_SIBLINGS}"
REPRESENTATIVE = {name for name in METHODS if name not in SAME_STEP_AS}
#: Methods that never train the model (`trains_model=False`, RAIL): they have no training step for the step checks
#: (accumulation, compile, bf16, sync count) to run, which skip them with the reason; every other check runs them.
STEPLESS = {name for name in METHODS if not METHOD_CLASSES[name].trains_model}
#: Every method as a pytest parameter, those in `SAME_STEP_AS` marked `slow`, those in `STEPLESS` skipped.
REPRESENTATIVE_MATRIX = [
    pytest.param(name, marks=pytest.mark.skip(reason=f"{name} takes no training step")) if name in STEPLESS
    else name if name in REPRESENTATIVE else pytest.param(name, marks=pytest.mark.slow) for name in METHODS]
#: Methods that train pair tasks only (learner heads on cached features, found by what they attach): they run on a
#: pair stream, and so does any method tested beside them. Every other method runs on its `test_stream`.
PAIR_ONLY = {name for name in METHODS if METHOD_CLASSES[name].attaches is ModelPart.LEARNER_HEADS}
PAIR_STREAM = "flickr-fashion-pairs"
TEST_STREAMS = {name: PAIR_STREAM if name in PAIR_ONLY else declared(name, "test_stream") for name in METHODS}
#: The other families (CLIP runs `MATRIX`).
OTHER_FAMILIES = [family for family in FAMILIES if family != "clip"]
#: What each other family runs by default (everything else under `-m slow`): the methods that name it in
#: `test_families` (`finetune` on each, and every other `REPRESENTATIVE` step mechanism on one family, SigLIP (the
#: sigmoid loss) taking the distillation and replay ones).
FAMILY_DEFAULTS = {family: {name for name in METHODS if family in declared(name, "test_families")}
                   for family in OTHER_FAMILIES}
_unknown = {name: declared(name, "test_families") for name in METHODS
            if not set(declared(name, "test_families")) <= set(OTHER_FAMILIES)}
assert not _unknown, f"test_families names a family that is not one of {OTHER_FAMILIES}: {_unknown}"


#: (family, method) for every supported family and every method it does not refuse (`unsupported_methods`):
#: CLIP runs `MATRIX`; the other families `FAMILY_DEFAULTS` by default, everything else under `-m slow`.
FAMILY_MATRIX = [
    pytest.param("clip", name, id=f"clip-{name}", marks=pytest.mark.slow if name in MATRIX_SIBLINGS else ())
    for name in METHODS
] + [
    pytest.param(family, name, id=f"{family}-{name}",
                 marks=() if name in FAMILY_DEFAULTS[family] else pytest.mark.slow)
    for family in OTHER_FAMILIES for name in METHODS if name not in FAMILIES[family].unsupported_methods
]


def method_args(names: list[str] | tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """`METHOD_ARGS` of the methods in `names`, as `build_methods` takes them."""
    return {name: METHOD_ARGS[name] for name in names if name in METHOD_ARGS}


class LogRecorder(TrainerCallback):
    """Every `on_log` of every task, as (task number, logs)."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []
        self.task = -1

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self.task += 1

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        self.logs.append((self.task, dict(logs or {})))

    def first_step(self, task: int) -> dict[str, float]:
        """The logs of the first logged step of `task` (with `logging_steps=1`)."""
        return next(logs for number, logs in self.logs if number == task and "loss" in logs)


def tiny_stream(tasks: int = 2, train: int = 68, evaluate: int = 8, pairs: bool = False, name: str = "digits"):
    """The first `tasks` tasks of the bundled stream `name` (of `flickr-fashion-pairs` with `pairs`)."""
    stream = build_stream(PAIR_STREAM if pairs else name, max_train_per_task=train, max_eval_per_task=evaluate)
    stream.tasks = stream.tasks[:tasks]
    return stream


def task_stream(names: list[str] | tuple[str, ...], tasks: int = 2, train: int = 68, evaluate: int = 8):
    """The stream `names` are tested on: the one a method among them declares (`test_stream`, e.g. a pair stream
    for a method that trains pair tasks only), else `digits`."""
    declared_streams = sorted({TEST_STREAMS[name] for name in names if name in TEST_STREAMS} - {"digits"})
    assert len(declared_streams) <= 1, f"{names} declare different test streams: {declared_streams}"
    return tiny_stream(tasks, train, evaluate, name=declared_streams[0] if declared_streams else "digits")


def run_method(
    methods: str | list[str], output_dir: Path, training: dict[str, Any], *, tasks: int = 2, train: int = 68,
    seed: int = 1, callbacks: list[TrainerCallback] | None = None, family: str = "clip", **arguments: Any,
) -> ContinualLearner:
    """Fit `methods` (with `METHOD_ARGS`) on `tasks` tiny digits tasks of `train` training examples, on a tiny random
    model of `family`; returns the learner after `fit()`.
    `arguments` are `ContinualArguments` fields (no initial evaluation and no checkpoints unless given)."""
    names = [methods] if isinstance(methods, str) else list(methods)
    args = ContinualArguments(
        output_dir=str(output_dir), training={"logging_steps": 1, **training}, progress=False, seed=seed,
        **{"evaluation": {"initial": False}, "save_checkpoints": False, **arguments},
    )
    model = tiny_model(family, seed=seed)
    learner = ContinualLearner(
        model, task_stream(names, tasks, train), build_methods(names, method_args(names)),
        default_image_processor(model), load_tokenizer(), args, callbacks=callbacks,
    )
    learner.fit()
    return learner


def flat_state(value: Any, path: str = "") -> dict[str, Any]:
    """A method's `state_dict()` (nested dicts, lists and tuples of tensors and plain values) as {path: leaf}, with
    paths like `anchor/text_projection.weight` or `buffer/3`, so that two states compare leaf by leaf by path. Keys
    are read as strings and tuples as lists (what a JSON round trip through a checkpoint makes of them)."""
    if isinstance(value, dict):
        items, empty = [(str(key), item) for key, item in value.items()], "{}"
    elif isinstance(value, (list, tuple)):
        items, empty = [(str(index), item) for index, item in enumerate(value)], "[]"
    else:
        return {path: value}
    if not items:
        return {path: empty}
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(flat_state(item, f"{path}/{key}" if path else key))
    return flat


def state_digests(value: Any) -> dict[str, str]:
    """`flat_state(value)` with every leaf reduced to a sha256 (tensors: dtype, shape and bytes): equal digests are
    equal states, bit for bit."""
    digests = {}
    for path, leaf in flat_state(value).items():
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().cpu().contiguous()
            data = f"{tensor.dtype}{tuple(tensor.shape)}".encode() + tensor.view(-1).view(torch.uint8).numpy().tobytes()
        else:
            data = repr(leaf).encode()
        digests[path] = hashlib.sha256(data).hexdigest()
    return digests
