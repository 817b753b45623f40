"""What must hold for every registered method, run over the registry (`tests/method_matrix.py`): a method file added
to `hf_ccl/methods/` is tested here with no test edit.

- exact resume: 2 tiny tasks straight through, and the same run stopped after task 0 and resumed, end with the same
  parameters, method state and results matrix;
- bad options: an unknown option, and a value of the wrong type for any option (derived from the config dataclass's
  annotations), are one-line `ConfigError`s naming `method_args.<method>.<option>`.

Identical parameters on both ranks of a two-process run, for every method, is `tests/test_distributed.py` (one
launch runs every method in turn).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import shutil
import types
import typing
from collections import abc
from pathlib import Path
from typing import Any

import pytest
import torch
from method_matrix import FAMILY_MATRIX, METHODS, LogRecorder, flat_state, method_args, run_method
from transformers import AutoModel

from hf_ccl.families import family_class
from hf_ccl.methods import build_methods, get_method_class, load_method_states
from hf_ccl.testing import random_image_inputs
from hf_ccl.validation import ConfigError

# ----- exact resume -------------------------------------------------------------------------------------------------
#: Tasks of 32 examples, a budget of 2 steps of 16 per task (`oracle` needs a budget; the others take it as
#: max_steps). The end-of-task passes (importances, buffers, teacher caches) read the whole task.
RESUME_TRAINING = {"per_device_train_batch_size": 16, "learning_rate": 1e-3}
RESUME_ARGUMENTS = {"samples_per_task": 32, "save_checkpoints": True, "train": 32}
# The resumed run repeats the uninterrupted one's operations in the same order in one process, so they normally
# agree bit for bit; a float32 tolerance keeps the test about lost state, not about summation order.
RTOL, ATOL = 1e-5, 1e-6


#: Checks of the resume test that fail for a method: library bugs this test found (reported), with why. The test
#: fails when one of them passes, so that the entry goes with the fix; every other check still runs for the method.
KNOWN_RESUME_BUGS: dict[str, dict[str, str]] = {}


def assert_same_state(resumed: Any, expected: Any, what: str) -> None:
    """Two method states (or model state dicts) agree leaf by leaf: same paths, tensors of the same dtype and shape
    and close values, plain values equal (floats to RTOL)."""
    mine, theirs = flat_state(resumed), flat_state(expected)
    assert sorted(mine) == sorted(theirs), f"{what}: the resumed run's state has other entries"
    for path, value in theirs.items():
        other = mine[path]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor), f"{what} {path}: a tensor became {type(other).__name__}"
            assert (other.dtype, other.shape) == (value.dtype, value.shape), f"{what} {path}"
            torch.testing.assert_close(other, value, rtol=RTOL, atol=ATOL, msg=f"{what} {path}")
        elif isinstance(value, float) and not isinstance(other, bool):
            assert other == pytest.approx(value, rel=RTOL, abs=ATOL), f"{what} {path}"
        else:
            assert other == value, f"{what} {path}"


def assert_plain_class_matches(folder: Path, family: str, tokenizer: Any) -> None:
    """`folder` names the family's plain transformers class, loads with `AutoModel` as that class, and gives the
    image and text embeddings that the family's hf_ccl class loaded from it gives (padded as the family expects)."""
    cls = family_class(family)
    plain, ours = AutoModel.from_pretrained(folder), cls.from_pretrained(folder)
    assert type(plain).__name__ == cls.plain_architecture == json.loads((folder / "config.json").read_text())[
        "architectures"][0]
    tokens = tokenizer(["a photo of a seven", "ein Hund"], padding=ours.text_padding, max_length=16, truncation=True,
                       return_tensors="pt")
    inputs = ours.text_inputs(tokens["input_ids"], tokens["attention_mask"])
    images = random_image_inputs(ours)
    with torch.no_grad():
        torch.testing.assert_close(plain.get_text_features(**inputs).pooler_output,
                                   ours.embed_texts(**inputs, normalize=False), rtol=0, atol=0)
        torch.testing.assert_close(plain.get_image_features(**images).pooler_output,
                                   ours.embed_images(**images, normalize=False), rtol=0, atol=0)


