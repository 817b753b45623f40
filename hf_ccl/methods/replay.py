"""Replay methods: ER, DER and DER++ for CLIP, over a reservoir buffer of references (`hf_ccl.data.buffer`);
DER and DER++ also on pair tasks (learner heads on cached features, CMCL's setting: the end of this docstring).

Mixing rule (all three, on CLIP tasks): the buffer's rows are **concatenated** with the task's training data and the
Trainer shuffles the union, as CTP's ER and CTP+ER do (specs/ctp.md App. B.2 and item 16: "concatenate the buffer
into the task dataset and shuffle uniformly", a ~1-5% replay fraction per batch, not 50/50). Every other loss term
(Mod-X, LwF, CTP, ...) therefore also sees the replayed rows. After a task has trained (`on_task_end`), the
reservoir sees every example of the task's own train split once, in a seeded random order (CTP's [C]: "updates the
buffer once after each task by iterating over the task's items"). CLL-CLIP's per-step reservoir and 128 + 128
batches (specs/cllclip.md A15) are not reproduced: they need a sampler, not a dataset transform.

DER on CLIP (Buzzega et al. 2020, "Dark Experience for General Continual Learning: a Strong, Simple Baseline",
NeurIPS, §3: DER adds alpha E_M ||z - h(x)||^2 on stored logits z, Eq. 4; DER++ also beta E_M l(y, f(x)) on buffer
examples with their stored labels, Eq. 6; official code aimagelab/mammoth `models/der.py`, `F.mse_loss`). The
"logits" of a buffered example are its L2-normalised image and text embeddings (v*, t*), recorded when the example
enters the buffer: at the end of the task that put it there, with the trained model in eval mode under
`torch.no_grad()`, for the changed slots only (Buzzega et al. record them at the training step that inserts the
example; with a task-end reservoir the task-end model is the model of insertion time). CLL-CLIP's DER likewise
stores the student's own features at insertion time (specs/cllclip.md §6, A15); normalised here, because CLIP's
loss depends on nothing else. For the B_m buffer rows of the global batch, with current embeddings (v, t):

    L_DER   = alpha * 1/2 [ mean_{b,d} (v_bd - v*_bd)^2 + mean_{b,d} (t_bd - t*_bd)^2 ]     (DER, Eq. 4)
    L_DER++ = L_DER + beta * L_clip(S_mm, P_mm)                                                (DER++, Eq. 6)

where S_mm and P_mm are the global logit matrix and positive mask restricted to buffer rows and columns: the CLIP
task loss on the buffer examples alone, with their stored caption as the "stored label". (The buffer rows are also
in the batch's own contrastive loss, as in CLL-CLIP's [C], where L_cm covers the whole batch.) A buffered example
keeps the one caption (seeded pick among its `texts`) its embedding was recorded with, so target and input match.

DER and DER++ on pair tasks (CMCL's setting: Liu et al. 2025, "Continual Multimodal Contrastive Learning", NeurIPS,
spec cmcl.md §4 and App. A.4; list `learner_heads` first). The "logits" of buffered pairs are their pair scores: for
a group of buffered pairs of one task, S_ij = s(W^a x^a_i, W^b x^b_j) / tau (`hf_ccl.heads.pair_logits` with the
heads' temperature tau and similarity s). The same reservoir (`buffer_size` pairs over the stream, updated at task
end) keeps per slot the cached features (x^a, x^b), the slot's task (so its modality pair) and the learner outputs
(z^a*, z^b*) recorded when it entered, with the heads just trained; the stored scores S*_ij = s(z^a*_i, z^b*_j) / tau
are recomputed from them. Each step draws `replay_batch_size` slots uniformly without replacement (seeded by the run,
the task and the draws made so far in it) and groups them by task: one modality pair per group, negatives from the
same task. Over the groups g of the n = sum_g n_g drawn slots, with L_pair the pair loss (CMCL Eq. 2; DER++'s
"label" is the binary same-instance label of App. A.4, i.e. contrastive CE on the group):

    L_DER   = L_pair + alpha * sum_g (n_g / n) mean_ij (S^g_ij - S*^g_ij)^2                  (DER, Eq. 4)
    L_DER++ = L_DER  + beta  * sum_g (n_g / n) L_pair(S^g)                                     (DER++, Eq. 6)

Buffered pairs are never mixed into the task's batches: they would feed one pair's features to another pair's heads
(ER, which only mixes, stays refused on pair streams). Only the current pair's heads train, so a group whose pair
shares no head with it adds a constant.

Options left unset take the setting's default (`SETTING_DEFAULTS`): on CLIP tasks a buffer of 8,000 examples,
alpha 1 and beta 0.5 (CLL-CLIP's DER, mammoth's derpp.yaml); on pair tasks 256 pairs, alpha 0.1 and beta 0.1 (CMCL
App. E and §4; its beta is 0.001 for ImageBind and UniBind).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset, concatenate_datasets

from ..data.buffer import ReservoirBuffer
from ..distributed import all_gather_no_grad
from ..heads import pair_contrastive_loss, pair_logits
from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext, pair_modalities
from .registry import register_method

if TYPE_CHECKING:
    from ..data.task import Task
    from ..heads import LearnerHeads
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

SLOT_COLUMN = "buffer_slot"
_MASKED_LOGIT = -1.0e4  # far below any CLIP logit (|logit| <= logit_scale <= 100): exp() underflows to exactly 0
#: What an unset (None) option of DER and DER++ means on CLIP tasks and on pair tasks (module docstring).
SETTING_DEFAULTS: dict[str, dict[str, float]] = {
    "clip": {"buffer_size": 8_000, "alpha": 1.0, "beta": 0.5},
    "pair": {"buffer_size": 256, "alpha": 0.1, "beta": 0.1},
}


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ReservoirConfig(MethodConfig):
    """What ER and the DERs share (the configs `ExperienceReplay` takes): each declares its own `buffer_size`."""

    buffer_size: int | None = field(default=None, metadata={"help": "Reservoir budget in training examples."})
    seed: int = field(default=0, metadata={"help": "Buffer seed, combined with the run's per-task seed."})

    def __post_init__(self) -> None:
        check_range("buffer_size", self.buffer_size, 0)


@dataclass
class ERConfig(ReservoirConfig):
    buffer_size: int = field(
        default=10_000,
        metadata={"help": "Reservoir budget in training examples (image-text pairs); CTP: 10,000 (~1% of P9D)."},
    )


@dataclass
class DERConfig(ReservoirConfig):
    buffer_size: int | None = field(
        default=None,
        metadata={"help": "Reservoir budget in training examples; None: 8,000 image-text pairs on CLIP tasks "
                  "(CLL-CLIP's ER/DER), 256 modality pairs on pair tasks (CMCL App. E)."},
    )
    alpha: float | None = field(
        default=None,
        metadata={"help": "Weight of the MSE to the stored embeddings or pair scores (DER, Buzzega et al. Eq. 4); "
                  "None: 1 on CLIP tasks (CLL-CLIP's DER), 0.1 on pair tasks (CMCL §4)."},
    )
    embed_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size to record new slots' embeddings (pair tasks: learner outputs) at task end; "
                  "None: the training batch size."},
    )
    replay_batch_size: int = field(
        default=64,
        metadata={"help": "Pair tasks: buffer pairs drawn per training step (seeded) and replayed by task; CLIP "
                  "tasks mix the buffer into the task's data instead."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("alpha", self.alpha, 0, also="or null")
        check_range("embed_batch_size", self.embed_batch_size, 1, also="or null")
        check_range("replay_batch_size", self.replay_batch_size, 1)


@dataclass
class DERPPConfig(DERConfig):
    beta: float | None = field(
        default=None,
        metadata={"help": "Weight of the contrastive loss on the buffer rows alone (DER++, Buzzega et al. Eq. 6); "
                  "None: 0.5 on CLIP tasks (mammoth's derpp.yaml), 0.1 on pair tasks (CMCL §4, LanguageBind)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("beta", self.beta, 0, also="or null")


# ----------------------------------------------------------------------------------------------------------------
# ER
# ----------------------------------------------------------------------------------------------------------------
#: The config of a subclass of ER (`ExperienceReplay[ItsConfig]`) and of DER.
ERConfigT = TypeVar("ERConfigT", bound=ReservoirConfig)
DERConfigT = TypeVar("DERConfigT", bound=DERConfig)


@register_method
class ExperienceReplay(ContinualMethod[ERConfigT]):
    """ER (Chaudhry et al. 2019): train each task on its data concatenated with the reservoir buffer."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "er"
    test_options = {"buffer_size": 16}  # a buffer that replays on 64-example tasks
    same_step_as = "derpp"
    config_class: ClassVar[type[ReservoirConfig]] = ERConfig
    trains_on_past_tasks = True
    roles = {"training_data": "mixes a buffer of past examples into each task's data"}
    conflicts = {"training_data": "already mixes a buffer of past examples into each task's data: use one of them"}

    def __init__(self, config: ReservoirConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.buffer = ReservoirBuffer(self.capacity(pair=False), seed=self.config.seed)

    def capacity(self, pair: bool) -> int:
        """The reservoir's budget on pair tasks (`pair`) or CLIP tasks: ER's `buffer_size` in both."""
        if self.config.buffer_size is None:  # an int in ERConfig; the DERs' None means a per-setting default
            raise ValueError(f"{self.name} has no buffer_size")
        return self.config.buffer_size

    def replay_dataset(self, context: TaskContext) -> Dataset:
        """The buffer's rows (references into `context.stream`'s train splits), as a canonical dataset."""
        return self.buffer.dataset(context.stream)

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        if len(self.buffer) == 0:
            return dataset
        return concatenate_datasets([dataset, self.replay_dataset(context)])

    def on_task_end(self, context: TaskContext) -> None:
        self.update_buffer(context)

    def update_buffer(self, context: TaskContext) -> list[int]:
        """Reservoir update with every example of the task's train split; returns the changed slots. The budget is
        the setting's (`capacity`), fixed when the reservoir sees its first example."""
        if self.buffer.num_seen == 0:
            self.buffer.set_capacity(self.capacity(is_pair_task(context.task)))
        return self.buffer.add_task(context.task_index, len(context.task.train), seed=context.seed)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])


