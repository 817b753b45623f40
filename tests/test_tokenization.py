"""The incremental tokenizer (hf_ccl.tokenization) and the token-embedding growth of `grow_vocab`, on real Flickr8k
captions: old ids and English encodings unchanged, new tokens appended and used, save/reload, EOS pooling after
growth, TEIR's initialisation statistics, context-length growth (specs/cllclip.md §2.2, §3.1, §9 A8, A12, A16)."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import load_dataset
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoTokenizer

from hf_ccl.methods.vocab import GrowVocabConfig, init_new_rows
from hf_ccl.testing import tiny_clip
from hf_ccl.tokenization import (
    extend_tokenizer,
    resize_position_embeddings,
    set_context_length,
    train_language_bpe,
    vocabulary_report,
)


def _flat(lists):
    return [caption for captions in lists for caption in captions]


@pytest.fixture(scope="module")
def captions(shared_data_root):
    """German and English train captions of the same 1,500 images, and 500 held-out English captions."""
    folder = str(shared_data_root / "flickr8k")
    train = load_dataset(folder, split="train").select_columns(["en", "de"]).with_format("arrow")[:1500]
    validation = load_dataset(folder, split="validation").select_columns(["en"]).with_format("arrow")[:100]
    rows = [(en, de) for en, de in zip(train["en"].to_pylist(), train["de"].to_pylist(), strict=True) if de]
    return {
        "de": _flat(de for _, de in rows),
        "en": _flat(en for en, _ in rows),
        "en_heldout": _flat(validation["en"].to_pylist()),
    }


@pytest.fixture(scope="module")
def german(clip_tokenizer, captions):
    """The CLIP tokenizer grown by a German BPE, with and without protecting the English captions."""
    bpe = train_language_bpe(captions["de"], 3000, clip_tokenizer)
    protected, ids, stats = extend_tokenizer(clip_tokenizer, bpe, protect_texts=captions["en"], return_stats=True)
    plain, plain_ids = extend_tokenizer(clip_tokenizer, bpe)
    return {"bpe": bpe, "grown": protected, "ids": ids, "stats": stats, "plain": plain, "plain_ids": plain_ids}


def _ids(tokenizer, texts):
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def test_language_bpe_is_clip_style_and_deterministic(clip_tokenizer, captions, german):
    bpe = german["bpe"]
    # 3000 tokens as a bare train_new_from_iterator would learn, plus the unused word-final symbols pinned at ids 2..257
    assert 3000 < len(bpe) <= 3000 + 256
    assert bpe.backend_tokenizer.model.end_of_word_suffix == "</w>"
    assert sorted(bpe.convert_ids_to_tokens(list(range(2, 258)))) == sorted(c + "</w>" for c in ByteLevel.alphabet())
    assert bpe.all_special_tokens == clip_tokenizer.all_special_tokens
    assert bpe.tokenize("Hunde") == bpe.tokenize("hunde")  # CLIP's lower-casing normalizer
    again = train_language_bpe(captions["de"], 3000, clip_tokenizer)
    assert again.get_vocab() == bpe.get_vocab()  # a resumed run regrows the same vocabulary


def test_old_ids_unchanged_and_new_tokens_appended(clip_tokenizer, german):
    old_vocab = clip_tokenizer.get_vocab()
    for grown, ids in ((german["grown"], german["ids"]), (german["plain"], german["plain_ids"])):
        vocab = grown.get_vocab()
        assert all(vocab[token] == index for token, index in old_vocab.items())
        assert ids == list(range(len(clip_tokenizer), len(grown)))
        assert len(grown) == len(clip_tokenizer) + len(ids) and len(ids) > 100
        assert grown.eos_token_id == clip_tokenizer.eos_token_id and grown.bos_token_id == clip_tokenizer.bos_token_id
        assert grown.pad_token_id == clip_tokenizer.pad_token_id
    # every appended token is one of V̂_t's, in V̂_t's id order (spec §2.2)
    bpe_vocab = german["bpe"].get_vocab()
    tokens = german["plain"].convert_ids_to_tokens(german["plain_ids"])
    assert all(token in bpe_vocab and token not in old_vocab for token in tokens)
    assert [bpe_vocab[t] for t in tokens] == sorted(bpe_vocab[t] for t in tokens)


def test_english_encodes_exactly_as_before(clip_tokenizer, captions, german):
    grown = german["grown"]
    assert _ids(grown, captions["en"]) == _ids(clip_tokenizer, captions["en"])  # protected: exact
    heldout_changed = sum(a != b for a, b in zip(_ids(grown, captions["en_heldout"]),
                                                 _ids(clip_tokenizer, captions["en_heldout"]), strict=True))
    assert heldout_changed <= 0.01 * len(captions["en_heldout"])
    assert german["stats"].protected_merges > 0  # English words inside German captions (e.g. "skateboard")
    # the paper's plain merge lets some of those merges fire on English text
    plain_changed = sum(a != b for a, b in zip(_ids(german["plain"], captions["en"]),
                                               _ids(clip_tokenizer, captions["en"]), strict=True))
    assert plain_changed > 0


def test_german_uses_the_new_tokens(clip_tokenizer, captions, german):
    report = vocabulary_report(clip_tokenizer, german["grown"], {"de": captions["de"], "en": captions["en"]})
    assert report["added"] == len(german["ids"]) == report["vocab_after"] - report["vocab_before"]
    de, en = report["languages"]["de"], report["languages"]["en"]
    assert de["tokens_per_caption_after"] < 0.9 * de["tokens_per_caption_before"]
    assert de["new_token_fraction"] > 0.05 and de["changed_fraction"] > 0.5
    assert en["changed_fraction"] == 0.0 and en["new_token_fraction"] == 0.0
    assert en["tokens_per_caption_after"] == en["tokens_per_caption_before"]


def test_save_and_reload_reproduce_ids(tmp_path, clip_tokenizer, captions, german):
    grown = german["grown"]
    grown.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(loaded) is type(grown) and len(loaded) == len(grown)
    texts = captions["de"][:200] + captions["en"][:200]
    assert _ids(loaded, texts) == _ids(grown, texts)
    assert loaded.get_vocab() == grown.get_vocab()
    for tokenizer in (grown, loaded):  # decoding joins the new tokens as CLIP's own decode does
        assert [tokenizer.decode(i) for i in _ids(tokenizer, texts[:20])] == [
            clip_tokenizer.decode(i) for i in _ids(clip_tokenizer, texts[:20])]
    # growing again from the reloaded tokenizer keeps every id of both earlier vocabularies
    french = train_language_bpe(["Un chien noir court dans la neige.", "Deux enfants jouent au ballon."] * 20, 400,
                                loaded)
    again, ids = extend_tokenizer(loaded, french)
    assert ids == list(range(len(grown), len(again)))
    assert _ids(again, captions["de"][:50]) == _ids(grown, captions["de"][:50])


def _grow_model(model, old_size, new_size, ids, seed=0):
    model.resize_token_embeddings(new_size, mean_resizing=False)
    return init_new_rows(model.get_input_embeddings().weight, ids, old_size, "teir", seed=seed)


def test_eos_pooling_and_english_embeddings_after_growth(clip_tokenizer, captions, german):
    grown, ids = german["grown"], german["ids"]
    model = tiny_clip(seed=0).eval()
    model.align_special_tokens(clip_tokenizer)
    english = clip_tokenizer(captions["en"][:8], padding=True, return_tensors="pt")
    with torch.no_grad():
        before = model.embed_texts(english.input_ids, english.attention_mask, normalize=False)
        old_rows = model.get_input_embeddings().weight.detach().clone()
    _grow_model(model, len(clip_tokenizer), len(grown), ids)
    model.align_special_tokens(grown)
    assert torch.equal(model.get_input_embeddings().weight[: len(clip_tokenizer)], old_rows)
    english_after = grown(captions["en"][:8], padding=True, return_tensors="pt")
    assert torch.equal(english_after.input_ids, english.input_ids)
    german_inputs = grown(captions["de"][:8], padding=True, return_tensors="pt")
    assert int(german_inputs.input_ids.max()) >= len(clip_tokenizer)  # ids above EOS (49407): argmax pooling breaks
    with torch.no_grad():
        after = model.embed_texts(english_after.input_ids, english_after.attention_mask, normalize=False)
        pooled = model.embed_texts(german_inputs.input_ids, german_inputs.attention_mask, normalize=False)
        hidden = model.text_model(input_ids=german_inputs.input_ids,
                                  attention_mask=german_inputs.attention_mask).last_hidden_state
    assert torch.equal(after, before)
    first_eos = (german_inputs.input_ids == grown.eos_token_id).int().argmax(dim=-1)
    expected = model.text_projection(hidden[torch.arange(len(first_eos)), first_eos])
    assert torch.allclose(pooled, expected, atol=1e-6)


def test_teir_init_matches_the_tables_scalar_statistics():
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(6, 4, generator=generator) * 1.5 + 0.4  # a small vocabulary: 6 tokens x 4 dims
    values = old.flatten().tolist()
    mean = sum(values) / len(values)  # by hand: scalar mean and unbiased std over all rows and dims
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    table = torch.cat([old, torch.zeros(5000, 4)])
    stats = init_new_rows(table, range(6, 5006), 6, "teir", seed=1)
    assert stats["mean"] == pytest.approx(mean, abs=1e-6) and stats["std"] == pytest.approx(std, abs=1e-6)
    assert torch.equal(table[:6], old)
    new = table[6:]
    n = new.numel()
    assert abs(new.mean().item() - mean) < 5 * std / math.sqrt(n)  # within 5 standard errors
    assert abs(new.std().item() - std) < 5 * std / math.sqrt(2 * (n - 1))
    fixed = torch.cat([old, torch.zeros(5000, 4)])
    init_new_rows(fixed, range(6, 5006), 6, "fixed", std=0.02, seed=1)
    assert abs(fixed[6:].mean().item()) < 5 * 0.02 / math.sqrt(n)
    assert fixed[6:].std().item() == pytest.approx(0.02, rel=0.03)
    with pytest.raises(ValueError, match="init must be one of"):
        GrowVocabConfig(init="mean")


def test_context_length_growth_keeps_old_positions(clip_tokenizer):
    model = tiny_clip(seed=0).eval()
    model.align_special_tokens(clip_tokenizer)
    old = model.text_model.embeddings.position_embedding.weight.detach().clone()
    short = clip_tokenizer(["a dog runs on the beach"], return_tensors="pt")
    with torch.no_grad():
        before = model.embed_texts(short.input_ids, short.attention_mask)
    tokenizer = AutoTokenizer.from_pretrained(clip_tokenizer.name_or_path)
    set_context_length(model, tokenizer, 120)
    weight = model.text_model.embeddings.position_embedding.weight
    assert weight.shape[0] == 120 and torch.equal(weight[:77], old)
    assert torch.equal(weight[77:], old[-1:].expand(43, -1))  # copies of the last trained position
    assert model.config.text_config.max_position_embeddings == 120 and tokenizer.model_max_length == 120
    long = tokenizer([" ".join(["dog"] * 110)], truncation=True, return_tensors="pt")
    assert long.input_ids.shape[1] == 112
    with torch.no_grad():
        assert torch.equal(model.embed_texts(short.input_ids, short.attention_mask), before)
        assert torch.isfinite(model.embed_texts(long.input_ids, long.attention_mask)).all()
    resize_position_embeddings(model, 130, init="normal", seed=0)
    assert torch.equal(model.text_model.embeddings.position_embedding.weight[:120], weight)
    with pytest.raises(ValueError, match="shrink"):
        resize_position_embeddings(model, 100)
