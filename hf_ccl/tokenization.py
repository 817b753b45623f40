"""An incremental CLIP tokenizer: a byte-level BPE per new language, merged into the current vocabulary.

CLL-CLIP (spec `cllclip.md` §2.2, "Vocab Substitution") trains, for each language, a BPE vocabulary V̂_t with CLIP's
own procedure and merges it into the current one, V_t = V_{t-1} ∪ V̂_t, following Garcia et al. (2021): every old
token keeps its id, the new tokens are appended, and the token embedding grows by the same rows (§3.1 for their
initialisation, done by the `grow_vocab` method).

**The merge (`extend_tokenizer`) is a merged BPE, not `add_tokens`.** The grown tokenizer is one BPE model whose
vocabulary is the old one plus V̂_t's new tokens (appended in V̂_t's id order) and whose merge list is the old one
followed by V̂_t's merges that are not already there, exactly as the paper's code does (`combine_tokenizers`, spec
A12). Added tokens (`tokenizer.add_tokens`) cannot do this: they are literal strings matched before
pre-tokenization, anywhere in the text, so a German "der" would split English "border" and every word-final token
(`...</w>`) would need a byte-level-to-text translation; old-language encodings would change everywhere.

Because the old merges keep their ranks (higher priority), BPE on any word first runs exactly the old derivation; a
word's tokenization can only change when an appended merge then fires on two adjacent tokens of its old
tokenization. The paper accepts that drift (spec §2.2, "sub-optimal V_t"); on Flickr8k it changes the tokens of 1.4%
of English captions (English words inside German and French captions, such as "surfboard" or "computer", become
new single tokens with fresh embeddings). `protect_texts` removes it: every appended merge whose pair is adjacent in
the old tokenization of a protected text is dropped, with the new tokens that only dropped merges could build. The
protected texts then encode exactly as before; `grow_vocab` protects the English captions of the task's own
training images (`texts_en`, the cross-lingual teacher's input, so no old data is needed).

`set_context_length` grows the text position embedding (Mongolian and Tibetan captions are longer than CLIP's 77
tokens under byte-level BPE), and `vocabulary_report` measures growth and tokens per caption per language.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tokenizers import Tokenizer
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

logger = logging.getLogger(__name__)

PositionInit = Literal["last", "normal"]
POSITION_INITS = ("last", "normal")
#: The largest vocabulary trained for one language (`grow_vocab`'s `vocab_size`): 4x the largest vocabularies of
#: released CLIP-family tokenizers (SigLIP 2's Gemma 262,144; AltCLIP's XLM-R 250,002). Beyond it the tokenizers
#: trainer reserves memory for the size asked, and aborts the process at 10^9.
MAX_LANGUAGE_VOCAB = 2**20
#: The longest text context a model can be grown to (`set_context_length`): the longest of released CLIP-style text
#: towers (jina-clip-v2, 8,192 tokens; CLIP 77, SigLIP 64, Long-CLIP 248). Attention memory grows with its square.
MAX_CONTEXT_LENGTH = 8192


# ----------------------------------------------------------------------------------------------------------------
# Training a language's BPE
# ----------------------------------------------------------------------------------------------------------------


def train_language_bpe(
    texts: Iterable[str],
    vocab_size: int = 10_000,
    base_tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    min_frequency: int = 0,
) -> PreTrainedTokenizerBase:
    """A byte-level BPE trained on one language's captions with CLIP's own pipeline (spec §2.2, V̂_t).

    `base_tokenizer.train_new_from_iterator(texts, vocab_size)` as in the paper's `prepare_new_tokenizers.py`: the
    base tokenizer's normalizer (NFC, whitespace, lowercase), CLIP regex + ByteLevel pre-tokenizer, `</w>` suffix
    and special tokens. `vocab_size` counts the byte alphabet and specials (paper: 10,000); a small corpus may
    stop short of it. `min_frequency` is the BPE trainer's (0, the paper's default, merges even pairs seen once).
    `base_tokenizer` defaults to the bundled CLIP tokenizer.

    Deterministic, unlike a bare `train_new_from_iterator`: the trainer numbers the word-final symbols (`x</w>`)
    in hash order, which reorders merges of equal count from one process to the next (and with them the ids the
    new tokens would get, breaking a resumed run). Here all 256 of them are declared to the trainer first, so they
    get fixed ids, as in CLIP's own vocabulary; `vocab_size` is raised by the number of them the corpus does not
    use, so the number of merges is the one a bare call would learn.
    """
    if base_tokenizer is None:
        from .data.collate import load_tokenizer

        base_tokenizer = load_tokenizer()
    backend = getattr(base_tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, BPE):
        raise TypeError("train_language_bpe needs a fast BPE tokenizer (e.g. CLIP's) as base_tokenizer")
    texts = [text for text in texts if isinstance(text, str) and text.strip()]
    if not texts:
        raise ValueError("train_language_bpe got no non-empty text")
    suffix = backend.model.end_of_word_suffix or ""
    if not suffix or "ByteLevel" not in str(backend.pre_tokenizer):  # no byte-level word-final symbols to pin
        return base_tokenizer.train_new_from_iterator(
            texts, vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False
        )
    finals = sorted(symbol + suffix for symbol in ByteLevel.alphabet())
    used = {symbol + suffix for symbol in _word_final_symbols(base_tokenizer, texts)}
    trained = base_tokenizer.train_new_from_iterator(
        texts,
        vocab_size=vocab_size + len(set(finals) - used),
        min_frequency=min_frequency,
        show_progress=False,
        new_special_tokens=finals,
    )
    data = json.loads(trained.backend_tokenizer.to_str())
    pinned = set(finals)
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] not in pinned]
    return rebuild_tokenizer(base_tokenizer, data)


def _word_final_symbols(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> set[str]:
    """The last (byte-level) symbol of every pre-tokenized word of `texts`."""
    backend = tokenizer.backend_tokenizer
    normalizer, pre_tokenizer = backend.normalizer, backend.pre_tokenizer
    finals: set[str] = set()
    for text in texts:
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        words = pre_tokenizer.pre_tokenize_str(normalized) if pre_tokenizer is not None else [(normalized, None)]
        finals.update(word[-1] for word, _ in words if word)
    return finals


# ----------------------------------------------------------------------------------------------------------------
# Merging
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class MergeStats:
    """What `extend_tokenizer` did: merges appended and dropped, tokens appended."""

    appended_tokens: int = 0
    appended_merges: int = 0
    duplicate_merges: int = 0
    protected_merges: int = 0  # dropped: they would fire on a protected text
    unreachable_merges: int = 0  # dropped: a part can no longer be built (a protected merge made it)
    protected_pairs: int = 0
    dropped_tokens: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        values = dict(self.__dict__)
        values["dropped_tokens"] = len(self.dropped_tokens)
        return values


def _backend_json(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer")
    data = json.loads(backend.to_str())
    if data.get("model", {}).get("type") != "BPE":
        raise TypeError(f"extend_tokenizer merges BPE tokenizers; got a {data.get('model', {}).get('type')} model")
    return data


def _pair(merge: str | Sequence[str]) -> tuple[str, str]:
    """A merge in either serialisation ("a b" or ["a", "b"])."""
    if isinstance(merge, str):
        left, right = merge.split(" ", 1)
        return left, right
    left, right = merge
    return str(left), str(right)


def _check_compatible(old: dict[str, Any], new: dict[str, Any]) -> None:
    for key in ("normalizer", "pre_tokenizer"):
        if old.get(key) != new.get(key):
            raise ValueError(f"The new tokenizer's {key} differs from the current one's: train it with "
                             "train_language_bpe(texts, vocab_size, base_tokenizer=<the current tokenizer>)")
    for key in ("end_of_word_suffix", "continuing_subword_prefix", "byte_fallback"):
        if old["model"].get(key) != new["model"].get(key):
            raise ValueError(f"The BPE models differ in {key!r}: {old['model'].get(key)!r} vs {new['model'].get(key)!r}")


def _encode(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[Any]:
    """The backend encodings of `texts`, without special tokens, padding or truncation (a bare
    `backend_tokenizer.encode_batch` would apply whatever padding and truncation the last call left set)."""
    if not texts:
        return []
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # no "sequence longer than the maximum" warning: nothing is fed to a model
    try:
        batch = tokenizer(list(texts), add_special_tokens=False, padding=False, truncation=False)
    finally:
        transformers_logging.set_verbosity(verbosity)
    return list(batch.encodings)


def protected_pairs(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> set[tuple[str, str]]:
    """Pairs of tokens adjacent inside one word of the tokenizer's encoding of `texts`: the merges that must not be
    appended if these texts are to keep their tokenization."""
    texts = [text for text in texts if isinstance(text, str) and text]
    if not texts:
        return set()
    pairs: set[tuple[str, str]] = set()
    for encoding in _encode(tokenizer, texts):
        tokens, words = encoding.tokens, encoding.word_ids
        for i in range(len(tokens) - 1):
            if words[i] is not None and words[i] == words[i + 1]:
                pairs.add((tokens[i], tokens[i + 1]))
    return pairs


def rebuild_tokenizer(tokenizer: PreTrainedTokenizerBase, data: dict[str, Any]) -> PreTrainedTokenizerBase:
    """A tokenizer of the same class and settings with a new backend, built the way transformers' own
    `train_new_from_iterator` builds one (init kwargs + `tokenizer_object`)."""
    kwargs = dict(tokenizer.init_kwargs)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            kwargs[name] = str(value)
    kwargs["model_max_length"] = tokenizer.model_max_length
    kwargs["tokenizer_object"] = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    kwargs.pop("tokenizer_file", None)
    kwargs.pop("vocab", None)
    kwargs.pop("merges", None)
    grown = tokenizer.__class__(**kwargs)
    grown.name_or_path = tokenizer.name_or_path
    return grown


def copy_tokenizer(tokenizer: PreTrainedTokenizerBase, **overrides: Any) -> PreTrainedTokenizerBase:
    """An independent copy of a fast tokenizer (same class, backend and settings; `overrides` such as
    `model_max_length` replace settings). `copy.deepcopy` is not used: it loses the decode wrapper CLIPTokenizer
    installs on its backend (decoded text would keep the `</w>` suffixes)."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    copied = rebuild_tokenizer(tokenizer, data)
    for name, value in overrides.items():
        setattr(copied, name, value)
    return copied