def _results(learner) -> list[float]:
    """Every metric of every row, flat, in order (a pair task's row holds `drift` for earlier tasks only)."""
    return [m for row in learner.results.rows for task in row.metrics.values() for m in task.values()]


def _restored_state(method: str, checkpoint: Path) -> dict[str, Any]:
    """The state a fresh instance of `method` has after loading `checkpoint`'s method state (what a resumed run
    continues from; read back, so that both runs' states went through the same save and load)."""
    fresh = build_methods([method], method_args([method]))
    load_method_states(fresh, checkpoint)
    return fresh[0].state_dict()


def _same_tokenizer(one, other) -> bool:  # noqa: ANN001
    """Same vocabulary, merges and settings (the serialised backends; parsed only when the texts differ)."""
    first, second = one.backend_tokenizer.to_str(), other.backend_tokenizer.to_str()
    return first == second or json.loads(first) == json.loads(second)


@pytest.mark.parametrize(("family", "method"), FAMILY_MATRIX)
def test_every_method_resumes_exactly_after_a_task(tmp_path, family, method):
    """On every model family: the run resumed from task 0's checkpoint (in the same folder, as after a crash) trains
    task 1 only and ends where the uninterrupted run ends: the results matrix, the model (parameters and buffers),
    the tokenizer, and the method's state (anchors and importances, buffers, queues, teachers, adapters,
    vocabularies), as read back from each run's last checkpoint. Its last task checkpoint loads with the family's
    plain transformers class and gives the embeddings hf_ccl's class gives."""
    run = tmp_path / "run"
    full = run_method(method, run, RESUME_TRAINING, family=family, **RESUME_ARGUMENTS)
    run.rename(tmp_path / "full")
    shutil.copytree(tmp_path / "full" / "task-0", run / "task-0")  # as if stopped after task 0
    recorder = LogRecorder()
    resumed = run_method(method, run, RESUME_TRAINING, callbacks=[recorder], resume_from_checkpoint=True,
                         family=family, **RESUME_ARGUMENTS)
    assert recorder.task == 0, "the resumed run must train task 1 only"
    assert [row.label for row in resumed.results.rows] == [row.label for row in full.results.rows]
    assert [m.name for m in resumed.methods] == [m.name for m in full.methods] == [method]

    def results() -> None:
        torch.testing.assert_close(torch.tensor(_results(resumed)), torch.tensor(_results(full)), rtol=RTOL,
                                   atol=ATOL)

    def model() -> None:
        assert_same_state(resumed.model.state_dict(), full.model.state_dict(), "model")

    def tokenizer() -> None:
        assert _same_tokenizer(resumed.tokenizer, full.tokenizer), "the tokenizers differ"

    def state() -> None:
        assert_same_state(_restored_state(method, run / "task-1"),
                          _restored_state(method, tmp_path / "full" / "task-1"), f"{method} state")

    def plain_class() -> None:
        assert_plain_class_matches(run / "task-1", family, resumed.tokenizer)

    failed = {}
    for check in (results, model, tokenizer, state, plain_class):
        try:
            check()
        except AssertionError as error:
            failed[check.__name__] = error
    known = KNOWN_RESUME_BUGS.get(method, {})
    unexpected = [error for name, error in failed.items() if name not in known]
    if unexpected:
        raise unexpected[0]
    fixed = sorted(set(known) - set(failed))
    assert not fixed, f"{method}: {fixed} now resume(s) exactly: remove it from KNOWN_RESUME_BUGS"


# ----- bad options --------------------------------------------------------------------------------------------------
#: One value of each kind a YAML file or an override can give.
SAMPLES: dict[str, Any] = {
    "bool": True, "int": 7, "float": 2.5, "str": "text", "none": None, "list": ["text"], "mapping": {"key": "value"},
}
ANY_KIND = frozenset(SAMPLES)
NOT_A_CHOICE = "not-a-choice"


