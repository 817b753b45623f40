"""Fingerprints of what produces an eval embedding: a tower's weights, the tokenizer, the image processor, the data.

A fingerprint is a digest plus weak references to the objects it was taken from. Two fingerprints match only when
the digests are equal and every referenced object is the very same, still alive, object (so a freed and re-allocated
model cannot pass for the old one). The digest covers:

- a tower: the model's class and config, every submodule's name and class (an injected or removed adapter), PEFT
  adapter switches (active, disabled, merged), and for each parameter and buffer of the tower its name, shape,
  dtype, device, storage pointer, autograd version counter and **the bytes of its values** (an in-place edit through
  `.data` bumps no version counter);
- a tokenizer: its class, length, special tokens, padding/truncation sides and its full serialisation;
- an image processor: its class and settings;
- an eval split: its length and `datasets` fingerprint.

The image tower is every parameter and buffer except those of the text tower, and conversely, so that modules a
method adds (a prompt, heads) count for both unless they are known to belong to one side.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

Tower = Literal["image", "text"]

#: Name parts of the parameters each tower's features never read (`get_image_features` / `get_text_features`).
_OTHER_TOWER = {
    "image": ("text_model.", "text_projection", "text_prompt."),
    "text": ("vision_model.", "visual_projection"),
}
#: Parameters neither feature function reads (the contrastive scale and bias).
_NEITHER = ("logit_scale", "logit_bias")
#: PEFT layer attributes that change a forward without changing any parameter.
_ADAPTER_SWITCHES = ("_active_adapter", "_disable_adapters", "merged_adapters", "scaling")


@dataclass(frozen=True)
class Fingerprint:
    """A digest and weak references to the objects it describes; see the module docstring."""

    digest: str
    refs: tuple[weakref.ref, ...]

    def matches(self, other: Fingerprint) -> bool:
        """Equal digests and the same live objects, in the same order."""
        if self.digest != other.digest or len(self.refs) != len(other.refs):
            return False
        for mine, theirs in zip(self.refs, other.refs, strict=True):
            target = mine()
            if target is None or target is not theirs():
                return False
        return True

    def combine(self, *others: Fingerprint, extra: Any = None) -> Fingerprint:
        """One fingerprint for several (and `extra`, any JSON-able value such as a batch size)."""
        digest = hashlib.blake2b(digest_size=16)
        for part in (self, *others):
            digest.update(part.digest.encode())
        digest.update(_json(extra).encode())
        return Fingerprint(digest.hexdigest(), tuple(ref for part in (self, *others) for ref in part.refs))


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _ref(obj: Any) -> weakref.ref:
    return weakref.ref(obj)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy().data


def _in_tower(name: str, tower: Tower) -> bool:
    parts = _OTHER_TOWER[tower] + _NEITHER
    return not any(name.startswith(part) or f".{part}" in name for part in parts)


def _tower_tensors(model: torch.nn.Module, tower: Tower) -> Iterator[tuple[str, torch.Tensor]]:
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if _in_tower(name, tower):
            yield name, parameter
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if _in_tower(name, tower):
            yield name, buffer


def _module_state(model: torch.nn.Module) -> list[Any]:
    state: list[Any] = []
    for name, module in model.named_modules(remove_duplicate=False):
        switches = {key: repr(getattr(module, key)) for key in _ADAPTER_SWITCHES if hasattr(module, key)}
        state.append([name, type(module).__qualname__, switches])
    return state


def tower_fingerprint(model: torch.nn.Module, tower: Tower) -> Fingerprint:
    """What `model.get_<tower>_features` computes with (see the module docstring)."""
    digest = hashlib.blake2b(digest_size=16)
    config: Any = getattr(model, "config", None)
    config_json = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    digest.update(_json([type(model).__module__, type(model).__qualname__, tower, config_json,
                         _module_state(model)]).encode())
    refs = [_ref(model)]
    for name, tensor in _tower_tensors(model, tower):
        digest.update(_json([name, list(tensor.shape), str(tensor.dtype), str(tensor.device), tensor.data_ptr(),
                             tensor._version]).encode())
        digest.update(_tensor_bytes(tensor))
        refs.append(_ref(tensor))
    return Fingerprint(digest.hexdigest(), tuple(refs))


def tokenizer_fingerprint(tokenizer: Any) -> Fingerprint:
    """The tokenizer's identity and everything that decides its output (a grown vocabulary changes it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        serialised = backend.to_str()
        # Every call sets the backend's truncation and padding (serialised first, then "added_tokens", the
        # normaliser, ..., the vocabulary): what the call asks for is not the tokenizer's state, so leave it out.
        start = serialised.find('"added_tokens"')
        serialised = serialised[start:] if start >= 0 else serialised
    else:
        serialised = _json(sorted(tokenizer.get_vocab().items()))
    described = [type(tokenizer).__qualname__, len(tokenizer), getattr(tokenizer, "special_tokens_map", None),
                 getattr(tokenizer, "padding_side", None), getattr(tokenizer, "truncation_side", None),
                 getattr(tokenizer, "model_max_length", None)]
    digest = hashlib.blake2b(_json(described).encode(), digest_size=16)
    digest.update(serialised.encode())
    return Fingerprint(digest.hexdigest(), (_ref(tokenizer),))


def processor_fingerprint(image_processor: Any) -> Fingerprint:
    """The image processor's identity, class and settings."""
    settings = image_processor.to_json_string() if hasattr(image_processor, "to_json_string") else repr(
        vars(image_processor))
    digest = hashlib.blake2b(_json([type(image_processor).__qualname__, settings]).encode(), digest_size=16)
    return Fingerprint(digest.hexdigest(), (_ref(image_processor),))


def dataset_fingerprint(dataset: Any, values: Iterable[Any] = ()) -> Fingerprint:
    """An eval split's identity, length and `datasets` fingerprint, with `values` (texts, class names, ...)."""
    described = [len(dataset), getattr(dataset, "_fingerprint", None), list(values)]
    return Fingerprint(hashlib.blake2b(_json(described).encode(), digest_size=16).hexdigest(), (_ref(dataset),))