def extend_tokenizer(
    tokenizer: PreTrainedTokenizerBase,
    new_tokenizer: PreTrainedTokenizerBase,
    *,
    protect_texts: Iterable[str] | None = None,
    return_stats: bool = False,
) -> tuple[PreTrainedTokenizerBase, list[int]] | tuple[PreTrainedTokenizerBase, list[int], MergeStats]:
    """Merge a language's BPE (`new_tokenizer`, from `train_language_bpe`) into `tokenizer`: V_t = V_{t-1} ∪ V̂_t.

    Returns `(grown_tokenizer, new_token_ids)` (and the `MergeStats` with `return_stats=True`). Every old id is
    unchanged; the new tokens get ids `len(tokenizer)`, `len(tokenizer) + 1`, ... in V̂_t's id order; the merge
    list is the old one followed by V̂_t's merges not already present (spec §2.2, [C] `combine_tokenizers`; see
    the module docstring for why this is a merged BPE and not `add_tokens`).

    `protect_texts`: texts (e.g. English captions) that must encode exactly as before. Appended merges that would
    fire on their old tokenization are dropped, and so are the merges and tokens that depended on them; None: the
    paper's plain merge, under which some old-language words can change tokenization.

    The result is an ordinary tokenizer of the same class: `save_pretrained` / `AutoTokenizer.from_pretrained`
    reproduce its ids.
    """
    old = _backend_json(tokenizer)
    new = _backend_json(new_tokenizer)
    _check_compatible(old, new)
    stats = MergeStats()
    vocab: dict[str, int] = dict(old["model"]["vocab"])
    old_merges = [_pair(m) for m in old["model"]["merges"]]
    known = set(old_merges)
    forbidden = protected_pairs(tokenizer, protect_texts) if protect_texts is not None else set()
    stats.protected_pairs = len(forbidden)

    new_merges = [_pair(m) for m in new["model"]["merges"]]
    specials = {token["content"] for token in new.get("added_tokens", [])}
    results = {left + right for left, right in new_merges}
    atoms = {token for token in new["model"]["vocab"] if token not in results and token not in specials}
    # tokens the merged BPE can produce: the old vocabulary, V̂_t's alphabet and the results of kept merges
    buildable = set(vocab) | atoms
    appended: list[tuple[str, str]] = []
    for left, right in new_merges:
        if (left, right) in known:
            stats.duplicate_merges += 1
            continue
        if left not in buildable or right not in buildable:
            stats.unreachable_merges += 1
            continue
        if (left, right) in forbidden:
            stats.protected_merges += 1
            continue
        known.add((left, right))
        appended.append((left, right))
        buildable.add(left + right)
    stats.appended_merges = len(appended)

    next_id = max(len(tokenizer), max(vocab.values()) + 1)
    new_ids: list[int] = []
    for token, _ in sorted(new["model"]["vocab"].items(), key=lambda item: item[1]):
        if token in vocab:
            continue
        if token not in buildable:
            stats.dropped_tokens.append(token)
            continue
        vocab[token] = next_id
        new_ids.append(next_id)
        next_id += 1
    stats.appended_tokens = len(new_ids)

    old["model"]["vocab"] = vocab
    old["model"]["merges"] = [list(pair) for pair in old_merges + appended]
    grown = rebuild_tokenizer(tokenizer, old)
    if len(grown) != len(tokenizer) + len(new_ids):
        raise RuntimeError(f"Merged tokenizer has {len(grown)} tokens, expected {len(tokenizer) + len(new_ids)}")
    logger.info("Vocabulary %d -> %d tokens (%s)", len(tokenizer), len(grown), stats.to_dict())
    return (grown, new_ids, stats) if return_stats else (grown, new_ids)


