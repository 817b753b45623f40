"""What a task checkpoint saves so that plain transformers tokenizes and preprocesses as hf_ccl did.

hf_ccl trains and evaluates each family with one text convention (`ContinualDualEncoder.text_padding` and
`text_attention_mask`, at the run's `max_length`). `save_processor` writes the family's own processor class
(`processor_class`) and carries the convention in `tokenizer_config.json`:

- `padding`, `max_length`, `truncation`: transformers merges a tokenizer's init kwargs into a processor's text
  defaults, so `AutoProcessor.from_pretrained(...)(text=..., return_tensors="pt")` pads and truncates as hf_ccl did;
- `model_input_names`: `["input_ids"]` for the families trained without an attention mask (SigLIP, SigLIP 2), so no
  processor, tokenizer or `pipeline("zero-shot-image-classification")` call passes one.

SigLIP 2: transformers 5 loads every `siglip2` checkpoint's tokenizer as `Siglip2Tokenizer`, whatever class
`tokenizer_config.json` names (`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`); it rebuilds another tokenizer's vocabulary
with Gemma's lowercasing and pieces, which gives other ids. When the run's tokenizer is of another class, the saved
`tokenizer_config.json` gets an `auto_map` naming the class: AutoTokenizer skips that forcing for a checkpoint with
an `auto_map` and, without `trust_remote_code`, ignores the entry itself and loads the class the file names
(`AUTO_MAP_NOTE`). With `trust_remote_code=True` it looks for the module's file in the repository, finds none and
says so (an OSError naming `tokenization_clip.py`, for a CLIP tokenizer).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import transformers

from .modeling import ContinualDualEncoder

logger = logging.getLogger(__name__)

TOKENIZER_CONFIG = "tokenizer_config.json"
#: Keys `from_pretrained` leaves in a tokenizer's init kwargs that describe the machine it was loaded on.
LOADING_KEYS = ("is_local", "local_files_only", "cache_dir", "revision", "_commit_hash")
#: Why a SigLIP 2 checkpoint's tokenizer_config.json has an `auto_map` (the card repeats it).
AUTO_MAP_NOTE = ("its tokenizer_config.json names the tokenizer class in `auto_map` so that transformers loads that "
                 "class instead of forcing Siglip2Tokenizer on it; load it without trust_remote_code")


def text_convention(model: ContinualDualEncoder, max_length: int) -> dict[str, Any]:
    """How the model's family tokenizes (hf_ccl's collator and evaluator): the processor defaults that reproduce it."""
    return {"padding": model.text_padding, "max_length": int(max_length), "truncation": True,
            "model_input_names": ["input_ids", "attention_mask"] if model.text_attention_mask else ["input_ids"]}


def family_processor(model: ContinualDualEncoder, image_processor: Any, tokenizer: Any) -> Any:
    """The family's processor around the run's image processor and tokenizer. A processor class whose built-in image
    defaults contradict the image processor's own settings (`Siglip2Processor`: 256 patches of 16 pixels) would
    override them when called, so such a model gets the same wrapper without defaults (`SiglipProcessor`)."""
    cls = getattr(transformers, model.processor_class)
    defaults = getattr(cls, "images_kwargs", None) or {}
    if any(getattr(image_processor, key, value) != value for key, value in defaults.items()):
        cls = transformers.SiglipProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer)


def forced_tokenizer_class(model_type: str) -> str | None:
    """The tokenizer class transformers puts on every checkpoint of `model_type` whatever its tokenizer_config.json
    says (None where it trusts the file)."""
    try:
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
    except ImportError:  # transformers 4: no forcing
        return None
    if model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS:
        return None
    return TOKENIZER_MAPPING_NAMES.get(model_type)


def needs_auto_map(model_type: str, tokenizer: Any) -> bool:
    """Whether AutoTokenizer would replace this tokenizer's class on a `model_type` checkpoint."""
    forced = forced_tokenizer_class(model_type)
    return forced is not None and forced.removesuffix("Fast") != type(tokenizer).__name__.removesuffix("Fast")


def save_processor(folder: str | Path, model: ContinualDualEncoder, image_processor: Any, tokenizer: Any,
                   max_length: int) -> None:
    """Write the family's processor (processor_config.json, the tokenizer's files, preprocessor_config.json) with the
    family's text convention in tokenizer_config.json (module docstring). The in-memory tokenizer is left as it was."""
    folder = Path(folder)
    processor_class = getattr(tokenizer, "_processor_class", None)  # the processor's save sets it
    family_processor(model, image_processor, tokenizer).save_pretrained(folder)
    tokenizer._processor_class = processor_class  # as it is on the other processes
    image_processor.save_pretrained(folder)  # preprocessor_config.json on its own too, for older transformers
    path = folder / TOKENIZER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in LOADING_KEYS:
        config.pop(key, None)
    config.update(text_convention(model, max_length))
    config.pop("auto_map", None)
    if needs_auto_map(model.config.model_type, tokenizer):
        name, module = type(tokenizer).__name__, type(tokenizer).__module__.rpartition(".")[2]
        config["auto_map"] = {"AutoTokenizer": [f"{module}.{name}", None]}  # transformers' own module, by its name
        config["tokenizer_class"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
