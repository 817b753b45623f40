"""LoRA per task through PEFT (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models", ICLR;
specs/cllclip.md §5, §6 "LoRA" and §9 A17).

At the start of task k a fresh LoRA adapter named `task-<k>` is injected into the CLIP (PEFT's
`inject_adapter_in_model`, so the model stays a `ContinualCLIPModel` and the loop, Trainer and evaluation work
unchanged): every targeted linear layer W (CLIP's attention projections by default) computes

    h = W x + (alpha / r) * B A x,        A: r x d_in (Kaiming-uniform), B: d_out x r (zeros, so h = W x at start)

and only A and B train (plus the base parameters matching `trainable`). After the task the adapter is **merged**,
W <- W + (alpha / r) * B A, and its layers removed: the model that is evaluated, saved and continued from is a plain
CLIP, so each task checkpoint loads with `transformers.CLIPModel.from_pretrained`. The next task's adapter is
trained on top of the merged weights (sequential LoRA).

Every task's adapter is kept:
- in the method state (`method_state.safetensors` of each checkpoint: `adapters/<k>/<module>.lora_A.weight`, ...),
- with `save_adapters`, as a PEFT adapter folder `<output_dir>/adapters/task-<k>/` (`adapter_config.json` +
  `adapter_model.safetensors`). Its base model is the checkpoint of task k-1 (for k = 0, the model the run started
  from), written as `base_model_name_or_path`; `PeftModel.from_pretrained(CLIPModel.from_pretrained(base), folder)
  .merge_and_unload()` gives the weights of checkpoint k.

Paper vs code (§9 A17): the CLL-CLIP paper's LoRA baseline adapts the text encoder only, r = alpha = 8, one adapter
per language selected by task identity (†); its code's AdapterHub default targets q and v (the paper says k and v).
Here the default follows the issue brief: q, k, v and out projections of both towers, merged after each task (no task
identity needed at test time). The spec's setting is `towers: [text], target_modules: [q_proj, v_proj]`; with
CLL-CLIP list `lora` after `cllclip` and add `trainable: [text_model.embeddings.token_embedding.weight]` (θ_t).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..distributed import is_main_process
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .trainable import freeze_base, requires_grad_flags, restore_flags

if TYPE_CHECKING:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer


logger = logging.getLogger(__name__)

#: Each tower's encoder layers in every family: CLIP, SigLIP, MetaCLIP 2 and every vision tower
#: (`<tower>.encoder.layers`), AltCLIP's XLM-R text tower (`text_model.roberta.encoder.layers`) and Chinese-CLIP's
#: BERT text tower (`text_model.encoder.layer`).
TOWERS = {"text": r"text_model\.(roberta\.)?encoder\.layers?", "vision": r"vision_model\.encoder\.layers"}
#: Linear layers of an encoder layer that LoRA can target (attention and MLP), by their CLIP names, with where each
#: lives in a CLIP-style layer and in a BERT-style one (AltCLIP's and Chinese-CLIP's text towers).
LAYER_LINEARS = {
    "q_proj": ("self_attn.q_proj", "attention.self.query"),
    "k_proj": ("self_attn.k_proj", "attention.self.key"),
    "v_proj": ("self_attn.v_proj", "attention.self.value"),
    "out_proj": ("self_attn.out_proj", "attention.output.dense"),
    "fc1": ("mlp.fc1", "intermediate.dense"),
    "fc2": ("mlp.fc2", "output.dense"),
}
CLIP_LINEAR_MODULES = tuple(LAYER_LINEARS)
ADAPTERS_DIR = "adapters"
#: The key prefix of a PeftModel's saved adapter weights (`PeftModel.from_pretrained` expects it).
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def run_folder(context: TaskContext) -> Path:
    """The run's output folder, where task checkpoints and saved adapters live."""
    if context.output_dir is None:
        raise ValueError("lora needs the run's output_dir (its task checkpoints hold the base models)")
    return Path(context.output_dir)


def adapter_name(task_index: int) -> str:
    """The PEFT adapter name of task `task_index`: `task-<k>`."""
    return f"task-{task_index}"


def target_module_regex(towers: list[str], target_modules: list[str]) -> str:
    """A PEFT `target_modules` regex (full match on module names) for `target_modules` (CLIP names) in the encoder
    layers of `towers`, matching every family's layout (`TOWERS`, `LAYER_LINEARS`)."""
    prefixes = "|".join(TOWERS[t] for t in towers)
    names = "|".join(re.escape(path) for module in target_modules for path in LAYER_LINEARS[module])
    return rf"({prefixes})\.\d+\.({names})"


