"""TiC-CLIP's replay strategies: Cumulative-All, Cumulative-Exp and Cumulative-Equal (Garg et al., ICLR 2024, §3 II,
Tab. 1, App. D.3; specs/ticclip.md §2.2 rules 2-4, §2.3 and §7 items 7-10).

Each warm-started step t trains on the new data D_t together with a buffer of old steps' data, shuffled together
(the Trainer's uniform sampler over the concatenation, as `replay.py` does: no per-batch ratio, no reweighting,
App. E.2). What the buffer keeps of an old step j is a *prefix* of a fixed seeded permutation pi_j of D_j, drawn
when D_j arrives, so smaller shares are prefixes of larger ones and the retained sets shrink monotonically, as real
storage with deletion would (§2.3, §7 item 8). With B_t the buffer capacity at step t (default |D_t|, §7 item 7):

    n_j(t) = min(formula_j(t), n_j(t-1), |D_j|)           (n_j(j) is unbounded: step j is new at step j)
    -All:   formula_j(t) = |D_j|
    -Exp:   formula_j(t) = floor(B_t / 2^(t-j)) for j >= 2,   formula_1(t) = floor(B_t / 2^(t-2))
    -Equal: formula_j(t) = floor(B_t / (t-1))

Rounding is **floor**, computed exactly in integers (so sum_j n_j(t) <= B_t: "at most 2D"); shares that hit a cap
are not redistributed. `buffer_sizes` is the pure function; `CumulativePool` builds the training pool from it.

**Streaming** (a task's `train` is a `datasets.IterableDataset`): the pool is `datasets.interleave_datasets([D_t,
old_1, ..., old_{t-1}], probabilities, seed, stopping_strategy="all_exhausted")`, where `old_j` is the step's
stream after a seeded `.shuffle(seed=pi_j's seed, buffer_size=shuffle_buffer_size)` and `.take(n_j)` - pinned to
epoch 0, so the Trainer's `set_epoch` does not draw a different subset at every pass (the retained set stays
fixed). The probabilities are proportional to the sizes (|D_t|, n_1, ..., n_{t-1}), which makes the interleaving
as uniform over examples as the map-style concatenation; a stream's size is `len()` when it has one, else the
configured `stream_sizes[j]`. When any of these sizes is unknown the sources get **equal shares** (1/t each).
-Exp/-Equal need the capacity B_t to be known (the current step's size, `stream_sizes`, or an integer
`capacity`); -All with an unknown |D_j| keeps the whole stream of step j. A map-style step mixed into a streaming
pool keeps its exact prefix (`select`), then becomes an iterable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from datasets import Dataset, IterableDataset, concatenate_datasets, interleave_datasets

from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method

RULES = ("all", "exp", "equal")
CAPACITIES = ("current", "mean")
#: Stand-in for an unknown step size where it only caps a share (-Exp/-Equal on a stream without `stream_sizes`).
_UNBOUNDED = 2**62


# ----------------------------------------------------------------------------------------------------------------
# The allocation rule (pure)
# ----------------------------------------------------------------------------------------------------------------
def _capacity_parts(step_sizes: Sequence[int], t: int, capacity: str | int) -> tuple[int, int]:
    """B_t as an exact fraction (numerator, denominator): |D_t|, the mean of |D_1..D_t|, or a fixed integer."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, str)):
        raise ValueError(f"capacity must be 'current', 'mean' or a positive integer, got {capacity!r}")
    if isinstance(capacity, int):
        if capacity <= 0:
            raise ValueError(f"An integer capacity must be > 0, got {capacity}")
        return capacity, 1
    if capacity == "current":
        return int(step_sizes[t - 1]), 1
    if capacity == "mean":  # the steps seen so far: no future step is read
        return sum(int(n) for n in step_sizes[:t]), t
    raise ValueError(f"capacity must be one of {list(CAPACITIES)} or a positive integer, got {capacity!r}")


def buffer_formula(step_sizes: Sequence[int], t: int, j: int, rule: str, capacity: str | int = "current") -> int:
    """formula_j(t) of the module docstring (before the caps), for old step j < t (both 1-based), floored."""
    if rule == "all":
        return int(step_sizes[j - 1])
    numerator, denominator = _capacity_parts(step_sizes, t, capacity)
    if rule == "exp":
        denominator *= 2 ** (t - max(j, 2))  # steps 1 and 2 share equally: B/2^(t-2) each
    elif rule == "equal":
        denominator *= t - 1
    else:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    return numerator // denominator


