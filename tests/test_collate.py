"""CLIPCollator on real Flickr8k rows with the real CLIP tokenizer."""

from __future__ import annotations

import hashlib

import pytest
import torch
from datasets import Dataset, Features, Image, List, Value

from hf_ccl.data import (
    CLIPCollator,
    CorruptImageError,
    load_image_processor,
    load_tokenizer,
    stable_hash,
    to_canonical,
)
from hf_ccl.data.builders import load_split

EOS, BOS = 49407, 49406


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def processor():
    return load_image_processor(32)


@pytest.fixture(scope="module")
def rows(shared_data_root) -> list[dict]:
    raw = load_split(shared_data_root / "flickr8k", "test")
    canonical = to_canonical(raw, source="flickr8k", split="test", text_column="en", indices=range(6))
    return [canonical[i] for i in range(len(canonical))]


def test_loaders(tokenizer, processor) -> None:
    assert tokenizer("a photo of a cat")["input_ids"] == [BOS, 320, 1125, 539, 320, 2368, EOS]
    assert type(processor).__name__ == "CLIPImageProcessorPil"
    assert processor.crop_size == {"height": 32, "width": 32} and processor.size == {"shortest_edge": 32}


def test_batch_shapes_and_dtypes(tokenizer, processor, rows) -> None:
    batch = CLIPCollator(processor, tokenizer)(rows)
    assert set(batch) == {"pixel_values", "input_ids", "attention_mask", "text_hash", "image_hash"}
    assert batch["pixel_values"].shape == (6, 3, 32, 32) and batch["pixel_values"].dtype == torch.float32
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 6 and batch["input_ids"].shape[1] <= 77
    assert batch["attention_mask"].sum(1).max() == batch["input_ids"].shape[1], "padding is to the longest"
    assert (batch["input_ids"][:, 0] == BOS).all()
    assert batch["text_hash"].dtype == torch.int64 and batch["image_hash"].dtype == torch.int64
    assert batch["image_hash"].tolist() == [stable_hash(row["image_id"]) for row in rows]


def test_truncation_to_max_length(tokenizer, processor, rows) -> None:
    long_row = dict(rows[0], texts=["a very long caption about a dog " * 40])
    assert CLIPCollator(processor, tokenizer).max_length == 77
    batch = CLIPCollator(processor, tokenizer, train=False)([long_row, rows[1]])
    assert batch["input_ids"].shape == (2, 77) and batch["input_ids"][0, -1] == EOS
    short = CLIPCollator(processor, tokenizer, max_length=12, train=False)([long_row, rows[1]])
    assert short["input_ids"].shape == (2, 12)
    assert short["input_ids"][0, -1] == EOS and short["attention_mask"][0].all()


def test_huge_model_max_length_is_clamped(tokenizer, processor) -> None:
    class Unlimited:
        model_max_length = int(1e30)

    assert CLIPCollator(processor, Unlimited()).max_length == 77


def test_train_sampling_is_seeded_and_varies(tokenizer, processor, rows) -> None:
    def draws(seed: int) -> list[list[str]]:
        collator = CLIPCollator(processor, tokenizer, seed=seed)
        return [collator.choose_texts(rows) for _ in range(10)]

    first = draws(3)
    assert draws(3) == first
    assert draws(4) != first
    chosen_for_row0 = {batch[0] for batch in first}
    assert len(chosen_for_row0) > 1 and chosen_for_row0 <= set(rows[0]["texts"])


def test_eval_takes_first_caption(tokenizer, processor, rows) -> None:
    collator = CLIPCollator(processor, tokenizer, train=False)
    for _ in range(3):
        assert collator.choose_texts(rows) == [row["texts"][0] for row in rows]
    batch = collator(rows)
    expected = tokenizer(rows[2]["texts"][0])["input_ids"]
    assert batch["input_ids"][2, : len(expected)].tolist() == expected


def test_hashes_mark_equal_texts(tokenizer, processor, rows) -> None:
    same = [
        dict(rows[0], texts=["a photo of a dog."]),
        dict(rows[1], texts=["a photo of a dog."]),
        dict(rows[2], texts=["a photo of a cat."]),
    ]
    batch = CLIPCollator(processor, tokenizer)(same)
    text_hash, image_hash = batch["text_hash"].tolist(), batch["image_hash"].tolist()
    assert text_hash[0] == text_hash[1] != text_hash[2]
    assert len(set(image_hash)) == 3
    digest = hashlib.blake2b(b"a photo of a dog.", digest_size=8).digest()
    assert stable_hash("a photo of a dog.") == int.from_bytes(digest, "little", signed=True) == text_hash[0]


def test_corrupt_image_names_the_row(tokenizer, processor, rows) -> None:
    broken = Dataset.from_dict(
        {
            "image": [{"bytes": b"garbage", "path": None}],
            "texts": [["x"]],
            "image_id": ["toy/train/7"],
            "label": [-1],
        },
        features=Features(
            {
                "image": Image(decode=False),
                "texts": List(Value("string")),
                "image_id": Value("string"),
                "label": Value("int64"),
            }
        ),
    )
    with pytest.raises(CorruptImageError, match="toy/train/7"):
        CLIPCollator(processor, tokenizer)([rows[0], broken[0]])