@dataclass
class LoRAMethodConfig(MethodConfig):
    r: int = field(default=8, metadata={"help": "LoRA rank (spec §5: 8)."})
    alpha: float = field(default=8.0, metadata={"help": "LoRA alpha; the update is scaled by alpha / r (spec §5: 8)."})
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch's input."})
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj"],
        metadata={"help": f"Linear layers of each encoder layer to adapt, among {list(CLIP_LINEAR_MODULES)} "
                          "(spec §9 A17, the CLL-CLIP code: [q_proj, v_proj])."},
    )
    towers: list[str] = field(
        default_factory=lambda: ["text", "vision"],
        metadata={"help": "Towers whose encoder layers get adapters: text and/or vision (CLL-CLIP: [text])."},
    )
    trainable: list[str] = field(
        default_factory=list,
        metadata={"help": "fnmatch patterns of base parameters that also train (e.g. "
                          "'text_model.embeddings.token_embedding.weight' beside CLL-CLIP; '*' trains everything). "
                          "All other base parameters are frozen while a task trains."},
    )
    save_adapters: bool = field(
        default=True,
        metadata={"help": "Also write each task's adapter as a PEFT folder <output_dir>/adapters/task-<k>/."},
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"lora r must be >= 1, got {self.r}")
        check_range("alpha", self.alpha, 0, low_open=True)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.towers) - set(TOWERS))
        if unknown or not self.towers:
            raise ValueError(f"lora towers must be a non-empty subset of {sorted(TOWERS)}, got {self.towers}")
        bad = sorted(set(self.target_modules) - set(CLIP_LINEAR_MODULES))
        if bad or not self.target_modules:
            raise ValueError(f"lora target_modules must be a non-empty subset of {list(CLIP_LINEAR_MODULES)}, got "
                             f"{self.target_modules}")

    def to_peft(self, base_model_name_or_path: str | None = None) -> LoraConfig:
        """The equivalent `peft.LoraConfig`."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # peft annotates it int; it only divides it by r
            lora_dropout=self.dropout,
            target_modules=target_module_regex(self.towers, self.target_modules),
            bias="none",
            base_model_name_or_path=base_model_name_or_path,
        )


# ----------------------------------------------------------------------------------------------------------------
# Functional pieces: inject, read, merge, save and reload an adapter
# ----------------------------------------------------------------------------------------------------------------
def inject_lora(model: nn.Module, peft_config: LoraConfig, name: str = "default") -> nn.Module:
    """Inject a fresh LoRA adapter `name` into `model` in place (PEFT `inject_adapter_in_model`); returns `model`.

    PEFT leaves only the adapter's parameters trainable.
    """
    from peft import inject_adapter_in_model

    if lora_layers(model):
        raise ValueError("The model already holds LoRA layers: merge or remove them before injecting a new adapter")
    injected = inject_adapter_in_model(peft_config, model, adapter_name=name)
    if not lora_layers(injected):
        raise ValueError(f"LoRA target_modules {peft_config.target_modules!r} matched no layer of the model")
    return injected


def lora_layers(model: nn.Module) -> dict[str, BaseTunerLayer]:
    """The PEFT tuner layers in `model`, by module name."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}


def adapter_state(model: nn.Module, name: str = "default") -> dict[str, torch.Tensor]:
    """The weights of adapter `name` as CPU tensors, keyed as PEFT saves them without the `base_model.model.`
    prefix and the adapter name (`text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight`)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    return {key: tensor.detach().to("cpu", copy=True).contiguous() for key, tensor in state.items()}


def merge_lora(model: nn.Module, name: str = "default") -> nn.Module:
    """Merge adapter `name` into the base weights (W <- W + scale * B A, PEFT's `merge` with a NaN check) and put
    the plain base layers back in place of the LoRA layers; returns `model`, free of PEFT modules."""
    for module_name, layer in lora_layers(model).items():
        layer.merge(safe_merge=True, adapter_names=[name])
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    if "peft_config" in model.__dict__:  # set by inject_adapter_in_model; gone with the layers
        del model.peft_config
    return model


def apply_adapter(
    model: nn.Module, peft_config: LoraConfig, state: Mapping[str, torch.Tensor], merge: bool = True
) -> nn.Module:
    """Inject an adapter with saved weights (`adapter_state` keys) into `model` and, with `merge`, fold it into the
    base weights: `model` becomes the model that adapter's task deployed, given the base it was trained from."""
    from peft import set_peft_model_state_dict

    inject_lora(model, peft_config, "default")
    result = set_peft_model_state_dict(model, dict(state), adapter_name="default")
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"Adapter weights do not match the model: unexpected keys {unexpected[:5]}")
    return merge_lora(model, "default") if merge else model


