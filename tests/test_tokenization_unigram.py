"""Vocabulary growth on a SentencePiece (Unigram) tokenizer, as SigLIP and XLM-R (AltCLIP) have: no such tokenizer
is bundled or downloadable, so a small one is trained offline on English Flickr8k captions with SentencePiece's
normalizer and pre-tokenizer (`▁` word marks), as ENVIRONMENT.md suggests."""

from __future__ import annotations

import pytest
import torch
from language_tasks import language_stream
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import Unigram
from tokenizers.trainers import UnigramTrainer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data.builders import load_split
from hf_ccl.families import default_image_processor
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_model
from hf_ccl.tokenization_unigram import extend_unigram_tokenizer, tokenizer_model_type, train_language_unigram

SPECIALS = ["<pad>", "</s>", "<unk>"]


@pytest.fixture(scope="module")
def flickr(shared_data_root):
    return load_split(shared_data_root / "flickr8k", "train").select(range(600))


@pytest.fixture(scope="module")
def sentencepiece(flickr) -> PreTrainedTokenizerFast:
    """A 600-piece Unigram tokenizer on English captions, with SigLIP's specials (pad, eos, unk)."""
    backend = Tokenizer(Unigram())
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    texts = [caption for row in flickr["en"] for caption in row]
    backend.train_from_iterator(texts, UnigramTrainer(vocab_size=600, special_tokens=SPECIALS, unk_token="<unk>",
                                                      show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=32)


def german(flickr) -> list[str]:
    return [caption for row in flickr["de"] for caption in row]


def english(flickr) -> list[str]:
    return [caption for row in flickr["en"] for caption in row][:300]


def test_growing_a_unigram_keeps_every_old_id_and_protected_texts_exact(sentencepiece, flickr, tmp_path):
    assert tokenizer_model_type(sentencepiece) == "Unigram"
    language = train_language_unigram(german(flickr), 400, sentencepiece)
    plain, plain_ids, _ = extend_unigram_tokenizer(sentencepiece, language)
    grown, new_ids, stats = extend_unigram_tokenizer(sentencepiece, language, protect_texts=english(flickr))
    old = len(sentencepiece)
    assert new_ids == list(range(old, len(grown))) and stats["appended_tokens"] == len(new_ids) > 50
    assert plain_ids == list(range(old, len(plain))) and len(plain) >= len(grown)
    assert grown.convert_ids_to_tokens(list(range(old))) == sentencepiece.convert_ids_to_tokens(list(range(old)))
    # English keeps its exact ids (the protection dropped the pieces that would have changed them) ...
    before = sentencepiece(english(flickr), add_special_tokens=False)["input_ids"]
    assert grown(english(flickr), add_special_tokens=False)["input_ids"] == before
    assert stats["protected_pieces"] > 0
    assert plain(english(flickr), add_special_tokens=False)["input_ids"] != before  # ... which the plain union drifts
    # German captions get shorter with the new pieces
    de = german(flickr)[:200]
    lengths = [sum(len(ids) for ids in t(de, add_special_tokens=False)["input_ids"]) for t in (sentencepiece, grown)]
    assert lengths[1] < 0.9 * lengths[0]
    grown.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(de)["input_ids"] == grown(de)["input_ids"]


def test_min_frequency_is_refused_for_a_unigram(sentencepiece, shared_data_root, tmp_path):
    learner = _learner(sentencepiece, shared_data_root, tmp_path, {"grow_vocab": {"vocab_size": 300, "min_frequency": 2}})
    with pytest.raises(ValueError, match="min_frequency is the BPE trainer's"):
        learner.fit()


@pytest.mark.parametrize("family", ["siglip", "altclip"])
def test_grow_vocab_and_teir_on_a_sentencepiece_family(sentencepiece, shared_data_root, tmp_path, family):
    """SigLIP (and AltCLIP) with a SentencePiece tokenizer: English, then German with a grown vocabulary initialised
    by TEIR; the new rows get TEIR's N(mean, std) init and the checkpoint's tokenizer reloads with the grown ids."""
    learner = _learner(sentencepiece, shared_data_root, tmp_path, {"grow_vocab": {"vocab_size": 300}},
                       family=family, methods=["grow_vocab", "teir"])
    learner.fit()
    grown = learner.tokenizer
    assert len(grown) > len(sentencepiece)
    assert learner.model.get_input_embeddings().num_embeddings == len(grown)
    saved = AutoTokenizer.from_pretrained(tmp_path / "task-1")
    assert saved("ein Hund läuft")["input_ids"] == grown("ein Hund läuft")["input_ids"]
    assert torch.isfinite(learner.model.get_input_embeddings().weight).all()
    assert len(learner.results.rows) == 2


def _learner(tokenizer, data_root, output_dir, method_args, family: str = "siglip", methods=("grow_vocab",)):
    model = tiny_model(family, seed=0, vocab_size=len(tokenizer), max_position_embeddings=32,
                       bos_token_id=1, eos_token_id=1, pad_token_id=0)
    args = ContinualArguments(output_dir=str(output_dir), progress=False, evaluation={"initial": False},
                              training={"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3})
    return ContinualLearner(model, language_stream(data_root, ("en", "de"), images=16),
                            build_methods(list(methods), method_args), default_image_processor(model), tokenizer, args)
