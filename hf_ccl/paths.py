"""Where the bundled data, tokenizer and prompt templates live (configurable, never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

SHARED_ENV = "HF_CCL_SHARED"
DATA_ROOT_ENV = "HF_CCL_DATA_ROOT"


def shared_root() -> Path:
    """The `shared/` folder: `$HF_CCL_SHARED`, else `../shared` beside the repository, else `./shared`."""
    if env := os.environ.get(SHARED_ENV):
        return Path(env).expanduser().resolve()
    repo_sibling = Path(__file__).resolve().parents[2] / "shared"
    for candidate in (repo_sibling, Path.cwd().parent / "shared", Path.cwd() / "shared"):
        if candidate.is_dir():
            return candidate
    return repo_sibling


def data_root() -> Path:
    """Folder of the bundled HF dataset folders: `$HF_CCL_DATA_ROOT`, else `<shared>/datasets`."""
    if env := os.environ.get(DATA_ROOT_ENV):
        return Path(env).expanduser().resolve()
    return shared_root() / "datasets"


def default_tokenizer_path() -> Path:
    """The real CLIP BPE tokenizer in HF format."""
    return shared_root() / "tokenizers" / "clip"


def prompt_templates_path() -> Path:
    """CLIP_benchmark's zero-shot classification templates (JSON: dataset name -> list of templates with `{c}`)."""
    return shared_root() / "prompts" / "en_zeroshot_classification_templates.json"
