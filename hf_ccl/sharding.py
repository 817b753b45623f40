"""FSDP2 around one task's training: what hf_ccl adds to transformers' Trainer and accelerate, which shard the
student themselves (`accelerator.prepare` calls `fully_shard` on each wrapped layer and on the root).

A sharded student lives only while its task trains. Before the Trainer prepares it, `shard_ready` reshapes every
0-d parameter to shape `[1]` (`fully_shard` refuses scalars: CLIP's `logit_scale`; open_clip's FSDP2 recipe) and
names the layer classes each FSDP unit wraps (`wrap_classes`). When the task has trained, `gather_model` collects
the full weights on every process into a plain model of the same class, scalars squeezed back to 0-d: evaluation,
checkpoints, cards, Hub pushes and the methods' task hooks (teachers copied at task start, importances computed at
task end) see exactly what they see without FSDP, and every `task-<k>/` checkpoint has the single-process format.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .modeling import ContinualDualEncoder


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by FSDP2 (`fully_shard`)."""
    return isinstance(model, FSDPModule)


def scalars_to_vectors(model: nn.Module) -> list[str]:
    """Reshape every 0-d parameter of `model` to shape `[1]` in place (same values, same `requires_grad`); returns
    their names. Broadcasting keeps every use of them the same (`exp(logit_scale) * cos`)."""
    names = []
    for module_name, module in model.named_modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.dim() == 0:
                setattr(module, name, nn.Parameter(parameter.detach().reshape(1),
                                                   requires_grad=parameter.requires_grad))
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def wrap_classes(model: nn.Module) -> list[str]:
    """The layer classes each FSDP unit wraps by default: the model's `_no_split_modules` (transformers' own list),
    less any class that holds the token embedding (accelerate shards the input embedding as a unit of its own, and
    sharding it twice fails: `fully_shard` of an already sharded parameter)."""
    get_embedding = getattr(model, "get_input_embeddings", None)
    embedding = get_embedding() if callable(get_embedding) else None
    classes = []
    for name in getattr(model, "_no_split_modules", None) or []:
        holders = [module for module in model.modules() if type(module).__name__ == name]
        if holders and not any(embedding is inner for holder in holders for inner in holder.modules()):
            classes.append(name)
    return classes


def shard_ready(model: ContinualDualEncoder, plugin: Any) -> list[str]:
    """Ready `model` for the Trainer's FSDP2 prepare: 0-d parameters to `[1]` (`scalars_to_vectors`, their names
    returned) and, unless the user named them (`fsdp_config.transformer_layer_cls_to_wrap`), the layer classes to
    wrap (`wrap_classes`)."""
    if getattr(plugin, "transformer_cls_names_to_wrap", None) is None:
        plugin.transformer_cls_names_to_wrap = wrap_classes(model)
    return scalars_to_vectors(model)


def plain_class(model: nn.Module) -> type[nn.Module]:
    """The class `fully_shard` subclassed (`FSDP<Class>` has bases `(FSDPModule, Class)`)."""
    return next(cls for cls in type(model).__mro__ if issubclass(cls, nn.Module) and not issubclass(cls, FSDPModule))


def gather_model(model: nn.Module, scalars: list[str]) -> ContinualDualEncoder:
    """A plain (unsharded) model of `model`'s class holding its full weights, on every process (a collective call:
    every process must call it), with the `scalars` squeezed back to 0-d; `requires_grad`, buffers and train/eval
    mode as in `model`. The sharded model is left as it is (the caller drops it)."""
    full = cast(dict[str, torch.Tensor],  # every rank: full tensors
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    for name in scalars:
        full[name] = full[name].reshape(())
    cls = plain_class(model)
    config = model.config
    with torch.device("meta"):
        plain = cls(config)
    plain.load_state_dict(full, strict=True, assign=True)
    for name, buffer in model.named_buffers():  # non-persistent buffers are not in the state dict; FSDP keeps them
        if name not in full:
            owner, _, leaf = name.rpartition(".")
            holder = plain.get_submodule(owner) if owner else plain
            holder.register_buffer(leaf, buffer.detach().clone(), persistent=False)
    trainable = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    for name, parameter in plain.named_parameters():
        parameter.requires_grad_(trainable[name])
    plain.train(model.training)
    if not isinstance(plain, ContinualDualEncoder):
        raise TypeError(f"gathered a {type(plain).__name__}, not an hf_ccl dual encoder")
    return plain


def whole(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter that FSDP2 may hold as a shard (a collective call for a DTensor: every process
    must call it), shaped like `like` (a 0-d parameter FSDP2 trains as [1]); a plain tensor as it is."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value if value.shape == like.shape else value.reshape(like.shape)