def buffer_sizes(step_sizes: Sequence[int], t: int, rule: str, capacity: str | int = "current") -> list[int]:
    """How many examples of each old step j = 1..t-1 the buffer holds at step t (1-based; element j-1 is n_j(t)).

    `step_sizes[j-1]` is |D_j| (at least t entries). `rule` is "all", "exp" or "equal"; `capacity` is "current"
    (B_t = |D_t|, specs/ticclip.md §7 item 7), "mean" (B_t = floor of the mean of |D_1..D_t|, which reproduces the
    idealised 3.5x of §2.3 for equal steps) or a fixed integer. Rounding is floor; the recursion
    n_j(t) = min(formula_j(t), n_j(t-1), |D_j|) runs from t' = 2 up to t, so n_j never grows over t.
    For example, 5 steps of 800 under "exp": t=5 gives [100, 100, 200, 400] (B/8, B/8, B/4, B/2).
    """
    if not 1 <= t <= len(step_sizes):
        raise ValueError(f"t must be in 1..{len(step_sizes)} (the number of step sizes given), got {t}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    if any(int(n) < 0 for n in step_sizes):
        raise ValueError(f"Step sizes must be >= 0, got {list(step_sizes)}")
    sizes: list[int] = []
    for now in range(2, t + 1):
        previous = sizes + [_UNBOUNDED]  # the step that just became old has no earlier share
        sizes = [
            min(buffer_formula(step_sizes, now, j, rule, capacity), previous[j - 1], int(step_sizes[j - 1]))
            for j in range(1, now)
        ]
    return sizes


# ----------------------------------------------------------------------------------------------------------------
# Building the pool
# ----------------------------------------------------------------------------------------------------------------
def permutation_seed(*entropy: int) -> int:
    """A 32-bit seed from several integers (NumPy's SeedSequence): the seed of a step's permutation pi_j."""
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1)[0])


def retained_rows(dataset: Dataset, count: int, seed: int) -> Dataset:
    """The prefix pi[:count] of the seeded permutation pi of `dataset`'s rows (in row order; the Trainer shuffles)."""
    if count >= len(dataset):
        return dataset
    order = np.random.default_rng(seed).permutation(len(dataset))
    return dataset.select(np.sort(order[:count]).tolist())


def _rows(dataset: IterableDataset) -> Any:
    """Every row of `dataset` at its current (epoch-0) state: the generator of a pinned stream."""
    yield from dataset


def retained_stream(dataset: IterableDataset, count: int | None, seed: int, buffer_size: int) -> IterableDataset:
    """The first `count` rows of `dataset` after a seeded buffer shuffle (all rows for None), pinned to epoch 0.

    `IterableDataset.shuffle` reseeds itself with the epoch the Trainer sets, which would retain a different subset
    at every pass; wrapping the epoch-0 stream in `from_generator` keeps the retained rows fixed. A smaller `count`
    with the same seed is a prefix of a larger one (storage-faithful nesting, specs/ticclip.md §2.3).
    """
    if count is None:
        return dataset
    kept = dataset.shuffle(seed=seed, buffer_size=buffer_size).take(count)
    return IterableDataset.from_generator(_rows, gen_kwargs={"dataset": kept}, features=dataset.features)


def mix_pool(parts: Sequence[Dataset | IterableDataset], weights: Sequence[int | None], seed: int) -> Any:
    """The training pool: map-style parts concatenated (the Trainer shuffles them together uniformly); with any
    stream, every part interleaved with probabilities proportional to `weights` (equal shares if one is None)."""
    if len(parts) == 1:
        return parts[0]
    if not any(isinstance(part, IterableDataset) for part in parts):
        return concatenate_datasets(list(parts))
    streams = [part if isinstance(part, IterableDataset) else part.to_iterable_dataset() for part in parts]
    given = [w for w in weights if w is not None]
    if len(given) < len(weights) or sum(given) <= 0:
        probabilities = [1.0 / len(streams)] * len(streams)
    else:
        total = float(sum(given))
        probabilities = [w / total for w in given]
    return interleave_datasets(streams, probabilities=probabilities, seed=seed, stopping_strategy="all_exhausted")


