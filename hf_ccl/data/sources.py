"""Reading one split of a data source, as a `Dataset` or as a stream.

A data source is one of:

- a `datasets.Dataset` (one split) or `DatasetDict`;
- one data file: `.parquet`, `.csv`, `.tsv`, `.json` or `.jsonl` (read with `datasets`' packaged builders). A file
  holds one split, whatever split name is asked for: give the eval data as a source of its own;
- a local dataset folder (`load_dataset(folder)`: data files, `imagefolder`, ...) or a `save_to_disk` folder;
- a Hub dataset id.

A string that looks like a local path (absolute, starting with `.` or `~`, with a data-file suffix, or with two or
more `/`) and does not exist is an error, never a Hub lookup.

Image paths inside a source's rows (a string column of paths, or `datasets.Image` cells that hold only a path)
resolve against `image_base(source, split)`: the folder of the data file for a file, the folder of the split's
data files for a dataset folder, the folder itself for a `save_to_disk` folder, the working directory for a
`Dataset` built in this process; a Hub dataset's relative paths cannot be resolved.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeAlias

from datasets import Dataset, DatasetDict, IterableDataset, load_dataset, load_dataset_builder, load_from_disk

from .images import PathBase

DatasetSource: TypeAlias = "Dataset | DatasetDict | str | os.PathLike[str]"
#: Single data files, by suffix: the `datasets` packaged builder that reads them and its options.
DATA_FILE_READERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
}
SOURCE_KINDS = (
    "a `datasets.Dataset`/`DatasetDict`, a .parquet, .csv, .tsv, .json or .jsonl file, a dataset folder, "
    "a `save_to_disk` folder or a Hub dataset id"
)
_SAVED_DATASET, _SAVED_DICT = "state.json", "dataset_dict.json"  # the files `save_to_disk` writes


# ----------------------------------------------------------------------------------------------------------------
# What a source is
# ----------------------------------------------------------------------------------------------------------------


def _looks_like_path(text: str) -> bool:
    return (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or Path(text).suffix.lower() in DATA_FILE_READERS
        or text.replace(os.sep, "/").count("/") >= 2
    )


def local_path(data: Any) -> Path | None:
    """The local file or folder a source names, or None (a dataset object or a Hub id).

    Raises `FileNotFoundError` for a path that does not exist and `ValueError` for a file that is not a data file.
    """
    if not isinstance(data, (str, os.PathLike)):
        return None
    text = os.fspath(data)
    path = Path(text).expanduser()
    if not path.exists():
        if isinstance(data, os.PathLike) or _looks_like_path(text):
            raise FileNotFoundError(f"Data source {text!r} not found: expected {SOURCE_KINDS}")
        return None
    if path.is_file() and path.suffix.lower() not in DATA_FILE_READERS:
        raise ValueError(
            f"Data file {str(path.resolve())!r} has suffix {path.suffix!r}; expected one of "
            f"{', '.join(DATA_FILE_READERS)} (or a dataset folder, a save_to_disk folder or a Hub dataset id)"
        )
    return path.resolve()


def is_single_split(data: DatasetSource) -> bool:
    """Whether a source holds one split only (a `Dataset`, a data file, a `save_to_disk` folder of a `Dataset`)."""
    if isinstance(data, Dataset):
        return True
    path = local_path(data)
    return path is not None and (path.is_file() or (path / _SAVED_DATASET).is_file())


def is_path_source(data: DatasetSource) -> bool:
    """Whether a source is read from files or the Hub (a path or an id), not a dataset object in memory."""
    return isinstance(data, (str, os.PathLike))


def reads_as_stream(data: DatasetSource) -> bool:
    """Whether `stream_split` reads a source lazily from its files: a data file, a dataset folder or a Hub id (a
    dataset object or a `save_to_disk` folder is already Arrow: it streams through `Dataset.to_iterable_dataset`)."""
    if not is_path_source(data):
        return False
    path = local_path(data)
    return path is None or path.is_file() or not ((path / _SAVED_DATASET).is_file() or (path / _SAVED_DICT).is_file())


def source_name(data: DatasetSource, default: str = "dataset") -> str:
    """A short name for a data source, used in image ids and error messages (a file's or folder's name, a Hub
    id)."""
    if isinstance(data, (str, os.PathLike)):
        path = local_path(data)
        return path.name if path is not None else os.fspath(data)
    if isinstance(data, DatasetDict):
        data = next(iter(data.values()))
    return data.info.dataset_name or default


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------


def _reader(path: Path) -> tuple[str, dict[str, Any]]:
    return DATA_FILE_READERS[path.suffix.lower()]


@lru_cache(maxsize=32)
def _load_path(path: str, split: str, version: tuple[int, int] | None) -> Dataset:
    """`version` (a file's mtime and size) keys the cache, so that a rewritten file is read again."""
    del version
    local = Path(path)
    if local.is_file():
        return _read_data_file(local)
    if (local / _SAVED_DATASET).is_file():
        return load_from_disk(path)
    if (local / _SAVED_DICT).is_file():
        saved = load_from_disk(path)
        if split not in saved:
            raise ValueError(f"Dataset folder {path!r} (save_to_disk) has no split {split!r}; splits: {', '.join(saved)}")
        return saved[split]
    return _with_split_error(path, split, lambda: load_dataset(path, split=split))


def _read_data_file(path: Path) -> Dataset:
    """A data file's rows; an empty or unreadable file is a `ValueError` naming it and what is wrong with it."""
    if path.stat().st_size == 0:
        raise ValueError(f"Data file {str(path)!r} is empty (0 bytes): give a file with rows")
    builder, options = _reader(path)
    try:
        return load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as error:  # datasets wraps the reader's error (pyarrow, pandas, json) in its own types
        cause = _root_cause(error)
        if _parquet_rows(path) == 0 or "corresponds to no data" in cause:  # (datasets' words for a header only)
            raise ValueError(f"Data file {str(path)!r} has no rows: give a file with rows") from error
        raise ValueError(f"Data file {str(path)!r} cannot be read as {builder}: {cause}") from error


def _parquet_rows(path: Path) -> int | None:
    """Rows of a parquet file by its footer; None for another file or an unreadable footer."""
    if _reader(path)[0] != "parquet":
        return None
    import pyarrow.parquet as pq

    try:
        return int(pq.read_metadata(path).num_rows)
    except Exception:  # not a parquet file after all: the caller reports the reader's error
        return None


def _root_cause(error: BaseException) -> str:
    """The innermost cause of a chained exception, as `Type: message` (the reader's own words)."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return f"{type(error).__name__}: {error}"


def _with_split_error(name: str, split: str, read: Any) -> Any:
    try:
        return read()
    except ValueError as error:
        if "Unknown split" not in str(error):
            raise
        raise ValueError(
            f"Dataset {name!r} has no split {split!r} ({error}); set train_split/eval_split, or give the eval data "
            "as a source of its own (`eval`)"
        ) from None


def load_split(data: DatasetSource, split: str) -> Dataset:
    """One split of a data source (see the module docstring): a `Dataset` as is, a `DatasetDict`'s split, a data
    file's rows (whatever `split` is), or `load_dataset(path, split=split)`."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, DatasetDict):
        if split not in data:
            raise KeyError(f"DatasetDict has no split {split!r}; splits: {', '.join(data)}")
        return data[split]
    if isinstance(data, (str, os.PathLike)):
        path = local_path(data)
        if path is None:
            cached = _load_path(os.fspath(data), split, None)
        else:
            stat = path.stat()
            cached = _load_path(str(path), split, (stat.st_mtime_ns, stat.st_size) if path.is_file() else None)
        return cached.with_format(None)  # a fresh object: callers may set formats without touching the cache
    raise TypeError(f"Unsupported data source of type {type(data).__name__}; expected {SOURCE_KINDS}")


def stream_split(data: str | os.PathLike, split: str) -> IterableDataset:
    """One split of a data file, dataset folder or Hub id read as a stream (`load_dataset(..., streaming=True)`):
    rows are read as they are consumed (see `reads_as_stream`)."""
    if not reads_as_stream(data):
        raise ValueError(f"{data!r} is not read as a stream: use load_split(...).to_iterable_dataset()")
    path = local_path(data)
    if path is not None and path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"Data file {str(path)!r} is empty (0 bytes): give a file with rows")
        builder, options = _reader(path)
        return load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
    name = str(path) if path is not None else os.fspath(data)
    return _with_split_error(name, split, lambda: load_dataset(name, split=split, streaming=True))