# ----------------------------------------------------------------------------------------------------------------
# DER and DER++
# ----------------------------------------------------------------------------------------------------------------
class PairMemory:
    """What DER keeps per buffer slot on pair tasks (module docstring): the cached features (x^a, x^b) and the
    learner outputs (z^a*, z^b*) recorded when the pair entered (`FIELDS`, CPU float32 [slots, d] each); the
    modality pair of every task that ended; and the replay draws made so far in the current task (the next draw's
    seed, so that a run resumed mid-task draws the same)."""

    FIELDS = ("features_a", "features_b", "z_a", "z_b")

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.modalities: dict[int, tuple[str, str]] = {}
        self.draws = 0
        self._on_device: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        """Slots with stored rows."""
        return len(self.tensors["z_a"]) if self.tensors else 0

    def store(self, slots: Sequence[int], size: int, values: dict[str, torch.Tensor]) -> None:
        """Write `values` (each [len(slots), d]) into `slots`, growing every field to `size` slots."""
        index = torch.tensor(list(slots), dtype=torch.int64)
        for name in self.FIELDS:
            column = _grow(self.tensors.get(name), size, values[name].shape[1])
            column[index] = values[name].float().cpu()
            self.tensors[name] = column
        self._on_device = None

    def rows(self, slots: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The `FIELDS` of `slots` on `device` (the fields are copied there once, not per step)."""
        if self._on_device is None or self._on_device["z_a"].device != device:
            self._on_device = {name: self.tensors[name].to(device) for name in self.FIELDS}
        index = slots.to(device)
        return tuple(self._on_device[name][index] for name in self.FIELDS)

    def state_dict(self) -> dict[str, Any]:
        """Empty until a pair task has ended (a CLIP run's state is unchanged)."""
        if not self.modalities:
            return {}
        return {
            **self.tensors,
            "modalities": {str(task): list(pair) for task, pair in self.modalities.items()},
            "draws": self.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = {name: torch.as_tensor(state[name]).float().clone() for name in self.FIELDS if name in state}
        self.modalities = {int(task): (str(a), str(b)) for task, (a, b) in state.get("modalities", {}).items()}
        self.draws = int(state.get("draws", 0))
        self._on_device = None
        sizes = {len(value) for value in self.tensors.values()}
        if len(sizes) > 1 or (self.tensors and set(self.tensors) != set(self.FIELDS)):
            raise ValueError(f"pair replay state: fields {sorted(self.tensors)} of sizes {sorted(sizes)}")


@register_method
class DarkExperienceReplay(ExperienceReplay[DERConfigT]):
    """DER: `alpha` x MSE between buffered examples' current and stored outputs: their embeddings on CLIP tasks
    (buffer mixed into the data), their pair scores on pair tasks (replayed by task each step). Module docstring."""

    name = "der"
    test_options = {"buffer_size": 16}  # a buffer that replays on 64-example tasks
    same_step_as = "derpp"
    variant_of = "derpp"
    config_class = DERConfig
    trains_pair_tasks = True  # on pair tasks: buffered pairs replayed by task through their own heads, never mixed in
    runs_after = {"learner_heads": "records and replays pairs through the learner heads that learner_heads "
                  "attaches at task start"}

    def __init__(self, config: DERConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.captions: list[int] = []  # per slot: the index in `texts` of the caption it was recorded with
        self.image_targets: torch.Tensor | None = None  # [len(buffer), D], normalised
        self.text_targets: torch.Tensor | None = None
        self._on_device: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pairs = PairMemory()  # pair tasks: the slots' features and learner outputs

    # ----- options ----------------------------------------------------------------------------------------------
    def option(self, name: str, pair: bool) -> float:
        """`config.<name>`, or the setting's default when it is unset (`SETTING_DEFAULTS`)."""
        value = getattr(self.config, name)
        return SETTING_DEFAULTS["pair" if pair else "clip"][name] if value is None else value

    def capacity(self, pair: bool) -> int:
        return int(self.option("buffer_size", pair))

    def term_weights(self, pair: bool) -> dict[str, float]:
        """The weight of each loss term in a setting: DER's `mse` by alpha."""
        return {"mse": self.option("alpha", pair)}

    def term_names(self) -> tuple[str, ...]:
        return tuple(self.term_weights(pair=False))

    # ----- data -------------------------------------------------------------------------------------------------
    def replay_dataset(self, context: TaskContext) -> Dataset:
        """Buffer rows with their slot in `buffer_slot` and only their recorded caption."""
        return self.buffer.dataset(context.stream, slot_column=SLOT_COLUMN, caption_index=self.captions)

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        """CLIP tasks: the task's data and the buffer (ER). Pair tasks: the task's data alone; the buffer is
        replayed by task in `loss_terms` (mixed in, another pair's rows would train this pair's heads)."""
        if is_pair_task(context.task):
            return dataset
        return super().train_dataset(context, dataset)

    def on_task_start(self, context: TaskContext) -> None:
        self.pairs.draws = 0  # a run resumed mid-task restores the count after this, with the Trainer's state

    def on_task_end(self, context: TaskContext) -> None:
        changed = self.update_buffer(context)
        if is_pair_task(context.task):
            self.record_pairs(context, changed)
        elif changed:
            self._choose_captions(context, changed)
            images, texts = self.record_embeddings(context, changed)
            self._store(changed, images, texts)

    def _choose_captions(self, context: TaskContext, slots: list[int]) -> None:
        """A seeded caption per new slot, among its row's `texts`."""
        refs = self.buffer.refs
        rows = [refs[s][1] for s in slots]
        counts = [len(texts) for texts in context.task.train.select(rows)["texts"]]
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index, 1])
        picks = rng.integers(0, counts).tolist()
        self.captions.extend([0] * (len(self.buffer) - len(self.captions)))
        for slot, pick in zip(slots, picks, strict=True):
            self.captions[slot] = int(pick)

    def _record_batch_size(self, context: TaskContext) -> int:
        return self.config.embed_batch_size or context.per_device_batch_size or 64

    @torch.no_grad()
    def record_embeddings(self, context: TaskContext, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised image and text embeddings [len(slots), D] of `slots` under `context.model` (eval mode,
        no grad), preprocessed by the task-end collator `context.collator`."""
        collator = context.collator
        if collator is None:
            raise ValueError(f"{self.name} needs context.collator at task end (set by ContinualLearner)")
        batch_size = self._record_batch_size(context)
        rows = self.buffer.dataset(context.stream, slots=slots, caption_index=self.captions)
        model = context.model
        device = next(model.parameters()).device
        images, texts = [], []
        with evaluating(model):
            for start in range(0, len(rows), batch_size):
                batch = collator(_row_dicts(rows[start : start + batch_size]))
                images.append(model.embed_images(**model.image_inputs(batch, device=device)).float().cpu())
                texts.append(
                    model.embed_texts(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
                )
        return torch.cat(images), torch.cat(texts)

    def _store(self, slots: list[int], images: torch.Tensor, texts: torch.Tensor) -> None:
        self.image_targets = _grow(self.image_targets, len(self.buffer), images.shape[1])
        self.text_targets = _grow(self.text_targets, len(self.buffer), texts.shape[1])
        index = torch.tensor(slots, dtype=torch.int64)
        self.image_targets[index] = images
        self.text_targets[index] = texts
        self._on_device = None

    def record_pairs(self, context: TaskContext, slots: list[int]) -> None:
        """Pair task end: the task's modality pair, and for the new `slots` their cached features and learner
        outputs under the heads just trained (Buzzega et al. record at insertion; with a task-end reservoir the
        task-end heads are the heads of insertion time)."""
        modalities = pair_modalities(context.task)
        self.pairs.modalities[context.task_index] = modalities
        if not slots:
            return
        refs = self.buffer.refs
        rows = context.task.train.with_format("torch")[[refs[slot][1] for slot in slots]]
        features = {"features_a": rows["features_a"].float(), "features_b": rows["features_b"].float()}
        z_a, z_b = learner_outputs(context.model.require_learner_heads(), modalities, features["features_a"],
                                   features["features_b"], self._record_batch_size(context))
        self.pairs.store(slots, len(self.buffer), {**features, "z_a": z_a, "z_b": z_b})

    # ----- loss -------------------------------------------------------------------------------------------------
    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        if "features_a" in inputs:  # a pair batch: cached features through the learner heads
            return self.pair_terms(model.require_learner_heads(), context)
        slots = self._global_slots(inputs, outputs)
        if slots is None:
            zero = outputs.global_batch()[0].new_zeros((), dtype=torch.float32)
            return {name: zero for name in self.term_names()}
        return self.replay_terms(outputs, slots, getattr(model, "loss_kind", "softmax"))

    def replay_terms(
        self, outputs: ContinualDualEncoderOutput, slots: torch.Tensor, loss_kind: str = "softmax"
    ) -> dict[str, torch.Tensor]:
        """The weighted terms for a global batch whose rows have buffer `slots` (-1: new data); `loss_kind` is the
        model family's loss ("softmax" or "sigmoid"), for the terms that use it."""
        image_targets, text_targets = self._targets_on(slots.device)
        mse = der_mse(_global(outputs, "image"), _global(outputs, "text"), image_targets, text_targets, slots)
        return {"mse": self.option("alpha", pair=False) * mse}

    def _global_slots(self, inputs: dict[str, torch.Tensor], outputs: ContinualDualEncoderOutput) -> torch.Tensor | None:
        """`buffer_slot` of every row of the global batch, or None when no row can be a buffer row."""
        slots = inputs.get(SLOT_COLUMN)
        if slots is None or self.image_targets is None:
            return None
        return all_gather_no_grad(slots.to(outputs.global_batch()[0].device))

    def _targets_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored embeddings on `device`, copied once per task (not per step)."""
        if self._on_device is None or self._on_device[0].device != device:
            assert self.image_targets is not None and self.text_targets is not None
            self._on_device = (self.image_targets.to(device), self.text_targets.to(device))
        return self._on_device

    # ----- loss on pair tasks -----------------------------------------------------------------------------------
    def draw(self, context: TaskContext) -> list[tuple[int, torch.Tensor]]:
        """This step's replay: `replay_batch_size` slots drawn uniformly without replacement, as (task index, slots)
        groups in task order; seeded by (seed, run seed, task, draws so far in the task), the same on every
        process. Empty while the buffer is."""
        size = len(self.buffer)
        if size == 0:
            return []
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index, self.pairs.draws])
        self.pairs.draws += 1
        slots = np.sort(rng.choice(size, size=min(size, self.config.replay_batch_size), replace=False))
        tasks = self.buffer.slot_tasks()[slots]
        return [(int(task), torch.as_tensor(slots[tasks == task])) for task in np.unique(tasks)]

    def pair_terms(self, heads: LearnerHeads, context: TaskContext) -> dict[str, torch.Tensor]:
        """The weighted terms of a step on a pair task: each term's group values, weighted n_g / n and summed over
        the task groups of this step's draw (module docstring); zeros while the buffer is empty."""
        groups = self.draw(context)
        if not groups:
            zero = next(heads.parameters()).new_zeros((), dtype=torch.float32)
            return {name: zero for name in self.term_names()}
        total = sum(len(slots) for _, slots in groups)
        sums: dict[str, torch.Tensor] = {}
        for task, slots in groups:
            current, stored = self.group_scores(heads, task, slots)
            for name, value in self.group_terms(heads, current, stored).items():
                weighted = value * (len(slots) / total)
                sums[name] = weighted if name not in sums else sums[name] + weighted
        weights = self.term_weights(pair=True)
        return {name: weights[name] * value for name, value in sums.items()}

    def group_scores(self, heads: LearnerHeads, task: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair scores of one task's drawn slots: current S through the heads (with gradients, in their dtype)
        and stored S* from the recorded outputs with the heads' temperature and similarity (float32, no autocast)."""
        modality_a, modality_b = self.pairs.modalities[task]
        reference = next(heads.parameters())
        features_a, features_b, z_a, z_b = self.pairs.rows(slots, reference.device)
        current = heads(modality_a, modality_b, features_a.to(reference.dtype), features_b.to(reference.dtype),
                        return_loss=False).logits
        with torch.autocast(reference.device.type, enabled=False):
            stored = pair_logits(z_a, z_b, heads.temperature, heads.similarity)
        return current, stored

    def group_terms(self, heads: LearnerHeads, current: torch.Tensor, stored: torch.Tensor) -> dict[str, torch.Tensor]:
        """One group's unweighted terms: DER's mean_ij (S_ij - S*_ij)^2 (Buzzega et al. Eq. 4)."""
        return {"mse": (current.float() - stored.float()).pow(2).mean()}

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["captions"] = torch.tensor(self.captions, dtype=torch.int64)
        if self.image_targets is not None and self.text_targets is not None:
            state["image_targets"], state["text_targets"] = self.image_targets, self.text_targets
        pairs = self.pairs.state_dict()
        if pairs:
            state["pairs"] = pairs
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.captions = [int(c) for c in torch.as_tensor(state.get("captions", [])).tolist()]
        images, texts = state.get("image_targets"), state.get("text_targets")
        self.image_targets = None if images is None else torch.as_tensor(images).float().clone()
        self.text_targets = None if texts is None else torch.as_tensor(texts).float().clone()
        self._on_device = None
        self.pairs.load_state_dict(state.get("pairs") or {})
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Every slot has its stored outputs: a caption and embeddings (CLIP tasks) or features and learner outputs
        and its task's modality pair (pair tasks)."""
        slots, captions, pairs = len(self.buffer), len(self.captions), len(self.pairs)
        stored = 0 if self.image_targets is None else len(self.image_targets)
        if (captions, stored, pairs) not in ((slots, slots, 0), (0, 0, slots)):
            raise ValueError(
                f"{self.name} state holds {slots} buffer slots but {captions} captions, {stored} stored embeddings "
                f"and {pairs} stored pairs"
            )
        missing = sorted(set(self.buffer.slot_tasks().tolist()) - set(self.pairs.modalities)) if pairs else []
        if missing:
            raise ValueError(f"{self.name} state: buffer slots of task(s) {missing} without a modality pair")


@register_method
class DarkExperienceReplayPlusPlus(DarkExperienceReplay[DERPPConfig]):
    """DER++: DER plus `beta` x the contrastive loss on the buffered examples alone: the CLIP loss of the batch's
    buffer rows, or the pair loss of each task group (module docstring)."""

    name = "derpp"
    test_options = {"buffer_size": 16}  # a buffer that replays on 64-example tasks
    test_families = ("siglip",)
    config_class = DERPPConfig

    def term_weights(self, pair: bool) -> dict[str, float]:
        """DER's, and `replay_contrastive` by beta."""
        return {**super().term_weights(pair), "replay_contrastive": self.option("beta", pair)}

    def replay_terms(
        self, outputs: ContinualDualEncoderOutput, slots: torch.Tensor, loss_kind: str = "softmax"
    ) -> dict[str, torch.Tensor]:
        terms = super().replay_terms(outputs, slots, loss_kind)
        logits = outputs.global_logits_per_image
        if logits is None:
            logits = outputs.logits_per_image
        if logits is None:
            raise ValueError("derpp: the model output holds no logits")
        subset_loss = subset_sigmoid_loss if loss_kind == "sigmoid" else subset_contrastive_loss
        terms["replay_contrastive"] = self.option("beta", pair=False) * subset_loss(
            logits, outputs.global_positive_mask, slots >= 0
        )
        return terms

    def group_terms(self, heads: LearnerHeads, current: torch.Tensor, stored: torch.Tensor) -> dict[str, torch.Tensor]:
        """DER's, and the pair loss of the group (CMCL Eq. 2, the same-instance label of App. A.4; Eq. 6)."""
        return {**super().group_terms(heads, current, stored),
                "replay_contrastive": pair_contrastive_loss(current, heads.symmetric)}


# ----------------------------------------------------------------------------------------------------------------
# Loss functions (no host synchronisation: the buffer rows are selected by weights, not by boolean indexing)
# ----------------------------------------------------------------------------------------------------------------
def der_mse(
    images: torch.Tensor,
    texts: torch.Tensor,
    image_targets: torch.Tensor,
    text_targets: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """1/2 [mean (v - v*)^2 + mean (t - t*)^2] over the rows with `slots >= 0` and every dimension (DER, with
    the elementwise mean of Buzzega et al.'s code, `F.mse_loss`); 0 when no row is a buffer row."""
    keep = (slots >= 0).float()
    index = slots.clamp(min=0)
    per_row = (images.float() - image_targets[index]).pow(2).mean(-1) + (texts.float() - text_targets[index]).pow(2).mean(-1)
    return (keep * per_row).sum() / (2.0 * keep.sum().clamp(min=1.0))


def subset_contrastive_loss(
    logits_per_image: torch.Tensor, positives: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor:
    """`losses.clip_contrastive_loss` on the sub-matrix of `rows` (bool [N]) and its positive mask, computed on
    the full matrix with the other columns masked out; 0 when no row is selected."""
    logits = logits_per_image.float()
    if positives is None:
        positives = torch.eye(logits.shape[0], dtype=torch.bool, device=logits.device)
    pair = rows[:, None] & rows[None, :]
    weight = rows.float()
    count = weight.sum().clamp(min=1.0)
    total = logits.new_zeros(())
    for matrix, mask in ((logits, positives & pair), (logits.t(), (positives & pair).t())):
        masked = matrix.masked_fill(~rows[None, :], _MASKED_LOGIT)
        targets = mask.float() / mask.float().sum(-1, keepdim=True).clamp(min=1.0)
        per_row = -(targets * masked.log_softmax(-1)).sum(-1)
        total = total + (weight * per_row).sum() / count
    return total / 2.0


def subset_sigmoid_loss(
    logits_per_image: torch.Tensor, positives: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor:
    """`losses.sigmoid_contrastive_loss` (SigLIP's family) on the sub-matrix of `rows` (bool [N]): the pairs of two
    selected rows, divided by their count; 0 when no row is selected."""
    logits = logits_per_image.float()
    if positives is None:
        positives = torch.eye(logits.shape[0], dtype=torch.bool, device=logits.device)
    pair = (rows[:, None] & rows[None, :]).float()
    signs = positives.float() * 2.0 - 1.0
    return -(pair * F.logsigmoid(signs * logits)).sum() / rows.float().sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def _global(outputs: ContinualDualEncoderOutput, modality: str) -> torch.Tensor:
    """Global-batch embeddings (gathered with gradients), or the local ones when the output has none."""
    gathered = getattr(outputs, f"all_{modality}_embeds")
    return gathered if gathered is not None else getattr(outputs, f"{modality}_embeds")


def _grow(tensor: torch.Tensor | None, rows: int, dim: int) -> torch.Tensor:
    """`tensor` extended with zero rows to `rows` rows (a new [rows, dim] tensor when None)."""
    if tensor is None:
        return torch.zeros(rows, dim)
    if len(tensor) >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - len(tensor), dim)])


def _row_dicts(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """A slice of a dataset (a dict of columns) as a list of row dicts, for a collator."""
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def is_pair_task(task: Task | None) -> bool:
    """Whether `task` is a pair task (CMCL's setting: cached features, learner heads)."""
    return getattr(task, "kind", None) == "pair"


@contextlib.contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode for the block, then back in the mode it was in."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


@torch.no_grad()
def learner_outputs(
    heads: LearnerHeads,
    modalities: tuple[str, str],
    features_a: torch.Tensor,
    features_b: torch.Tensor,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """z^a = W^a x^a and z^b = W^b x^b (CPU float32) of aligned feature rows, in eval mode, `batch_size` rows at a
    time in the heads' device and dtype."""
    reference = next(heads.parameters())
    outputs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    with evaluating(heads):
        for start in range(0, len(features_a), batch_size):
            for out, modality, features in zip(outputs, modalities, (features_a, features_b), strict=True):
                rows = features[start : start + batch_size].to(reference.device, reference.dtype)
                out.append(heads.head_output(modality, rows).float().cpu())
    return torch.cat(outputs[0]), torch.cat(outputs[1])
