"""Loading the model a run evaluated when plain transformers loads another one.

Most methods leave task checkpoints whose weights are the model the run evaluated (LoRA merges its adapters,
learner heads fold into the projections, weight patching saves the patched weights). A method that keeps part of
the evaluated model beside the weights, in its method state (MoE-Adapters' experts, routers and auto-selector, a
learned text prompt), declares a `CheckpointLoader` (`ContinualMethod.checkpoint_loader`): the model card's
"How to use" then gives that loader first and says what plain transformers loads instead (`hf_ccl.cards`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckpointLoader:
    """The function that loads a task checkpoint as the model the run evaluated, for the model card.

    It is called as `function(name_or_path, revision=...)`: a local task folder or a Hub repository id and its
    revision (`checkpoint_folder`)."""

    module: str  #: where it is imported from, e.g. "hf_ccl.methods.moe_adapters"
    function: str  #: its name, e.g. "load_moe_model"
    keeps: str  #: what the method keeps beside the weights (markdown, a noun phrase)
    plain_model: str  #: what `from_pretrained` of the weights gives instead (markdown, a noun phrase)


def checkpoint_folder(name_or_path: str | Path, revision: str | None = None, **download_kwargs: Any) -> Path:
    """A task checkpoint's folder: a local folder as it is, else the `revision` of the Hub repository
    `name_or_path`, downloaded with `huggingface_hub.snapshot_download` (`download_kwargs` go to it)."""
    path = Path(name_or_path)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} selects a revision of a Hub repository; {path} is a local "
                             "folder (a task-<k>/ folder of a run is one revision already)")
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; give a task checkpoint folder (output_dir/task-<k>/) or a Hub repository id")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), revision=revision, **download_kwargs))
