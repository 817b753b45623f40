"""No host synchronisation in the training step (issue 14): one optimizer step of every registered method, between
two logging steps, makes no call that would make the host wait for a GPU, but for the syncs a method's maths needs
(`EXPECTED`, each with its reason), so that a new sync fails the test.

On a CPU machine nothing really synchronises, so `SyncCounter` counts the calls that WOULD synchronise on a GPU:
read-backs (`.item()`, `if tensor:`, `float(tensor)`, `.tolist()`, `.cpu()`, ...), results whose shape depends on
the data (`nonzero`, a boolean-mask index, `unique`, ...), the `torch.linalg` functions that check their result on
the host, and blocking copies of host data to the device. `test_cuda_step_does_not_synchronize` runs the step under
`torch.cuda.set_sync_debug_mode("error")` where a GPU is present.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import method_matrix
import pytest
import torch
from method_matrix import MATRIX, METHOD_CLASSES, REPRESENTATIVE_MATRIX, STEPLESS, run_method
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

#: Reading a tensor's value on the host (the host waits for every kernel queued before it).
READ_BACK = {"item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__", "__complex__",
             "__format__", "__repr__", "__str__", "__contains__", "equal", "allclose", "cpu"}
#: Results whose shape depends on the data: the host reads the size before it can allocate them.
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
#: `torch.linalg` (and legacy) functions that check their result's error codes on the host on a GPU (their `_ex`
#: variants do not): PyTorch's docs say "synchronizes that device with the CPU" for each.
CHECKED_LINALG = {"linalg_svd", "linalg_svdvals", "linalg_eig", "linalg_eigvals", "linalg_eigh", "linalg_eigvalsh",
                  "linalg_cholesky", "linalg_inv", "linalg_solve", "linalg_lstsq", "linalg_matrix_rank", "linalg_pinv",
                  "linalg_lu_factor", "linalg_lu", "linalg_ldl_factor", "linalg_cond", "linalg_tensorinv",
                  "linalg_tensorsolve", "svd", "cholesky", "inverse", "pinverse", "lstsq"}
#: Functions that make a tensor from Python values or sizes (on the host unless given a device).
FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "full", "empty", "eye", "arange", "linspace",
             "rand", "randn", "randint", "randperm"}
_TORCH_WRAPPERS = tuple(f"{os.sep}torch{os.sep}{name}" for name in ("_tensor.py", "overrides.py", "functional.py", "_jit_internal.py"))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _is_mask(index: Any) -> bool:
    if isinstance(index, tuple):
        return any(_is_mask(item) for item in index)
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _destination(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Where `cpu()`, `to(...)` or a factory puts its result: "host" (`cpu()`, a device spelled "cpu"), "device" (a
    `torch.device` object: on a CPU machine it cannot be told from the training device, so it is taken as that;
    another string), or None (`to(dtype)`, a factory without a device: where the input is, or the host)."""
    if name == "cpu":
        return "host"
    candidates = [*args[1:], kwargs.get("device")] if name == "to" else [kwargs.get("device")]
    for item in candidates:
        if isinstance(item, str):
            return "host" if item.split(":")[0] == "cpu" else "device"
        if isinstance(item, torch.device):
            return "device"
    return None


def sync_kind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], on_device: bool,
              destination: str | None) -> str | None:
    """Why calling torch function `name` would synchronise the host with a GPU, or None. `on_device`: some of its
    tensors are on the GPU; `destination`: where a move or a factory puts its result (`_destination`)."""
    if name in ("tensor", "as_tensor") and destination == "device" and not on_device:
        return f"{name}(device=...)"  # a blocking copy of host data to the GPU
    if name == "to" and destination == "device" and not on_device and kwargs.get("non_blocking") is not True:
        return "to(device), blocking"
    if not on_device:
        return None
    if name in READ_BACK or name in DATA_DEPENDENT or name in CHECKED_LINALG:
        return name
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where(condition)"
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    if name == "repeat_interleave" and isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1 and _is_mask(args[1]):
        return f"{name}[mask]"
    if name == "to" and destination == "host":
        return "to(cpu)"
    if name in ("tensor", "as_tensor") and args and any(True for _ in _tensors(args[0])):
        return f"{name}(tensors)"
    return None


