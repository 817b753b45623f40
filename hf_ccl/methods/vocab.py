"""`grow_vocab`: a vocabulary that grows with each new language (CLL-CLIP's vocabulary substitution).

At the start of every task (spec `cllclip.md` §2.2 and §3.1, paper "Approach › Vocab Substitution" and "TEIR ›
Initialization"):
1. a CLIP-style byte-level BPE V̂_t is trained on the task's training captions (`train_language_bpe`, 10K tokens);
   for a SentencePiece (Unigram) tokenizer (SigLIP, XLM-R for AltCLIP), a Unigram V̂_t (`train_language_unigram`);
2. it is merged into the current tokenizer, old ids unchanged, new tokens appended (`extend_tokenizer`; a Unigram's
   new pieces with their scores, `extend_unigram_tokenizer`); the English captions of the task's images (`texts_en`)
   are protected, so English keeps its exact tokenization;
3. the token embedding grows by the new rows, initialised i.i.d. N(μ, σ²) with the scalar mean and (unbiased) std of
   the whole previous table (`init="teir"`, TEIR's "identical distribution"), HF's mean-resizing (`"hf"`), or
   N(0, `init_std`²) (`"fixed"`, the paper's baseline without TEIR);
4. optionally the context grows (`context_length`; Mongolian and Tibetan need more than 77 tokens).

The grown tokenizer replaces the context's (`context.replace_tokenizer`): the loop trains, evaluates and saves with it
(every task checkpoint holds it, and a resumed run reloads it). This task's new ids are in `context.new_token_ids`
(TEIR reads them). Method order: `["cllclip", "grow_vocab", "teir"]`: `teir` after `grow_vocab` (it counts the
tokens of the grown tokenizer and reads the new ids), `cllclip` before it (its teacher is the original CLIP with
the original tokenizer, snapshotted at the first task start, before any growth).

On the bundled Flickr8k (stream `flickr8k-languages`, 10K per language, English protected) the vocabulary grows
49,408 -> 100,163 over en de fr cs zh ug bo mn, and tokens per eval caption go from CLIP's byte-level BPE to the
grown one: de 21.8 -> 17.6, fr 19.2 -> 16.1, cs 25.4 -> 14.9, zh 20.8 -> 3.9, ug 37.9 -> 14.0, bo 70.6 -> 25.9,
mn 101.1 -> 9.1; English 12.2 unchanged. With the grown vocabulary no caption exceeds 77 tokens; a stream that
evaluates Mongolian or Tibetan before their task (or trains without growth) needs `context_length` (longest train
caption under CLIP's BPE: bo 265, mn 338 tokens).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from datasets import Dataset

from ..tokenization import (
    MAX_LANGUAGE_VOCAB,
    POSITION_INITS,
    PositionInit,
    check_context_length,
    copy_tokenizer,
    extend_tokenizer,
    set_context_length,
    train_language_bpe,
    vocabulary_report,
)
from ..tokenization_unigram import extend_unigram_tokenizer, tokenizer_model_type, train_language_unigram
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method

logger = logging.getLogger(__name__)

EMBEDDING_INITS = ("teir", "hf", "fixed")


@dataclass
class GrowVocabConfig(MethodConfig):
    vocab_size: int = field(
        default=10_000, metadata={"help": "Size of each language's BPE V̂_t, alphabet and specials included (paper: 10K)."}
    )
    min_frequency: int = field(
        default=0, metadata={"help": "BPE trainer's min_frequency (0: the paper code's default)."}
    )
    init: str = field(
        default="teir",
        metadata={"help": "New rows: 'teir' N(mean, std^2) of the whole previous table (scalars, spec §3.1), 'hf' "
                          "transformers' mean-resizing, 'fixed' N(0, init_std^2) (the paper's baseline)."},
    )
    init_std: float = field(default=0.02, metadata={"help": "Std of the 'fixed' init (OpenCLIP: 0.02)."})
    context_length: int | None = field(
        default=None,
        metadata={"help": "Grow the text context to this many tokens at the first task (None: keep it)."},
    )
    position_init: str = field(
        default="last", metadata={"help": "New positions: 'last' copies of the last row, 'normal' N(mean, std^2)."}
    )
    skip_languages: list[str] = field(
        default_factory=list, metadata={"help": "Task names that do not grow the vocabulary (e.g. ['en'])."}
    )
    protect_columns: list[str] = field(
        default_factory=lambda: ["texts_en"],
        metadata={"help": "Train columns whose captions must keep their exact tokenization (default: the images' "
                          "English captions); []: the paper's plain merge."},
    )
    report_captions: int = field(
        default=2000, metadata={"help": "Captions per language for the tokens-per-caption report (0: none)."}
    )
    seed: int | None = field(default=None, metadata={"help": "Seed of the new rows (None: the task's seed)."})

    def __post_init__(self) -> None:
        if self.init not in EMBEDDING_INITS:
            raise ValueError(f"grow_vocab init must be one of {list(EMBEDDING_INITS)}, got {self.init!r}")
        if self.position_init not in POSITION_INITS:
            raise ValueError(f"grow_vocab position_init must be one of {list(POSITION_INITS)}, got {self.position_init!r}")
        if not 257 <= self.vocab_size <= MAX_LANGUAGE_VOCAB:
            raise ConfigError(f"vocab_size must be in [257, {MAX_LANGUAGE_VOCAB}] (more than the 256-byte alphabet; "
                              f"at most 4x the largest released vocabulary, 262,144), got {self.vocab_size}",
                              "vocab_size")
        if self.context_length is not None:
            try:
                check_context_length(self.context_length)
            except ValueError as error:
                raise ConfigError(str(error), "context_length") from None
        check_range("min_frequency", self.min_frequency, 0)
        check_range("init_std", self.init_std, 0)
        check_range("report_captions", self.report_captions, 0)
        for name in ("skip_languages", "protect_columns"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])


def column_texts(dataset: Any, column: str) -> list[str]:
    """Every caption of a `texts`-like column (lists of strings, or strings), flattened, in row order."""
    if isinstance(dataset, Dataset):
        values = dataset.with_format("arrow")[column].to_pylist()
    else:  # a stream: read it through once
        values = [row[column] for row in dataset.select_columns([column])]
    texts: list[str] = []
    for value in values:
        items = [value] if isinstance(value, str) else (value or [])
        texts.extend(item for item in items if isinstance(item, str) and item.strip())
    return texts


def init_new_rows(
    weight: torch.Tensor, rows: Iterable[int], old_rows: int, init: str, std: float = 0.02, seed: int = 0
) -> dict[str, float]:
    """Overwrite `rows` of an embedding matrix in place: 'teir' draws i.i.d. N(μ, σ²) with μ, σ the scalar mean and
    unbiased std of `weight[:old_rows]` (spec §3.1, [C] `AdapterEncoder.update_tokenizer`), 'fixed' N(0, std²).
    Returns the statistics used."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    if init == "teir":
        previous = weight[:old_rows].detach().float()
        mean, sigma = previous.mean().item(), previous.std().item()
    elif init == "fixed":
        mean, sigma = 0.0, float(std)
    else:
        raise ValueError(f"init_new_rows handles 'teir' and 'fixed', not {init!r}")
    if len(index):
        generator = torch.Generator().manual_seed(seed)
        values = torch.normal(mean, sigma, (len(index), weight.shape[1]), generator=generator)
        with torch.no_grad():
            weight[index.to(weight.device)] = values.to(device=weight.device, dtype=weight.dtype)
    return {"mean": mean, "std": sigma}


