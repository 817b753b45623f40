"""TEIR's regularisation (Yang et al., AAAI 2024, "Approach › TEIR › Regularization"; specs/cllclip.md §3.2):
per-row scaling of the token embedding's gradient and decoupled weight decay by how often each token was trained.

    θ_{t,j} ← (1 − α·β·λ_{t,j}) · θ_{t,j} − α · λ_{t,j} · ∇L(θ_{t,j})                          (Eq. 5)
    λ_{t,j} = 0 if j ∈ V_{t,old};  1/(c_{t,j} + 1) if j ∈ V_{t,∩};  1 if j ∈ V_{t,new}              (Eq. 6)

α is the learning rate, β the weight decay and j a row of the embedding. As in the official code (spec §3.2,
§9 A5–A7) the three sets come from the *tokenized data*, so Eq. 6 is λ_j = present_j / freq_j, where

- `present_j` = 1 when the current tokenizer (`context.tokenizer`, after any vocabulary growth) emits
  token j on the task's training captions (`texts` of every row the task trains on, replayed rows included;
  `add_special_tokens=False`), else 0 (V_old: no gradient and no decay, the row stays bit-identical);
- `freq_j` = c_{t,j} + 1, c counting the earlier *tasks* whose training data contained j. At the first task,
  freq = 2 for the rows the model had before that task (CLIP's pre-training counts as one task, c_{1,j} = 1)
  and 1 for rows the first task added (`context.new_token_ids`); rows added later start at 1; after a
  task, freq_j += present_j;
- the special tokens (BOS, EOS, PAD, UNK: `tokenizer.all_special_ids`) get λ = 0: frozen.

With AdamW the paper applies λ to β and to ∇L directly (spec §3.2): after gradient clipping, the gradient rows are
scaled (G ← λ·G, before Adam's moments) and each row is decayed by (1 − α_s·β·λ_j), α_s the scheduler's current
rate. The optimizer's own decoupled decay must therefore not touch the embedding: `no_weight_decay` names it, so
`ContinualTrainer` puts it in the group without weight decay, and TEIR applies its row-scaled decay itself, from
a one-shot step pre-hook on the optimizer (so a step that the fp16 GradScaler skips decays nothing either). β is
`weight_decay`, or the task's `TrainingArguments.weight_decay` when None.

Where this differs from the official code: with replay (ER, DER) the code adds, per token, the number of
*languages* in the current data and the buffer that contain it; here freq_j grows by 1 per task whose training
data (current and replayed rows together) contains j. The vocabulary initialisation half of TEIR (new rows drawn
from N(μ, σ²) of the old table, Eqs. in "Initialization") belongs to vocabulary growth (`grow_vocab`).

Order: put `teir` after the methods that change the vocabulary or the training data (`grow_vocab`, `er`, `der`),
so that it counts the tokens of what the task really trains on. Streaming tasks are refused: λ needs the task's
text statistics up front (the paper's "Limitations").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..data.streaming import is_streaming
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .regularization import token_embedding_name

if TYPE_CHECKING:
    from datasets import Dataset

    from ..modeling import ContinualDualEncoder

logger = logging.getLogger(__name__)

_TOKENIZE_BATCH = 1024


# ----- pure functions ---------------------------------------------------------------------------------------------
def initial_frequencies(num_rows: int, new_token_ids: Iterable[int] = (), pretrained_counts: bool = True) -> torch.Tensor:
    """freq at the first task: 1 + 1[row existed before the task] (c_{1,j} = 1 for pre-trained rows), float32."""
    freq = torch.full((num_rows,), 2.0 if pretrained_counts else 1.0)
    new = torch.as_tensor(list(new_token_ids), dtype=torch.int64)
    if len(new):
        freq[new] = 1.0
    return freq


def extend_frequencies(freq: torch.Tensor, num_rows: int) -> torch.Tensor:
    """freq with 1 for the rows added since (vocabulary growth appends rows)."""
    if num_rows < len(freq):
        raise ValueError(f"teir: the token embedding shrank from {len(freq)} to {num_rows} rows")
    return torch.cat([freq, torch.ones(num_rows - len(freq), dtype=freq.dtype)])


def token_presence(texts: Iterable[str], tokenizer: Any, num_rows: int) -> torch.Tensor:
    """Bool [num_rows]: which ids `tokenizer` emits on `texts` (without special tokens)."""
    present = torch.zeros(num_rows, dtype=torch.bool)
    batch: list[str] = []

    def flush() -> None:
        if not batch:
            return
        encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([i for row in encoded for i in row], dtype=torch.int64)
        if len(ids):
            if int(ids.max()) >= num_rows:
                raise ValueError(
                    f"teir: the tokenizer emits id {int(ids.max())} but the token embedding has {num_rows} rows"
                )
            present[ids] = True
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= _TOKENIZE_BATCH:
            flush()
    flush()
    return present


def row_scales(present: torch.Tensor, freq: torch.Tensor, frozen_ids: Iterable[int] = ()) -> torch.Tensor:
    """λ (Eq. 6 as counted by the official code): present / freq, with the `frozen_ids` rows set to 0 (float32)."""
    if present.shape != freq.shape:
        raise ValueError(f"presence {tuple(present.shape)} and frequencies {tuple(freq.shape)} differ")
    lam = present.float() / freq.float()
    frozen = torch.as_tensor(sorted(set(frozen_ids)), dtype=torch.int64)
    if len(frozen):
        lam[frozen] = 0.0
    return lam


def dataset_texts(dataset: Dataset, column: str = "texts") -> Iterable[str]:
    """Every caption of `column` (a list of strings per row) of a map-style dataset, read column-wise."""
    if column not in dataset.column_names:
        raise ValueError(f"teir: the training data has no {column!r} column; it has {dataset.column_names}")
    for batch in dataset.select_columns([column]).iter(batch_size=_TOKENIZE_BATCH):
        for texts in batch[column]:
            if isinstance(texts, str):
                yield texts
            else:
                yield from texts


# ----- configuration ----------------------------------------------------------------------------------------------
@dataclass
class TEIRConfig(MethodConfig):
    scale_gradients: bool = field(
        default=True, metadata={"help": "Scale each embedding row's gradient by λ (Eq. 5; the 'G' ablation of T3)."}
    )
    scale_weight_decay: bool = field(
        default=True,
        metadata={
            "help": "Scale each row's decoupled weight decay by λ (Eq. 5; the 'WD' ablation of T3); False leaves "
            "the embedding's decay to the optimizer (every row decays)."
        },
    )
    weight_decay: float | None = field(
        default=None, metadata={"help": "β of Eq. 5; None: the task's TrainingArguments.weight_decay."}
    )
    freeze_special_tokens: bool = field(
        default=True, metadata={"help": "λ = 0 for BOS, EOS, PAD and UNK (the official exclude_special_tokens)."}
    )
    pretrained_counts_as_task: bool = field(
        default=True,
        metadata={"help": "At the first task, rows that existed before it have freq 2 (c_{1,j} = 1), new rows 1."},
    )
    text_column: str = field(default="texts", metadata={"help": "The captions whose tokens are counted."})

    def __post_init__(self) -> None:
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


# ----- the method -------------------------------------------------------------------------------------------------
@register_method
class TEIR(ContinualMethod[TEIRConfig]):
    """TEIR's per-row gradient and weight-decay scaling of the token embedding (module docstring, Eqs. 5–6)."""

    fsdp_refusal = ("it masks and rescales the token embedding's gradient rows at every step, and FSDP2 holds that "
                    "gradient as a shard")
    name = "teir"
    test_families = ("altclip",)
    config_class = TEIRConfig
    roles = {"previous_model": "protects the token-embedding rows that earlier tasks trained"}
    runs_after = {
        "training_data": "counts the tokens of the data each task really trains on, replayed rows included",
        "vocabulary": "counts tokens with the grown tokenizer",
    }
    config: TEIRConfig

    def __init__(self, config: TEIRConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.frequencies: torch.Tensor | None = None  # freq = c + 1 per row, float32
        self.present: torch.Tensor | None = None  # this task's token presence
        self.scales: torch.Tensor | None = None  # λ of this task
        self._scales_on: torch.Tensor | None = None
        self._hook: Any = None

    # ----- bookkeeping ------------------------------------------------------------------------------------------
    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        """Count this task's tokens (after every task-start hook, so with the grown tokenizer) and set λ."""
        self.prepare(context, dataset)
        return dataset

    def prepare(self, context: TaskContext, dataset: Dataset) -> torch.Tensor:
        """λ for the task that trains on `dataset` (also extends freq for new rows); returns λ."""
        if is_streaming(dataset):
            raise ValueError(
                "teir needs the task's token statistics before training (Eq. 6), which a streaming dataset cannot "
                "give: use a map-style dataset"
            )
        tokenizer = context.tokenizer
        if tokenizer is None:
            raise ValueError("teir needs context.tokenizer (the current tokenizer)")
        rows = context.model.get_input_embeddings().weight.shape[0]
        if self.frequencies is None:
            new_ids = context.new_token_ids
            self.frequencies = initial_frequencies(rows, new_ids, self.config.pretrained_counts_as_task)
        else:
            self.frequencies = extend_frequencies(self.frequencies, rows)
        self.present = token_presence(dataset_texts(dataset, self.config.text_column), tokenizer, rows)
        frozen = tokenizer.all_special_ids if self.config.freeze_special_tokens else ()
        self.scales = row_scales(self.present, self.frequencies, frozen)
        self._scales_on = None
        logger.info(
            "teir: task %d: %d of %d token rows train (λ>0); λ=1: %d; 0<λ<1: %d",
            context.task_index, int((self.scales > 0).sum()), rows, int((self.scales == 1).sum()),
            int(((self.scales > 0) & (self.scales < 1)).sum()),
        )
        return self.scales

    def on_task_end(self, context: TaskContext) -> None:
        """freq_j += 1 for every token the task trained on (c counts tasks, spec §9 A6)."""
        self._disarm()
        if self.present is not None and self.frequencies is not None:
            self.frequencies = self.frequencies + self.present.float()
        self.present = self.scales = self._scales_on = None

    # ----- the optimizer ----------------------------------------------------------------------------------------
    def no_weight_decay(self, model: ContinualDualEncoder) -> set[str]:
        """The token embedding, whose decay TEIR applies per row itself (when `scale_weight_decay`)."""
        name = token_embedding_name(model)
        return {name} if self.config.scale_weight_decay and name is not None else set()

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """G ← λ·G on the embedding rows, and arm the row-scaled decay θ ← (1 − α·β·λ)·θ for this step (Eq. 5)."""
        weight = model.get_input_embeddings().weight
        scales = self._scales_for(weight)
        if self.config.scale_gradients and weight.grad is not None:
            if weight.grad.is_sparse:
                weight.grad = weight.grad.to_dense()
            weight.grad.mul_(scales.to(weight.grad.dtype)[:, None])
        if self.config.scale_weight_decay:
            self._arm(weight, scales, context)

    def _scales_for(self, weight: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            raise RuntimeError("teir: no λ for this task (train_dataset was not called)")
        if self.scales.shape[0] != weight.shape[0]:
            raise ValueError(
                f"teir: λ covers {self.scales.shape[0]} rows but the token embedding has {weight.shape[0]}: the "
                "vocabulary changed after teir counted the tokens"
            )
        if self._scales_on is None or self._scales_on.device != weight.device:
            self._scales_on = self.scales.to(weight.device)
        return self._scales_on

    def decay_rate(self, context: TaskContext) -> float:
        """β: `weight_decay`, else the task's TrainingArguments.weight_decay."""
        if self.config.weight_decay is not None:
            return float(self.config.weight_decay)
        args = context.training_args
        if args is None:
            raise ValueError("teir needs weight_decay or context.training_args (set by ContinualTrainer)")
        return float(args.weight_decay)

    def _arm(self, weight: torch.Tensor, scales: torch.Tensor, context: TaskContext) -> None:
        """A one-shot step pre-hook on the task's optimizer that decays `weight`'s rows just before it steps."""
        self._disarm()  # a hook left from a step the GradScaler skipped
        optimizer = context.optimizer
        if optimizer is None:
            raise ValueError("teir needs context.optimizer (set by ContinualTrainer) for its weight decay")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # an Accelerate wrapper's torch optimizer
        group = next((g for g in optimizer.param_groups if any(p is weight for p in g["params"])), None)
        if group is None:
            raise ValueError("teir: the optimizer does not train the token embedding")
        if group.get("weight_decay", 0.0) != 0.0:
            raise ValueError(
                "teir: the optimizer also decays the token embedding; TEIR decays it per row itself, so the "
                "optimizer must not (ContinualTrainer excludes it through no_weight_decay)"
            )
        beta = self.decay_rate(context)
        if beta == 0.0:
            return  # (1 − α·0·λ) = 1: nothing to decay

        def decay(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            self._disarm()
            factor = 1.0 - float(group["lr"]) * beta * scales  # exactly 1 where λ = 0
            with torch.no_grad():
                weight.mul_(factor.to(weight.dtype)[:, None])

        self._hook = optimizer.register_step_pre_hook(decay)

    def _disarm(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """freq (c + 1 per row, float32); λ is recomputed from the task's data at task start."""
        return {} if self.frequencies is None else {"token_frequencies": self.frequencies.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        frequencies = state.get("token_frequencies")
        self.frequencies = None if frequencies is None else torch.as_tensor(frequencies).float().clone()