# ----------------------------------------------------------------------------------------------------------------
# Context length
# ----------------------------------------------------------------------------------------------------------------


def position_table_path(model: nn.Module) -> str:
    """The dotted name of the text tower's position embedding: beside the token embedding (`token_embedding_path`),
    named `position_embedding` (CLIP, SigLIP, MetaCLIP 2) or `position_embeddings` (AltCLIP's RoBERTa,
    Chinese-CLIP's BERT)."""
    token_path = getattr(model, "token_embedding_path", "text_model.embeddings.token_embedding")
    parent = token_path.rpartition(".")[0]
    for name in ("position_embedding", "position_embeddings"):
        path = f"{parent}.{name}"
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, nn.Embedding):
            return path
    raise ValueError(f"{type(model).__name__} has no learned text position table beside {token_path}: its context "
                     "cannot grow")


def resize_position_embeddings(model: nn.Module, length: int, init: PositionInit = "last", seed: int = 0) -> None:
    """Grow the text tower's position embedding so that it takes `length` tokens; the old rows are kept bit-identical.

    New positions are initialised as copies of the last trained position (`init="last"`: a frozen text tower then
    treats every position beyond the old limit like its last one) or i.i.d. N(mean, std²) with the scalar mean and
    std of the existing table (`"normal"`, TEIR's rule of spec §3.1 applied to positions). Shrinking is an error,
    and so is a context beyond `MAX_CONTEXT_LENGTH`. RoBERTa-style towers (AltCLIP) number positions from their
    padding id + 1, so their table keeps that many rows more than the tokens it takes (`max_text_positions`). The
    config (`max_position_embeddings`) and the `position_ids` / `token_type_ids` buffers follow.
    """
    if init not in POSITION_INITS:
        raise ValueError(f"init must be one of {list(POSITION_INITS)}, got {init!r}")
    check_context_length(length)
    path = position_table_path(model)
    embeddings_path, _, name = path.rpartition(".")
    embeddings = model.get_submodule(embeddings_path)
    old: nn.Embedding = getattr(embeddings, name)
    rows = old.num_embeddings
    offset = rows - int(getattr(model, "max_text_positions", rows))  # rows before the first token's position
    current = rows - offset
    if length < current:
        raise ValueError(f"Cannot shrink the context from {current} to {length} positions")
    if length == current:
        return
    weight = old.weight.detach()
    added = length - current
    if init == "last":
        new_rows = weight[-1:].expand(added, -1).clone()
    else:
        generator = torch.Generator().manual_seed(seed)
        mean, std = weight.float().mean().item(), weight.float().std().item()
        new_rows = torch.normal(mean, std, (added, weight.shape[1]), generator=generator).to(weight.dtype)
    grown = nn.Embedding(length + offset, weight.shape[1], padding_idx=old.padding_idx, device=weight.device,
                         dtype=weight.dtype)
    with torch.no_grad():
        grown.weight[:rows] = weight
        grown.weight[rows:] = new_rows.to(weight.device)
    grown.weight.requires_grad_(old.weight.requires_grad)
    setattr(embeddings, name, grown)
    for buffer in ("position_ids", "token_type_ids"):
        previous = getattr(embeddings, buffer, None)
        if isinstance(previous, torch.Tensor):  # non-persistent buffers of (1, rows); token types all 0
            values = torch.arange(length + offset) if buffer == "position_ids" else torch.zeros(length + offset)
            setattr(embeddings, buffer, values.to(previous.device, previous.dtype).expand((1, -1)))
    for config in _text_configs(model):
        config.max_position_embeddings = length + offset