def test_works_as_dataloader_collate_fn(tokenizer, processor, shared_data_root) -> None:
    raw = load_split(shared_data_root / "pacs", "test")
    data = to_canonical(raw, source="pacs", split="test", label_column="label", indices=range(10))
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=CLIPCollator(processor, tokenizer))
    batches = list(loader)
    assert [b["pixel_values"].shape[0] for b in batches] == [4, 4, 2]


def test_missing_shared_tokenizer_without_the_hub_is_a_clear_error(tmp_path, monkeypatch):
    """No shared folder and no Hub (the tests run offline): the error names both ways to provide the tokenizer."""
    monkeypatch.setenv("HF_CCL_SHARED", str(tmp_path))
    with pytest.raises(OSError, match=r"not in the shared folder .*openai/clip-vit-base-patch32.* Set HF_CCL_SHARED"):
        load_tokenizer()


# ----- parallel captions (a teacher's English beside the task language) ---------------------------------------
def _parallel_rows(rows) -> list[dict]:
    """Row 0: one German caption beside five English ones (not sentence-parallel); row 1: as many of each."""
    first = dict(rows[0], texts=["ein Hund rennt"], texts_en=list(rows[0]["texts"]))
    second = dict(rows[1], texts=[f"Satz {i}" for i in range(len(rows[1]["texts"]))], texts_en=list(rows[1]["texts"]))
    return [first, second]


def test_parallel_captions_are_paired_and_tokenized(tokenizer, processor, rows) -> None:
    data = _parallel_rows(rows)
    plain = CLIPCollator(processor, tokenizer, seed=5)
    collator = CLIPCollator(processor, tokenizer, seed=5, parallel_text_column="texts_en")
    for _ in range(5):
        reference, batch = plain(data), collator(data)
        for key in reference:  # the task-language side is unchanged by the option
            assert torch.equal(reference[key], batch[key]), key
        english = [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch["parallel_input_ids"]]
        chosen = [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch["input_ids"]]
        index = int(chosen[1].split()[-1])  # "auto": same length -> the caption at the same index
        assert english[1] == tokenizer.decode(tokenizer(data[1]["texts_en"][index])["input_ids"], skip_special_tokens=True)
        assert english[0] in {tokenizer.decode(tokenizer(t)["input_ids"], skip_special_tokens=True)
                              for t in data[0]["texts_en"]}
        assert batch["parallel_attention_mask"].shape == batch["parallel_input_ids"].shape
        assert batch["parallel_text_hash"].tolist()[0] in {stable_hash(t) for t in data[0]["texts_en"]}
    drawn = {tuple(collator(data)["parallel_text_hash"].tolist())[0] for _ in range(20)}
    assert len(drawn) > 1  # "random" for the non-parallel row: a seeded draw among the image's English captions


def test_parallel_pairing_rules_eval_and_state(tokenizer, processor, rows) -> None:
    data = _parallel_rows(rows)
    same = dict(data[1], texts_en=data[1]["texts"])  # the English task: texts_en is texts -> x^E = x^F
    batch = CLIPCollator(processor, tokenizer, parallel_text_column="texts_en")([same])
    assert torch.equal(batch["input_ids"], batch["parallel_input_ids"])
    with pytest.raises(ValueError, match="parallel_pairing='index'"):
        CLIPCollator(processor, tokenizer, parallel_text_column="texts_en", parallel_pairing="index")(data)
    evaluation = CLIPCollator(processor, tokenizer, train=False, parallel_text_column="texts_en", parallel_pairing="random")
    assert evaluation.choose_parallel_texts(data, [0, 0]) == [data[0]["texts_en"][0], data[1]["texts_en"][0]]
    with pytest.raises(ValueError, match="no 'texts_fr' column"):
        CLIPCollator(processor, tokenizer, parallel_text_column="texts_fr")(data)
    with pytest.raises(ValueError, match="parallel_pairing"):
        CLIPCollator(processor, tokenizer, parallel_text_column="texts_en", parallel_pairing="nearest")
    collator = CLIPCollator(processor, tokenizer, seed=2, parallel_text_column="texts_en", parallel_pairing="random")
    collator(data)
    state = collator.state_dict()
    expected = [collator(data)["parallel_text_hash"].tolist() for _ in range(4)]
    restored = CLIPCollator(processor, tokenizer, seed=2, parallel_text_column="texts_en", parallel_pairing="random")
    restored.load_state_dict(state)
    assert [restored(data)["parallel_text_hash"].tolist() for _ in range(4)] == expected
    assert "parallel_rng" not in CLIPCollator(processor, tokenizer).state_dict()


def test_parallel_tokenizer_limit_holds(tokenizer, processor, rows) -> None:
    long = dict(rows[0], texts=["kurz"], texts_en=["a dog " * 60])
    collator = CLIPCollator(processor, tokenizer, max_length=100, parallel_text_column="texts_en",
                            parallel_tokenizer=tokenizer)
    batch = collator([long])
    assert batch["parallel_input_ids"].shape[1] == 77  # the teacher's tokenizer (77 positions) caps the English
