"""Growing a SentencePiece (Unigram) tokenizer by a language: SigLIP's and XLM-R's (AltCLIP) vocabularies.

The byte-level BPE merge of `hf_ccl.tokenization` is CLL-CLIP's vocabulary substitution for CLIP's tokenizer. A
Unigram tokenizer has no merges: it segments each pre-tokenized word by Viterbi over its pieces' log-probabilities.
Growing it is the same set union V_t = V_{t-1} ∪ V̂_t (spec `cllclip.md` §2.2): a Unigram V̂_t is trained on the
language's captions with the current tokenizer's normalizer and pre-tokenizer (`train_language_unigram`), and its
pieces that are new are appended with the scores V̂_t gave them (`extend_unigram_tokenizer`); every old id and score
is unchanged. An appended piece can win the Viterbi segmentation of an old-language word (the analogue of BPE's
merge drift): with `protect_texts`, every appended piece that a protected text's new segmentation uses is dropped,
until every protected text encodes exactly as before (each round drops at least one piece, so it ends).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer
from tokenizers.models import Unigram
from tokenizers.trainers import UnigramTrainer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .tokenization import rebuild_tokenizer

logger = logging.getLogger(__name__)


def tokenizer_model_type(tokenizer: PreTrainedTokenizerBase) -> str:
    """The `tokenizers` model of a fast tokenizer: "BPE", "Unigram", "WordPiece", ..."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer")
    return type(backend.model).__name__


def train_language_unigram(
    texts: Iterable[str], vocab_size: int, base_tokenizer: PreTrainedTokenizerBase
) -> PreTrainedTokenizerFast:
    """A Unigram V̂_t trained on one language's captions with `base_tokenizer`'s normalizer and pre-tokenizer
    (SentencePiece's `▁` word marks included), at most `vocab_size` pieces; deterministic for the same texts."""
    if tokenizer_model_type(base_tokenizer) != "Unigram":
        raise TypeError("train_language_unigram needs a fast Unigram (SentencePiece) tokenizer as base_tokenizer")
    texts = [text for text in texts if isinstance(text, str) and text.strip()]
    if not texts:
        raise ValueError("train_language_unigram got no non-empty text")
    base = base_tokenizer.backend_tokenizer
    trained = Tokenizer(Unigram())
    trained.normalizer = base.normalizer
    trained.pre_tokenizer = base.pre_tokenizer
    trained.train_from_iterator(texts, UnigramTrainer(vocab_size=vocab_size, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=trained)


def _segmentations(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, padding=False, truncation=False)["input_ids"]]


def extend_unigram_tokenizer(
    tokenizer: PreTrainedTokenizerBase,
    new_tokenizer: PreTrainedTokenizerBase,
    *,
    protect_texts: Iterable[str] | None = None,
) -> tuple[PreTrainedTokenizerBase, list[int], dict[str, Any]]:
    """Append `new_tokenizer`'s pieces that `tokenizer` lacks, with their scores: `(grown, new_ids, stats)`.

    Old ids and scores are unchanged; the new pieces get ids `len(tokenizer)`, ... in V̂_t's order. `protect_texts`
    keep their exact ids (module docstring)."""
    old = json.loads(tokenizer.backend_tokenizer.to_str())
    new = json.loads(new_tokenizer.backend_tokenizer.to_str())
    for data, what in ((old, "current"), (new, "new")):
        if data["model"]["type"] != "Unigram":
            raise TypeError(f"extend_unigram_tokenizer merges Unigram tokenizers; the {what} one is "
                            f"{data['model']['type']}")
    for key in ("normalizer", "pre_tokenizer"):
        if old.get(key) != new.get(key):
            raise ValueError(f"The new tokenizer's {key} differs from the current one's: train it with "
                             "train_language_unigram(texts, vocab_size, base_tokenizer=<the current tokenizer>)")
    if len(old["model"]["vocab"]) != len(tokenizer):
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but its Unigram model {len(old['model']['vocab'])}"
                         " pieces: tokens added outside the model (add_tokens) cannot be grown past")
    known = {piece for piece, _ in old["model"]["vocab"]}
    specials = {token["content"] for token in new.get("added_tokens", [])}
    candidates = [[piece, score] for piece, score in new["model"]["vocab"] if piece not in known | specials]
    protected = [text for text in (protect_texts or []) if isinstance(text, str) and text]
    before = _segmentations(tokenizer, protected)
    first_new, dropped, rounds = len(old["model"]["vocab"]), 0, 0
    while True:
        rounds += 1
        data = json.loads(json.dumps(old))
        data["model"]["vocab"] = old["model"]["vocab"] + candidates
        grown = rebuild_tokenizer(tokenizer, data)
        if not protected:
            break
        used = {index for ids, old_ids in zip(_segmentations(grown, protected), before, strict=True) if ids != old_ids
                for index in ids if index >= first_new}
        if not used:
            break
        drop = {grown.convert_ids_to_tokens(index) for index in used}
        candidates = [entry for entry in candidates if entry[0] not in drop]
        dropped += len(drop)
    new_ids = list(range(first_new, first_new + len(candidates)))
    stats = {"appended_tokens": len(candidates), "protected_pieces": dropped, "protection_rounds": rounds}
    logger.info("Vocabulary %d -> %d pieces (%s)", len(tokenizer), len(grown), stats)
    return grown, new_ids, stats
