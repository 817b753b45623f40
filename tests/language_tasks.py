"""Tiny CLL-CLIP streams for tests: a few Flickr8k images, one language per task, with `texts_en` beside `texts`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hf_ccl.data import Task, TaskStream, to_canonical
from hf_ccl.data.builders import load_split


def language_stream(
    data_root: Path, languages: Sequence[str] = ("en", "de"), images: int = 8, offset: int = 0
) -> TaskStream:
    """One task per language over the same `images` Flickr8k test images (those with a caption in every language),
    train = eval; `texts` in the task's language, `texts_en` the image's English captions."""
    raw = load_split(data_root / "flickr8k", "test")
    columns = raw.select_columns(list({*languages, "en"}))
    rows = [i for i, row in enumerate(columns) if all(len(row[lang]) > 0 for lang in languages)]
    rows = rows[offset : offset + images]
    english = columns.select(rows)["en"]
    tasks = []
    for language in languages:
        data = to_canonical(raw, source="flickr8k", split="test", text_column=language, indices=rows)
        data = data.add_column("texts_en", english)
        tasks.append(Task(name=language, train=data, eval=data))
    return TaskStream("languages", tasks)