def save_adapter_folder(folder: str | Path, peft_config: LoraConfig, state: Mapping[str, torch.Tensor]) -> Path:
    """Write a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) that
    `peft.PeftModel.from_pretrained(base_model, folder)` loads."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(folder))
    tensors = {PEFT_PREFIX + key: tensor.contiguous() for key, tensor in state.items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return folder


def load_adapter_folder(folder: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """Read a folder written by `save_adapter_folder` (or `PeftModel.save_pretrained`): the config and the weights
    keyed as `adapter_state` keys them."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(folder)
    config = LoraConfig.from_pretrained(str(folder))
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    return config, {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in tensors.items()}


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@register_method
class LoRA(ContinualMethod[LoRAMethodConfig]):
    """A fresh LoRA adapter per task, merged into the base weights after the task (see the module docstring)."""

    fsdp_refusal = ("its PEFT adapters wrap the model, and the plain model the loop gathers after each task would not "
                    "carry them")
    name = "lora"
    test_families = ("altclip",)
    config_class = LoRAMethodConfig
    roles = {
        "previous_model": "adapts the previous task's model",
        "parameter_efficient": "freezes the model but for its adapter (and `trainable`) during each task",
    }
    conflicts = {"parameter_efficient": "freezes the model but for its adapter: each would freeze the other's "
                 "parameters"}

    def __init__(self, config: LoRAMethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}  # task index -> adapter weights (CPU)
        self.base_models: dict[int, str | None] = {}  # task index -> the checkpoint the adapter was trained on
        self._flags: dict[str, bool] = {}  # requires_grad of the base parameters before the task

    def peft_config(self, task_index: int | None = None) -> LoraConfig:
        """The `peft.LoraConfig` of this method (with the base checkpoint of task `task_index`, if known)."""
        base = self.base_models.get(task_index) if task_index is not None else None
        return self.config.to_peft(base_model_name_or_path=base)

    def check_model(self, model: nn.Module) -> None:
        """`r` may not exceed the rank of the layers it adapts (min(d_in, d_out) of the smallest targeted linear):
        B A has at most that rank, so a larger r adds parameters and memory, not expressiveness. The targets must
        match a layer of the model."""
        key = f"method_args.{self.name}"
        pattern = re.compile(target_module_regex(self.config.towers, self.config.target_modules))
        targets = {name: module for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and pattern.fullmatch(name.removesuffix(".base_layer"))}
        if not targets:
            raise ConfigError(f"{key}: target_modules {self.config.target_modules} of towers {self.config.towers} "
                              f"match no linear layer of the {type(model).__name__}", f"{key}.target_modules")
        name, layer = min(targets.items(), key=lambda item: min(item[1].in_features, item[1].out_features))
        rank = min(layer.in_features, layer.out_features)
        if self.config.r > rank:
            raise ConfigError(f"{key}.r={self.config.r} exceeds the rank of the layers it adapts: {name} is "
                              f"{layer.out_features} x {layer.in_features} (rank <= {rank}), and a larger r adds "
                              f"parameters, not expressiveness: set r <= {rank}", f"{key}.r")

    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        index = context.task_index
        self.check_model(model)
        self._flags = requires_grad_flags(model)
        if index == 0:
            base = getattr(model.config, "_name_or_path", None) or None
        else:
            base = str(run_folder(context) / f"task-{index - 1}")
        self.base_models[index] = base
        inject_lora(model, self.peft_config(index), adapter_name(index))
        freeze_base(model, self.trainable_patterns(model), is_own=lambda name: ".lora_" in name)

    def trainable_patterns(self, model: nn.Module) -> list[str]:  # noqa: ARG002 - subclasses read the model
        """fnmatch patterns of the base parameters that train beside the adapter (`trainable`)."""
        return list(self.config.trainable)

    def after_training(self, context: TaskContext) -> None:
        model = context.model
        index = context.task_index
        name = adapter_name(index)
        self.adapters[index] = adapter_state(model, name)
        merge_lora(model, name)
        restore_flags(model, self._flags)
        if self.config.save_adapters and is_main_process():
            folder = run_folder(context) / ADAPTERS_DIR / name
            save_adapter_folder(folder, self.peft_config(index), self.adapters[index])

    def state_dict(self) -> dict[str, Any]:
        return {
            "adapters": {str(k): dict(v) for k, v in sorted(self.adapters.items())},
            "base_models": {str(k): v for k, v in sorted(self.base_models.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adapters = {int(k): dict(v) for k, v in state.get("adapters", {}).items()}
        self.base_models = {int(k): v for k, v in state.get("base_models", {}).items()}