@register_method
class GrowVocab(ContinualMethod[GrowVocabConfig]):
    """Per-language BPE merged into the tokenizer, token embedding grown with TEIR's init. See the module docstring."""

    fsdp_refusal = ("it trains parameters of its own beside the model's (optimizer_parameters), which accelerate cannot "
                    "map to sharded ones")
    name = "grow_vocab"
    same_step_as = "cllclip"
    config_class = GrowVocabConfig
    roles = {"vocabulary": "grows the tokenizer and the token embedding at task start"}
    config: GrowVocabConfig

    def __init__(self, config: GrowVocabConfig | dict[str, Any] | None = None):
        super().__init__(config)
        #: Per task name: task index, appended tokens and ids, vocabulary size after, merge stats, report.
        self.history: dict[str, dict[str, Any]] = {}

    @property
    def new_token_ids(self) -> dict[str, list[int]]:
        """The ids each task appended, by task name."""
        return {name: list(entry["ids"]) for name, entry in self.history.items()}

    def on_task_start(self, context: TaskContext) -> None:
        tokenizer = context.tokenizer
        tokenizer = self._grow_context(context, tokenizer)
        name = context.task.name
        if name in self.config.skip_languages:
            self._record(context, tokenizer, [], [], {}, {})
            context.replace_tokenizer(tokenizer, [])
            return
        texts = column_texts(context.task.train, "texts")
        protect = self._protected_texts(context)
        grown, new_ids, stats = self._grow_tokenizer(tokenizer, texts, protect)
        init_stats = self._grow_embedding(context, len(tokenizer), len(grown), new_ids)
        report = self._report(tokenizer, grown, name, texts, protect)
        tokens = grown.convert_ids_to_tokens(new_ids)
        self._record(context, grown, new_ids, tokens, stats | {"init": init_stats}, report)
        logger.info("grow_vocab, task %d (%s): %d -> %d tokens, %s", context.task_index, name, len(tokenizer),
                    len(grown), report.get("languages", {}).get(name, {}))
        context.replace_tokenizer(grown, list(new_ids))

    # ----- steps -------------------------------------------------------------------------------------------
    def _grow_tokenizer(
        self, tokenizer: Any, texts: list[str], protect: list[str] | None
    ) -> tuple[Any, list[int], dict[str, Any]]:
        """V_t = V_{t-1} ∪ V̂_t for the tokenizer's model: CLIP's byte-level BPE (merges appended), or a SentencePiece
        Unigram (SigLIP, XLM-R: pieces appended with their scores, `hf_ccl.tokenization_unigram`)."""
        kind = tokenizer_model_type(tokenizer)
        if kind == "Unigram":
            if self.config.min_frequency:
                raise ValueError("grow_vocab min_frequency is the BPE trainer's; a Unigram (SentencePiece) tokenizer "
                                 "has none: leave it at 0")
            language = train_language_unigram(texts, self.config.vocab_size, tokenizer)
            return extend_unigram_tokenizer(tokenizer, language, protect_texts=protect)
        if kind != "BPE":
            raise ValueError(f"grow_vocab grows byte-level BPE (CLIP) and Unigram (SentencePiece) tokenizers, not "
                             f"{kind}")
        language_bpe = train_language_bpe(texts, self.config.vocab_size, tokenizer, min_frequency=self.config.min_frequency)
        result = extend_tokenizer(tokenizer, language_bpe, protect_texts=protect, return_stats=True)
        if len(result) != 3:  # return_stats=True adds the stats
            raise RuntimeError("extend_tokenizer returned no merge stats")
        grown, new_ids, stats = result
        return grown, new_ids, stats.to_dict()

    def _grow_context(self, context: TaskContext, tokenizer: Any) -> Any:
        """Grow the position embedding (once) and give the tokenizer the new limit; returns the tokenizer to use."""
        length = self.config.context_length
        if length is None:
            return tokenizer
        current = context.model.max_text_positions
        if current > length:
            raise ValueError(f"grow_vocab context_length={length} is shorter than the model's {current} positions")
        if current == length and tokenizer.model_max_length == length:
            return tokenizer
        tokenizer = copy_tokenizer(tokenizer)  # never change the caller's tokenizer object
        seed = self.config.seed if self.config.seed is not None else context.seed
        init = cast(PositionInit, self.config.position_init)  # one of POSITION_INITS (__post_init__)
        set_context_length(context.model, tokenizer, length, init=init, seed=seed)
        if context.max_length == current:
            context.max_length = length
        return tokenizer

    def _protected_texts(self, context: TaskContext) -> list[str] | None:
        train = context.task.train
        columns = getattr(train, "column_names", None) or []
        present = [column for column in self.config.protect_columns if column in columns]
        if not present:
            return None
        return [text for column in present for text in column_texts(train, column)]

    def _grow_embedding(self, context: TaskContext, old_size: int, new_size: int, new_ids: list[int]) -> dict[str, Any]:
        model = context.model
        embedding = model.get_input_embeddings()
        old_rows = embedding.num_embeddings
        if old_rows < old_size:
            raise ValueError(f"The token embedding has {old_rows} rows for a {old_size}-token vocabulary")
        requires_grad = embedding.weight.requires_grad
        seed = self.config.seed if self.config.seed is not None else context.seed
        if new_size > old_rows:
            model.resize_token_embeddings(new_size, mean_resizing=self.config.init == "hf")
        weight = model.get_input_embeddings().weight
        weight.requires_grad_(requires_grad)
        if self.config.init == "hf":
            return {"rule": "hf"}
        stats = init_new_rows(weight, new_ids, old_rows, self.config.init, self.config.init_std, seed)
        return {"rule": self.config.init, **stats}

    def _report(self, before: Any, after: Any, name: str, texts: list[str], protect: list[str] | None) -> dict[str, Any]:
        limit = self.config.report_captions
        if limit <= 0:
            return {}
        samples = {name: texts[:limit]}
        if protect:
            samples["protected"] = protect[:limit]
        return vocabulary_report(before, after, samples)

    def _record(
        self, context: TaskContext, tokenizer: Any, ids: list[int], tokens: list[str], stats: dict[str, Any],
        report: dict[str, Any],
    ) -> None:
        self.history[context.task.name] = {
            "task_index": context.task_index,
            "ids": list(ids),
            "tokens": list(tokens),
            "vocab_size": len(tokenizer),
            "context_length": int(context.model.max_text_positions),
            "stats": stats,
            "report": report,
        }

    # ----- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = copy.deepcopy(dict(state.get("history", {})))