def _text_configs(model: nn.Module) -> list[Any]:
    """Every distinct config object of the text tower (the model's `text_config`, the text model's own, an inner
    encoder's), so that `max_position_embeddings` stays the same in all of them."""
    config: Any = model.config  # the transformers config, which `nn.Module` does not declare
    found = {id(config.text_config): config.text_config}
    for module in model.get_submodule("text_model").modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "max_position_embeddings"):
            found[id(config)] = config
    return list(found.values())


def check_context_length(length: int, key: str = "context_length") -> None:
    """A `ValueError` naming `key` unless 2 <= `length` <= `MAX_CONTEXT_LENGTH`."""
    if not 2 <= length <= MAX_CONTEXT_LENGTH:
        raise ValueError(f"{key} must be in [2, {MAX_CONTEXT_LENGTH}] (BOS and EOS need 2; {MAX_CONTEXT_LENGTH} is "
                         f"the longest text context of released CLIP-style models), got {length}")


def set_context_length(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, length: int, init: PositionInit = "last", seed: int = 0
) -> None:
    """Make the text tower and the tokenizer take `length` tokens (BOS and EOS included): grows the position
    embedding (`resize_position_embeddings`, old rows unchanged) and sets `tokenizer.model_max_length`."""
    resize_position_embeddings(model, length, init=init, seed=seed)
    tokenizer.model_max_length = length