def dataset_size(dataset: Dataset | IterableDataset, stream_sizes: Sequence[int] | None, index: int) -> int | None:
    """|D| of a task's train split: `len()` for a map-style dataset, else `stream_sizes[index]`, else None."""
    if isinstance(dataset, Dataset):
        return len(dataset)
    if stream_sizes is not None and index < len(stream_sizes):
        return int(stream_sizes[index])
    return None


class CumulativePool:
    """What a step trains on under one TiC-CLIP allocation rule: D_t plus the retained prefixes of old steps.

    State (`state_dict`): each step's permutation seed (drawn from the method seed, the run seed and the step when
    the step first trains), each step's size, and the buffer sizes n_j chosen at every step, so that a resumed run
    builds the same pool.
    """

    def __init__(
        self,
        rule: str,
        capacity: str | int = "current",
        seed: int = 0,
        stream_sizes: Sequence[int] | None = None,
        shuffle_buffer_size: int = 10_000,
    ):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
        _capacity_parts([1], 1, capacity)  # validates
        self.rule, self.capacity, self.seed = rule, capacity, int(seed)
        self.stream_sizes = None if stream_sizes is None else [int(n) for n in stream_sizes]
        self.shuffle_buffer_size = int(shuffle_buffer_size)
        self.permutation_seeds: dict[int, int] = {}  # task index (0-based) -> seed of pi_j
        self.step_sizes: dict[int, int | None] = {}  # task index -> |D_j| (None: an unsized stream)
        self.history: dict[int, list[int | None]] = {}  # task index t -> [n_j(t) for j < t] (None: whole stream)

    # ----- bookkeeping ------------------------------------------------------------------------------------------
    def register_steps(self, context: TaskContext) -> None:
        """Fix the permutation seed and size of every step up to this one that has none yet."""
        run_seed = context.seed - context.task_index  # ContinualLearner: task k trains with seed + k
        for index in range(context.task_index + 1):
            if index not in self.permutation_seeds:
                self.permutation_seeds[index] = permutation_seed(self.seed, run_seed, index)
            if index not in self.step_sizes:
                train = context.stream.tasks[index].train
                self.step_sizes[index] = dataset_size(train, self.stream_sizes, index)

    def sizes_at(self, task_index: int) -> list[int | None]:
        """n_j at task `task_index` (0-based) for every older task j (None: keep the whole, unsized stream)."""
        if task_index == 0:
            return []
        step = task_index + 1
        known = [self.step_sizes[j] for j in range(step)]
        if self.rule == "all":
            return known[:task_index]
        needs_current = self.capacity == "current" and known[task_index] is None
        needs_all = self.capacity == "mean" and None in known
        if needs_current or needs_all:
            raise ValueError(
                f"Cumulative-{self.rule.capitalize()} needs the buffer capacity at task {task_index}, but a step's "
                "size is unknown (a stream without len()): set `stream_sizes` (one per task) or an integer `capacity`"
            )
        capped = [_UNBOUNDED if n is None else n for n in known]
        return list(buffer_sizes(capped, step, self.rule, self.capacity))

    # ----- the pool ---------------------------------------------------------------------------------------------
    def build(self, context: TaskContext, dataset: Dataset | IterableDataset) -> Dataset | IterableDataset:
        """`dataset` (this task's training data) together with the retained rows of every earlier task."""
        self.register_steps(context)
        t = context.task_index
        if t == 0:
            return dataset
        sizes = self.sizes_at(t)
        self.history[t] = sizes
        own_size = self.step_sizes[t] if dataset is context.task.train else dataset_size(dataset, None, t)
        parts: list[Dataset | IterableDataset] = [dataset]
        weights: list[int | None] = [own_size]
        for j, count in enumerate(sizes):
            if count == 0:
                continue
            train = context.stream.tasks[j].train
            if isinstance(train, IterableDataset):
                parts.append(retained_stream(train, count, self.permutation_seeds[j], self.shuffle_buffer_size))
            else:
                parts.append(retained_rows(train, len(train) if count is None else count, self.permutation_seeds[j]))
            weights.append(count)
        return mix_pool(parts, weights, seed=permutation_seed(self.seed, context.seed, t))

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "capacity": self.capacity,
            "permutation_seeds": {str(k): v for k, v in sorted(self.permutation_seeds.items())},
            "step_sizes": {str(k): v for k, v in sorted(self.step_sizes.items())},
            "buffer_sizes": {str(k): list(v) for k, v in sorted(self.history.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rule", self.rule) != self.rule:
            raise ValueError(f"Saved buffer state is for rule {state['rule']!r}, this method uses {self.rule!r}")
        self.permutation_seeds = {int(k): int(v) for k, v in state.get("permutation_seeds", {}).items()}
        self.step_sizes = {int(k): None if v is None else int(v) for k, v in state.get("step_sizes", {}).items()}
        self.history = {
            int(k): [None if n is None else int(n) for n in v] for k, v in state.get("buffer_sizes", {}).items()
        }


# ----------------------------------------------------------------------------------------------------------------
# The methods
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class CumulativeConfig(MethodConfig):
    capacity: str | int = field(
        default="current",
        metadata={"help": "Buffer capacity B_t: 'current' (|D_t|, specs/ticclip.md §7 item 7), 'mean' (mean size of "
                          "steps 1..t: the idealised 3.5x) or a fixed number of examples. Unused by -All."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the buffer permutations, combined with the run's seed."})
    stream_sizes: list[int] | None = field(
        default=None,
        metadata={"help": "Sizes of streaming (IterableDataset) train splits, one per task; None: unknown (streams "
                          "then mix in equal shares; -Exp/-Equal need a known capacity)."},
    )
    shuffle_buffer_size: int = field(
        default=10_000, metadata={"help": "Shuffle buffer of a streaming old step before its retained prefix."}
    )

    def __post_init__(self) -> None:
        _capacity_parts([1], 1, self.capacity)  # 'current', 'mean' or a positive integer
        check_range("shuffle_buffer_size", self.shuffle_buffer_size, 1)
        check_stream_sizes(self.stream_sizes)


def check_stream_sizes(sizes: list[int] | None) -> None:
    """Sizes of streaming train splits, one per task: each >= 0."""
    for index, size in enumerate(sizes or []):
        check_range(f"stream_sizes[{index}]", size, 0)


class CumulativeReplay(ContinualMethod[CumulativeConfig]):
    """Warm start from the last model; train C iterations on D_t and the buffer of old steps, shuffled together
    (TiC-CLIP §3 II). Subclasses fix the allocation `rule` (see the module docstring)."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    config_class = CumulativeConfig
    rule: ClassVar[str] = ""
    trains_on_past_tasks = True
    roles = {"training_data": "trains each step on its data plus a buffer of older steps (TiC-CLIP's Cumulative)"}
    conflicts = {"training_data": "already trains each step on its data plus a buffer of older steps (TiC-CLIP's "
                 "Cumulative): use one of them"}

    def __init__(self, config: CumulativeConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.pool = CumulativePool(
            self.rule,
            capacity=self.config.capacity,
            seed=self.config.seed,
            stream_sizes=self.config.stream_sizes,
            shuffle_buffer_size=self.config.shuffle_buffer_size,
        )

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        return self.pool.build(context, dataset)

    def state_dict(self) -> dict[str, Any]:
        return {"pool": self.pool.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state["pool"])


@register_method
class CumulativeAll(CumulativeReplay):
    """Cumulative-All: every old example is kept, n_j = |D_j| (TiC-CLIP §3 II, Tab. 1; specs/ticclip.md §2.2
    rule 2)."""

    name = "cumulative_all"
    same_step_as = "finetune"
    rule = "all"


@register_method
class CumulativeExp(CumulativeReplay):
    """Cumulative-Exp: n_j = B/2^(t-j), n_1 = B/2^(t-2) (TiC-CLIP §3 II, App. D.3; specs/ticclip.md §2.2 rule 3)."""

    name = "cumulative_exp"
    same_step_as = "finetune"
    variant_of = "cumulative_all"
    rule = "exp"


@register_method
class CumulativeEqual(CumulativeReplay):
    """Cumulative-Equal: n_j = B/(t-1) for every old step (TiC-CLIP §3 II; specs/ticclip.md §2.2 rule 4)."""

    name = "cumulative_equal"
    same_step_as = "finetune"
    variant_of = "cumulative_all"
    rule = "equal"