# ----------------------------------------------------------------------------------------------------------------
# Where relative image paths point
# ----------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _folder_base(folder: str, split: str) -> PathBase:
    files = load_dataset_builder(folder).config.data_files or {}
    parents = sorted({str(Path(str(f)).parent) for f in files.get(split, [])})
    if len(parents) == 1:
        shown = [str(f) for f in files[split]]
        origin = shown[0] if len(shown) == 1 else f"{parents[0]} ({len(shown)} data files)"
        return PathBase(Path(parents[0]), origin)
    return PathBase(
        None, f"dataset folder {folder}, split {split!r}",
        f"its data files lie in {len(parents)} folders ({', '.join(parents[:3])}), so a relative path is ambiguous",
    )


def image_base(data: DatasetSource, split: str) -> PathBase:
    """Where relative image paths in a split of `data` resolve, and how errors name the split's origin."""
    if isinstance(data, (Dataset, DatasetDict)):
        return PathBase(Path.cwd(), f"dataset {source_name(data)!r}, split {split!r}")
    path = local_path(data)
    if path is None:
        return PathBase(None, f"Hub dataset {os.fspath(data)!r}, split {split!r}",
                        "a Hub dataset's relative paths cannot be resolved on this machine")
    if path.is_file():
        return PathBase(path.parent, str(path))
    if (path / _SAVED_DATASET).is_file() or (path / _SAVED_DICT).is_file():
        return PathBase(path, f"{path} (save_to_disk), split {split!r}")
    return _folder_base(str(path), split)