# ----------------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------------


def _lengths(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    return [encoding.ids for encoding in _encode(tokenizer, texts)]


def vocabulary_report(
    tokenizer_before: PreTrainedTokenizerBase,
    tokenizer_after: PreTrainedTokenizerBase,
    texts_by_language: Mapping[str, Sequence[str]],
) -> dict[str, Any]:
    """Vocabulary growth, and per language the mean tokens per caption before and after (without BOS/EOS), the
    fraction of captions whose ids changed, the fraction of tokens that are new ids, and the fraction of captions
    longer than each tokenizer's `model_max_length` (BOS and EOS included)."""
    size_before, size_after = len(tokenizer_before), len(tokenizer_after)
    report: dict[str, Any] = {
        "vocab_before": size_before,
        "vocab_after": size_after,
        "added": size_after - size_before,
        "languages": {},
    }
    for language, texts in texts_by_language.items():
        texts = [t for t in texts if isinstance(t, str)]
        if not texts:
            continue
        before, after = _lengths(tokenizer_before, texts), _lengths(tokenizer_after, texts)
        n_tokens_after = sum(len(ids) for ids in after)
        report["languages"][language] = {
            "captions": len(texts),
            "tokens_per_caption_before": sum(len(ids) for ids in before) / len(texts),
            "tokens_per_caption_after": n_tokens_after / len(texts),
            "changed_fraction": sum(a != b for a, b in zip(before, after, strict=True)) / len(texts),
            "new_token_fraction": sum(i >= size_before for ids in after for i in ids) / max(n_tokens_after, 1),
            "too_long_before": sum(len(ids) + 2 > tokenizer_before.model_max_length for ids in before) / len(texts),
            "too_long_after": sum(len(ids) + 2 > tokenizer_after.model_max_length for ids in after) / len(texts),
        }
    return report