def accepted_kinds(annotation: Any) -> frozenset[str]:
    """The kinds of value (`SAMPLES` keys) an annotation takes; every kind for one that restricts nothing."""
    if annotation is Any or isinstance(annotation, typing.TypeVar):
        return ANY_KIND
    if annotation is type(None) or annotation is None:
        return frozenset({"none"})
    if annotation is bool:
        return frozenset({"bool"})
    if annotation is int:
        return frozenset({"int"})
    if annotation is float:
        return frozenset({"int", "float"})  # an integer is a number
    if annotation is str:
        return frozenset({"str"})
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return frozenset().union(*(accepted_kinds(type(member.value)) for member in annotation))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return frozenset().union(*(accepted_kinds(arg) for arg in args))
    if origin is typing.Literal:
        return frozenset().union(*(accepted_kinds(type(arg)) for arg in args))
    container = origin or annotation
    if container in (list, tuple, set, frozenset, abc.Sequence, abc.Iterable, abc.Collection):
        return frozenset({"list"})
    if container in (dict, abc.Mapping):
        return frozenset({"mapping"})
    return ANY_KIND  # an annotation this test cannot read: no value is known to be wrong


def wrong_values(annotation: Any) -> list[Any]:
    """Values of the wrong type for `annotation`: one of each kind it does not take, a string that is not one of
    its choices, and a list or mapping with one wrongly typed item."""
    kinds = accepted_kinds(annotation)
    values = [sample for kind, sample in SAMPLES.items() if kind not in kinds]
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    for member in members:
        origin, args = typing.get_origin(member), typing.get_args(member)
        choices = args if origin is typing.Literal else (
            [m.value for m in member] if isinstance(member, type) and issubclass(member, enum.Enum) else ())
        if choices and "str" in kinds and not any(accepted_kinds(m) == ANY_KIND or m is str for m in members):
            values.append(NOT_A_CHOICE)
        item = args[0] if origin in (list, set, frozenset) and args else None
        if item is not None and accepted_kinds(item) != ANY_KIND:
            values.append([next(s for k, s in SAMPLES.items() if k not in accepted_kinds(item))])
        if origin is dict and len(args) == 2 and accepted_kinds(args[1]) != ANY_KIND:
            values.append({"key": next(s for k, s in SAMPLES.items() if k not in accepted_kinds(args[1]))})
    return values


def refused(method: str, options: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        build_methods([method], {method: options})
    return caught.value


def test_wrong_values_are_derived_from_the_annotation():
    assert wrong_values(int) == [True, 2.5, "text", None, ["text"], {"key": "value"}]
    assert 7 not in wrong_values(float) and None not in wrong_values(float | None)
    assert wrong_values(list[str]) == [True, 7, 2.5, "text", None, {"key": "value"}, [True]]
    assert wrong_values(dict[str, str]) == [True, 7, 2.5, "text", None, ["text"], {"key": True}]
    assert NOT_A_CHOICE in wrong_values(typing.Literal["a", "b"]) and wrong_values(Any) == []
    assert "text" not in wrong_values(str | int) and {"key": "value"} in wrong_values(str | int)


@pytest.mark.parametrize("method", METHODS)
def test_every_option_of_every_method_refuses_a_wrong_type_in_one_line(method):
    config_class = get_method_class(method).config_class
    hints = typing.get_type_hints(config_class)
    checked = 0
    for field in dataclasses.fields(config_class):
        if not field.init:
            continue
        key = f"method_args.{method}.{field.name}"
        for value in wrong_values(hints[field.name]):
            error = refused(method, {field.name: value})
            message = str(error)
            assert key in message and "\n" not in message, (value, message)
            assert error.key is not None and error.key.startswith(key), (value, error.key)
            checked += 1
    assert checked or not dataclasses.fields(config_class)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_refuses_an_unknown_option_in_one_line(method):
    """A misspelt option is refused before anything is built, in one line listing the valid options."""
    config_class = get_method_class(method).config_class
    valid = [field.name for field in dataclasses.fields(config_class) if field.init]
    message = str(refused(method, {"no_such_option": 1}))
    assert "no_such_option" in message and method in message and "\n" not in message, message
    assert all(name in message for name in valid), f"the valid options are listed: {message}"


def test_an_unknown_option_is_named_by_its_key():
    for method in METHODS:
        error = refused(method, {"no_such_option": 1})
        assert f"method_args.{method}.no_such_option" in str(error), str(error)