def _caller() -> str:
    """`path:line` of the first frame outside `SyncCounter` and torch's Python wrappers."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(_TORCH_WRAPPERS):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in (f"site-packages{os.sep}", f"{Path(__file__).resolve().parents[1]}{os.sep}"):
        path = path.split(marker)[-1]
    return f"{path}:{frame.f_lineno}"


class SyncCounter(TorchFunctionMode):
    """Records every call that would synchronise the host with a GPU, as (kind, `path:line` of the caller).

    Tensors that existed before the counter started (the model, the batch, the methods' state) are taken as on the
    GPU. Tensors made on the host while it runs (`cpu()`, a factory without a device, an op on host tensors only)
    are followed, so that reading a host copy again is not counted (GEM solves its QP on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.seen = 0  #: torch calls seen, syncing or not
        self._host: set[int] = set()

    def _mark_host(self, result: Any) -> None:
        for tensor in _tensors(result):
            if id(tensor) not in self._host:
                self._host.add(id(tensor))
                weakref.finalize(tensor, self._host.discard, id(tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch protocol)
        kwargs = kwargs or {}
        self.seen += 1
        name = getattr(func, "__name__", "")
        inputs = list(_tensors((args, kwargs)))
        on_device = any(id(tensor) not in self._host for tensor in inputs)
        destination = _destination(name, args, kwargs) if name in ("to", "cpu") or not inputs else None
        kind = sync_kind(name, args, kwargs, on_device, destination)
        if kind is not None:
            self.calls.append((kind, _caller()))
        result = func(*args, **kwargs)
        if destination == "host" or (destination is None and (inputs and not on_device or name in FACTORIES)):
            self._mark_host(result)
        return result

    def by_site(self, ignore: dict[str, str] | None = None) -> Counter[tuple[str, str]]:
        """{(kind, caller): count}, without the callers whose path ends with a key of `ignore`."""
        return Counter(call for call in self.calls
                       if not any(call[1].split(":")[0].endswith(suffix) for suffix in (ignore or {})))


# ----- the counter counts what it must (so that the step test cannot pass vacuously) ------------------------------
_t, _s, _m = torch.arange(4.0), torch.tensor(2.0), torch.tensor([True, False, True, False])
_i, _repeats, _spd = torch.tensor(1), torch.tensor([1, 2, 1, 0]), torch.eye(3) * 2
SYNCING: dict[str, Callable[[], Any]] = {
    "item": lambda: _s.item(), "if tensor": lambda: 1 if _s else 0, "float()": lambda: float(_s),
    "int()": lambda: int(_s), "index": lambda: [0, 1, 2][_i], "tolist": lambda: _t.tolist(), "numpy": lambda: _t.numpy(),
    "cpu": lambda: _t.cpu(), "to('cpu')": lambda: _t.to("cpu"), "to(device='cpu')": lambda: _t.to(device="cpu"),
    "nonzero": lambda: _m.nonzero(), "torch.nonzero": lambda: torch.nonzero(_m), "argwhere": lambda: torch.argwhere(_m),
    "where(cond)": lambda: torch.where(_m), "mask index": lambda: _t[_m],
    "mask assign": lambda: _t.clone().__setitem__(_m, 0.0), "masked_select": lambda: _t.masked_select(_m),
    "unique": lambda: torch.unique(_t), "bincount": lambda: _repeats.bincount(), "equal": lambda: torch.equal(_t, _t),
    "allclose": lambda: torch.allclose(_t, _t), "f-string": lambda: f"{_s:.3f}", "in": lambda: 2.0 in _t,
    "comparison": lambda: _s > 1 and 1, "max(float, tensor)": lambda: max(0.0, _s),
    "repeat_interleave": lambda: torch.repeat_interleave(_t, _repeats), "torch.tensor(tensors)": lambda: torch.tensor([_s]),
    "linalg.svd": lambda: torch.linalg.svd(_spd), "linalg.eigh": lambda: torch.linalg.eigh(_spd),
    "linalg.solve": lambda: torch.linalg.solve(_spd, _t[:3]), "linalg.cholesky": lambda: torch.linalg.cholesky(_spd),
    "linalg.inv": lambda: torch.linalg.inv(_spd), "linalg.svdvals": lambda: torch.linalg.svdvals(_spd),
    "tensor(device=)": lambda: torch.tensor([1.0], device=_t.device),
    "host tensor to(device)": lambda: torch.ones(2, dtype=torch.float64).to(_t.device),
}
NOT_SYNCING: dict[str, Callable[[], Any]] = {
    "arithmetic": lambda: (_t * 2 + _s).sum().sqrt(), "isfinite": lambda: torch.isfinite(_t).all(),
    "where(c, a, b)": lambda: torch.where(_m, _t, 0.0), "where(c, int, t)": lambda: torch.where(_m, 3, _t),
    "long index": lambda: _t[_repeats], "slice": lambda: _t[1:3], "to(dtype)": lambda: _t.to(torch.float16),
    "to(device)": lambda: _t.to(_t.device), "masked_fill": lambda: _t.masked_fill(_m, 0.0),
    "vector_norm": lambda: torch.linalg.vector_norm(_t), "qr": lambda: torch.linalg.qr(_spd),
    "cholesky_ex": lambda: torch.linalg.cholesky_ex(_spd), "repeat_interleave(int)": lambda: _t.repeat_interleave(2),
    "shape": lambda: _t.shape[0] + len(_t), "full(device=)": lambda: torch.full((), -1, device=_t.device),
    "host copy read back": lambda: _t.cpu().double().sum().item(),  # one sync: the cpu(); counted in SYNCING
    "host-made tensor": lambda: float(torch.eye(3, dtype=torch.float64).sum()),
    "to(device, non_blocking)": lambda: torch.ones(2).to(_t.device, non_blocking=True),
}


@pytest.mark.parametrize("name", SYNCING)
def test_counter_sees_each_syncing_call(name):
    with SyncCounter() as counter:
        SYNCING[name]()
    assert len(counter.calls) == 1, (name, counter.calls)
    assert counter.calls[0][1].startswith(f"tests{os.sep}{Path(__file__).name}:"), counter.calls  # the caller


def test_counter_ignores_calls_that_stay_on_the_device():
    for name, call in NOT_SYNCING.items():
        with SyncCounter() as counter:
            call()
        expected = [("cpu", counter.calls[0][1])] if name == "host copy read back" else []
        assert counter.calls == expected, (name, counter.calls)


# ----- one training step of every method ---------------------------------------------------------------------------
#: Syncs outside hf_ccl that hf_ccl cannot avoid, by file: {path suffix: why}. They are left out of the counts.
EXTERNAL = {
    f"transformers{os.sep}masking_utils.py": "transformers' SDPA attention reads whether the text padding mask is all "
    "ones (`_ignore_causal_mask_sdpa`: `padding_mask.sum() == numel` read on the host) to use SDPA's is_causal "
    "shortcut; once per text forward (eager attention does not)",
}
#: Syncs of one step that a method's maths needs, by method (every other method: 0), with the reason.
EXPECTED: dict[str, tuple[int, str]] = {
    "gem": (13, "GEM decides and solves on the host: whether g and the memory gradients are finite (2), how many "
                "constraints are violated (1); when one is, GGᵀ and Gg are copied to the host (2) for the dual QP, "
                "whose solution goes back to the device (3: v and its bounds), and the gradient change and the dual "
                "maximum are read for the metrics (2 + 1); the memory batch drops padding columns no row attends "
                "to (1)"),
    "agem": (2, "A-GEM's projection test gᵀg_ref < 0 (one read of the 2x2 Gram matrix) and its memory batch, which "
                "drops padding columns no row attends to (1)"),
    "cllclip": (3, "the frozen teacher's embedding cache is a host dict keyed by the batch's caption and image "
                   "hashes, read back once per tower (2), and the rows it has not cached yet are copied to the "
                   "device (1)"),
    "si": (1, "SI's path integral over the token embedding keeps only the rows this step's gradient touches "
              "(`nonzero_rows`: a data-dependent size) instead of a dense copy of every row per step"),
}
STEP = 2  #: the counted optimizer step of the second task: not the first, and no log (logging_steps 10)
TRAINING = {"max_steps": 2, "per_device_train_batch_size": 16, "logging_steps": 10}


class _StepWatch(TrainerCallback):
    """Runs `make()` (a context manager) around optimizer step `STEP` of the second task."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.task, self.active, self.counted = make, -1, None, []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self.task += 1

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.task == 1 and state.global_step == STEP - 1:
            assert STEP % args.logging_steps != 0 and not args.logging_first_step  # a step between two logs
            self.active = self.make()
            self.active.__enter__()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.active is not None:
            self.active.__exit__(None, None, None)
            self.counted.append((self.active, state.global_step))
            self.active = None


def _fit(name: str, output_dir: Path, watch: _StepWatch) -> None:
    if METHOD_CLASSES[name].needs_compute_budget:  # 2 steps of 16 examples (the budget sets max_steps)
        training = {key: value for key, value in TRAINING.items() if key != "max_steps"}
        run_method(name, output_dir, training, callbacks=[watch], samples_per_task=32)
    else:
        run_method(name, output_dir, TRAINING, callbacks=[watch])


@pytest.mark.parametrize("name", REPRESENTATIVE_MATRIX)
def test_training_step_does_not_synchronize(name, tmp_path):
    watch = _StepWatch(SyncCounter)
    _fit(name, tmp_path, watch)
    assert len(watch.counted) == 1 and watch.counted[0][1] == STEP, watch.counted
    counter = watch.counted[0][0]
    assert counter.seen > 100, "the counter saw no training step"
    sites = counter.by_site(EXTERNAL)
    expected = EXPECTED.get(name, (0, ""))[0]
    assert sum(sites.values()) == expected, f"{name}: {sum(sites.values())} syncs, expected {expected}: {dict(sites)}"


@pytest.mark.parametrize("name", ["finetune", "er"])
def test_cross_entropy_step_does_not_synchronize(name, tmp_path):
    """The class-prompt cross-entropy (its prompts copied to the device once, its row labels from the collator): a
    step with replay rows of the earlier task too."""
    watch = _StepWatch(SyncCounter)
    run_method(name, tmp_path, TRAINING, callbacks=[watch], classification_loss="cross_entropy")
    assert len(watch.counted) == 1 and watch.counted[0][0].seen > 100
    sites = watch.counted[0][0].by_site(EXTERNAL)
    assert sum(sites.values()) == 0, dict(sites)


def test_expected_syncs_name_registered_methods():
    assert set(EXPECTED) <= set(METHOD_CLASSES) and all(reason for _, reason in EXPECTED.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [name for name in MATRIX
                                  if getattr(name, "values", [name])[0] not in {*EXPECTED, *STEPLESS}])
def test_cuda_step_does_not_synchronize(name, tmp_path, monkeypatch):
    """The same step on a GPU with torch's sync debugging set to raise: any synchronising call fails the step
    (eager attention, without transformers' SDPA mask check: `EXTERNAL`)."""

    def eager_tiny_model(*args: Any, **kwargs: Any) -> Any:
        model = tiny_model(*args, **kwargs)
        model.set_attn_implementation("eager")
        return model

    class _SyncDebug:
        def __enter__(self) -> None:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc: object) -> None:
            torch.cuda.set_sync_debug_mode("default")

    tiny_model = method_matrix.tiny_model
    monkeypatch.setattr(method_matrix, "tiny_model", eager_tiny_model)
    watch = _StepWatch(_SyncDebug)
    try:
        _fit(name, tmp_path, watch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(watch.counted) == 1 and watch.counted[0][1] == STEP
