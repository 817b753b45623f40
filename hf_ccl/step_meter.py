"""What one process's training steps of a task did: the rows it batched, the multiply-accumulates (MACs) of its
optimizer steps and their wall time, measured (`StepMeter`, kept by `hf_ccl.trainer.ContinualTrainer`, read by
`hf_ccl.compute`)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

#: Batch entries whose first dimension is the batch's rows, in the order they are looked for.
ROW_KEYS = ("input_ids", "pixel_values", "features_a")


def batch_rows(batch: Mapping[str, Any]) -> int:
    """Examples in a collated batch (the first dimension of its inputs)."""
    for key in (*ROW_KEYS, *batch):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(f"cannot tell the rows of a batch with entries {sorted(batch)}")


def step_shape(chunks: Sequence[Mapping[str, Any]]) -> str:
    """The shapes of every tensor of every micro-batch of an optimizer step, as a key: steps with the same key do the
    same multiplications."""
    return ";".join(",".join(f"{key}:{'x'.join(map(str, value.shape))}" for key, value in sorted(chunk.items())
                             if isinstance(value, torch.Tensor)) for chunk in chunks)


class StepMeter:
    """Rows batched and MACs of the optimizer steps of one task on this process.

    `batch` counts every micro-batch the Trainer hands over. `step` wraps an optimizer step's forward and backward:
    the first step of each `step_shape` runs under `FlopCounterMode` (which counts the backward too), and so do the
    methods' hooks around its optimizer step (`hooks`); every later step of that shape counts the MACs the first one
    measured. The counts are this process's: `hf_ccl.compute` sums them over processes.

    Wall time per optimizer step (`step_seconds`): from the start of one step's forward to the start of the next's,
    so everything a step costs (loading and collating its batches, forward, backward, the methods' hooks, the
    optimizer) and nothing twice; a task of n steps has n - 1 such intervals (a resumed task: those of each launch).
    `median_step_seconds` is their median, robust to the occasional step that also logs or saves."""

    def __init__(self) -> None:
        self.samples = 0
        self.steps: dict[str, int] = {}
        self.macs_per_step: dict[str, float] = {}
        #: Steps trained before a resume that restored no counts (a checkpoint of an older version): not measured.
        self.unmeasured_steps = 0
        #: Shapes whose MACs are an estimate (a compiled model: `FlopCounterMode` would make dynamo run it eagerly).
        self.estimated: set[str] = set()
        self._measuring: str | None = None  # the shape whose first step is being measured
        #: Wall seconds from each optimizer step's start to the next's (this task, every launch of it).
        self.step_seconds: list[float] = []
        self._last_start: float | None = None  # perf_counter at the last step's start (this launch)

    def batch(self, batch: Mapping[str, Any]) -> None:
        self.samples += batch_rows(batch)

    @contextlib.contextmanager
    def step(self, chunks: Sequence[Mapping[str, Any]], estimate: Any = None) -> Iterator[None]:
        """Around one optimizer step's forward and backward over its micro-batches `chunks`. `estimate`: for a
        compiled model, a function of the chunks giving the step's MACs without running it (the step itself runs
        compiled, unmeasured; the shape is marked estimated)."""
        now = time.perf_counter()
        if self._last_start is not None:
            self.step_seconds.append(now - self._last_start)
        self._last_start = now
        key = step_shape(chunks)
        self.steps[key] = self.steps.get(key, 0) + 1
        self._measuring = None
        if key in self.macs_per_step:
            yield
            return
        if estimate is not None:
            yield
            self.macs_per_step[key] = float(estimate(chunks))
            self.estimated.add(key)
            return
        with self._counted(key):
            yield
        self._measuring = key

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Around the methods' work between backward and the next step (pre- and post-optimizer-step hooks): counted
        into the step being measured."""
        if self._measuring is None:
            yield
            return
        with self._counted(self._measuring):
            yield

    @contextlib.contextmanager
    def _counted(self, key: str) -> Iterator[None]:
        counter = FlopCounterMode(display=False)
        with counter:
            yield
        self.macs_per_step[key] = self.macs_per_step.get(key, 0.0) + counter.get_total_flops() / 2.0

    @property
    def macs(self) -> float:
        """MACs of this process's steps; steps that were not measured count at the mean of those that were."""
        measured = sum(count * self.macs_per_step.get(key, 0.0) for key, count in self.steps.items())
        steps = sum(self.steps.values())
        return measured + (self.unmeasured_steps * measured / steps if steps else 0.0)

    @property
    def measured(self) -> bool:
        """Whether every step's MACs were measured (none estimated, none from before a resume without counts)."""
        return not self.unmeasured_steps and not self.estimated

    @property
    def median_step_seconds(self) -> float | None:
        """Median wall seconds per optimizer step (None before two steps)."""
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "steps": dict(self.steps), "macs_per_step": dict(self.macs_per_step),
                "unmeasured_steps": self.unmeasured_steps, "estimated": sorted(self.estimated),
                "step_seconds": list(self.step_seconds)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.samples = int(state["samples"])
        self.steps = {str(key): int(value) for key, value in state["steps"].items()}
        self.macs_per_step = {str(key): float(value) for key, value in state["macs_per_step"].items()}
        self.unmeasured_steps = int(state.get("unmeasured_steps", 0))
        self.estimated = {str(key) for key in state.get("estimated", [])}
        self.step_seconds = [float(value) for value in state.get("step_seconds", [])]
