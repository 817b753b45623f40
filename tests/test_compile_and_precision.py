"""`torch_compile` and mixed precision for every method: every task runs compiled, methods see the model's own
parameter names, and bf16 autocast covers the methods' teachers and momentum models, not only the model. The
representative methods (one per step mechanism, `tests/method_matrix.py`) run by default, every method under
`-m slow`."""

from __future__ import annotations

import math

import pytest
import torch
from method_matrix import REPRESENTATIVE_MATRIX, LogRecorder, run_method
from transformers import TrainerCallback

#: Compiling through dynamo and AOTAutograd without code generation: the tracing (where wrapper prefixes and graph
#: breaks show) in seconds; inductor's C++ code generation costs minutes per model on a CPU (the `slow` test).
FAST_BACKEND = "aot_eager"


class CompiledEveryTask(TrainerCallback):
    """Records, per task, whether every training forward of the model ran inside a `torch.compile`d graph (a
    forward hook's `torch.compiler.is_compiling()`: True when traced, replayed as True by the compiled graph). The
    eval-mode forward that estimates a compiled step's MACs (`hf_ccl.step_meter`) is not a training forward."""

    def __init__(self) -> None:
        self.compiled: list[list[bool]] = []
        self._handle = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001 (callback protocol)
        self.compiled.append([])
        calls = self.compiled[-1]
        def record(module, _inputs, _outputs):  # noqa: ANN001 (training forwards only: not the MAC estimate's)
            if module.training:
                calls.append(torch.compiler.is_compiling())

        self._handle = model.register_forward_hook(record)

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self._handle.remove()

    def every_task_compiled(self) -> bool:
        return bool(self.compiled) and all(calls and all(calls) for calls in self.compiled)


class PrecisionProbe(TrainerCallback):
    """While a task trains, the dtypes of the outputs of every linear layer of the model and of each method's
    frozen models (attributes holding a `.model` module: teachers, momentum and previous-task models)."""

    def __init__(self, learner_methods: list) -> None:
        self.methods = learner_methods
        self.dtypes: dict[str, set[torch.dtype]] = {}
        self._handles: list = []

    def _watch(self, key: str, module: torch.nn.Module) -> None:
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear):
                self._handles.append(layer.register_forward_hook(
                    lambda _layer, _inputs, output, key=key: self.dtypes.setdefault(key, set()).add(output.dtype)))

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        self._watch("model", model)
        for method in self.methods:
            for name, value in vars(method).items():
                frozen = getattr(value, "model", None)
                if isinstance(frozen, torch.nn.Module) and frozen is not model:
                    self._watch(f"{method.name}.{name}", frozen)

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@pytest.mark.parametrize("method", REPRESENTATIVE_MATRIX)
def test_every_method_trains_compiled_on_every_task(tmp_path, method):
    """Two tasks, both compiled (on main only the first was, and CTP failed on `_orig_mod.`-prefixed names)."""
    watcher, recorder = CompiledEveryTask(), LogRecorder()
    training = {"per_device_train_batch_size": 16, "torch_compile": True, "torch_compile_backend": FAST_BACKEND}
    learner = run_method(method, tmp_path, training, samples_per_task=32, callbacks=[watcher, recorder])
    assert len(watcher.compiled) == 2 and watcher.every_task_compiled(), watcher.compiled
    assert learner.results.num_trained == 2
    assert all(math.isfinite(logs["loss"]) for _, logs in recorder.logs if "loss" in logs)
    assert not any("_orig_mod" in name for name, _ in learner.model.named_parameters())
    assert all(record.macs > 0 and not record.macs_measured for record in learner.compute)  # estimated, and said so


@pytest.mark.parametrize("method", REPRESENTATIVE_MATRIX)
def test_every_method_trains_in_bf16_teachers_included(tmp_path, method):
    """bf16 autocast (CPU) reaches the model and every frozen model a method runs while training."""
    from hf_ccl import continual

    probes: list[PrecisionProbe] = []
    build = continual.ContinualLearner.__init__

    def recording_init(self, *args, **kwargs):  # the probe needs the learner's method objects
        build(self, *args, **kwargs)
        probes.append(PrecisionProbe(self.methods))
        self.callbacks.append(probes[-1])

    training = {"per_device_train_batch_size": 16, "bf16": True, "use_cpu": True}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(continual.ContinualLearner, "__init__", recording_init)
        learner = run_method(method, tmp_path, training, samples_per_task=32)
    dtypes = probes[0].dtypes
    assert dtypes.pop("model") == {torch.bfloat16}
    for key, seen in dtypes.items():
        assert seen == {torch.bfloat16}, f"{key} ran in {seen}"
    frozen = {key.split(".", 1)[1] for key in dtypes}
    expected = {"modx": {"teacher"}, "lwf": {"teacher"}, "cllclip": {"teacher"},
                "ctp": {"reference", "momentum_model"}}.get(method, set())
    assert expected <= frozen, f"{method}: no forward of {expected - frozen} was seen"
    assert learner.results.num_trained == 2


def test_compiled_bf16_accumulated_ctp_matches_its_eager_float32_run_closely(tmp_path):
    """The three knobs compose: CTP (momentum model, queues, previous model) compiled, in bf16, with 16 x 2
    accumulation ends near the plain run (bf16 rounding: loose tolerance) and logs the same terms."""
    base = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "learning_rate": 0.1, "optim": "sgd",
            "weight_decay": 0.0}  # SGD: Adam would turn float noise in exactly-zero gradients into full-size steps
    plain_logs, mixed_logs = LogRecorder(), LogRecorder()
    plain = run_method("ctp", tmp_path / "plain", base, samples_per_task=64, callbacks=[plain_logs])
    mixed = run_method("ctp", tmp_path / "mixed", {**base, "bf16": True, "use_cpu": True, "torch_compile": True,
                                                     "torch_compile_backend": FAST_BACKEND},
                       samples_per_task=64, callbacks=[mixed_logs])
    for task in (0, 1):
        mine, theirs = mixed_logs.first_step(task), plain_logs.first_step(task)
        assert {k for k in mine if k.startswith("loss")} == {k for k in theirs if k.startswith("loss")}
        for key in (k for k in theirs if k.startswith("loss")):
            assert mine[key] == pytest.approx(theirs[key], rel=0.05), key
    for (name, mine), theirs in zip(mixed.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0.05, atol=5e-3, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["finetune", "ctp", "ewc"])
def test_inductor_compiled_run_matches_eager(tmp_path, method):
    """The default backend (inductor, C++ code generation): minutes per model on a CPU. SGD, because Adam turns the
    float noise of gradients that are exactly 0 in theory (the attention key bias) into full-size steps."""
    training = {"per_device_train_batch_size": 16, "learning_rate": 0.1, "optim": "sgd", "weight_decay": 0.0}
    eager = run_method(method, tmp_path / "eager", training, samples_per_task=32)
    watcher = CompiledEveryTask()
    compiled = run_method(method, tmp_path / "compiled", {**training, "torch_compile": True}, samples_per_task=32,
                          callbacks=[watcher])
    assert len(watcher.compiled) == 2 and watcher.every_task_compiled(), watcher.compiled
    for (name, mine), theirs in zip(compiled.model.named_parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-4, msg=name)
