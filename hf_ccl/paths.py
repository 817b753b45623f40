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


#: OpenAI CLIP's BPE on the Hub: the tokenizer `shared/tokenizers/clip` holds a copy of (49,408 tokens, 77 positions).
HUB_CLIP_TOKENIZER = "openai/clip-vit-base-patch32"


def default_tokenizer_path() -> Path:
    """The real CLIP BPE tokenizer in HF format, in the shared folder."""
    return shared_root() / "tokenizers" / "clip"


def default_tokenizer_source() -> str:
    """Where the default tokenizer comes from: the shared folder's copy of OpenAI CLIP's BPE when there is one (a
    checkout), else the same tokenizer from the Hub (`HUB_CLIP_TOKENIZER`, downloaded once into the HF cache: a
    pip-installed hf_ccl has no shared folder)."""
    local = default_tokenizer_path()
    return str(local) if local.is_dir() else HUB_CLIP_TOKENIZER


def check_default_tokenizer() -> str:
    """The default tokenizer's source, checked before a run is built: the shared folder's copy, or the Hub's (its
    config fetched into the HF cache now). Raises OSError naming both ways to provide it."""
    source = default_tokenizer_source()
    if source != HUB_CLIP_TOKENIZER:
        return source
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(HUB_CLIP_TOKENIZER, "tokenizer_config.json")
    except Exception as error:  # noqa: BLE001 (offline, unreachable, refused: each says the same to the user)
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise OSError(
            f"The default tokenizer (OpenAI CLIP's BPE) is not in the shared folder ({default_tokenizer_path()}) and "
            f"could not be read from the Hub ({HUB_CLIP_TOKENIZER}: {reason}). Set {SHARED_ENV} to the folder that "
            "holds tokenizers/clip (hf_ccl's shared/ folder), allow the download once, or set `tokenizer` to a "
            "tokenizer's name or path") from error
    return source


def prompt_templates_path() -> Path:
    """CLIP_benchmark's zero-shot classification templates (JSON: dataset name -> list of templates with `{c}`)."""
    return shared_root() / "prompts" / "en_zeroshot_classification_templates.json"
