"""`load_tokenizer` reads a local tokenizer folder once and hands out copies: a copy behaves as a fresh load, changing
one changes no other, and a folder rewritten in place is read again."""

from __future__ import annotations

import time

from hf_ccl.data import load_tokenizer
from hf_ccl.paths import default_tokenizer_path

TEXT = "a photo of a zebra on the beach"


def test_each_load_is_a_copy_as_a_fresh_read(tmp_path):
    first = load_tokenizer()
    first.add_tokens(["<task-token>"])  # what a method growing the vocabulary does to its own tokenizer
    second = load_tokenizer()
    assert second is not first and len(second) == len(first) - 1
    fresh = load_tokenizer(str(default_tokenizer_path()))
    assert second(TEXT) == fresh(TEXT) and second.model_input_names == fresh.model_input_names
    assert second.name_or_path == fresh.name_or_path == str(default_tokenizer_path())


def test_a_rewritten_folder_is_read_again(tmp_path):
    folder = tmp_path / "tokenizer"
    load_tokenizer().save_pretrained(folder)
    before = load_tokenizer(folder)
    time.sleep(0.01)  # a later modification time, whatever the file system's resolution
    grown = load_tokenizer(folder)
    grown.add_tokens(["<new-language>"])
    grown.save_pretrained(folder)
    assert len(load_tokenizer(folder)) == len(before) + 1
