"""CoOp-style prompt learning on CLIP's text tower (Zhou et al. 2022, "Learning to Prompt for Vision-Language
Models", IJCV; the learned-context baseline of specs/cllclip.md §6, ENVIRONMENT.md "PEFT and tokenizers").

`n_ctx` context vectors v_1..v_M (width = the text tower's hidden size) are inserted after BOS in every text:

    [BOS] v_1 ... v_M  w_1 ... w_L [EOS] [PAD]...

and the sequence runs through CLIP's own text path: `text_model.embeddings(inputs_embeds=...)` (token + position
embeddings), the encoder with the causal and padding mask, the final layer norm, pooling at the EOS position shifted
by M, then `text_projection`. Texts are truncated so that M + their length fits `max_position_embeddings` (the last
kept position becomes the EOS). With M = 0 it is exactly `CLIPModel.get_text_features`.

PEFT's prompt methods (PromptTuning, P-Tuning, PrefixTuning) cannot be used: CLIP's text model takes `input_ids`
only. The prompt is therefore a small module of its own, hooked into the model through
`ContinualCLIPModel.text_prompt`, which the text feature path consults everywhere: training (the model's forward),
evaluation (`encode_texts` calls `get_text_features`), `embed_texts`, teachers copied from the model.

**Per task.** `schedule: per_task` (default) starts a fresh prompt at every task, task-specific like the spec's
prompt baselines (one per language; without task identity at test time the latest one is deployed);
`schedule: shared` continues one prompt through all tasks. Either way the prompt after every task is kept in the
method state (`prompts/<k>`); `deployed` is the one in use.

**Checkpoints.** The base CLIP is frozen (`trainable` can free more), so every task checkpoint's `model.safetensors`
holds the unchanged CLIP: the prompt is NOT in it, but in the method state beside it. It is needed at inference:
`load_prompted_model(checkpoint_dir)` returns the CLIP with its prompt attached; `load_prompt(checkpoint_dir)` the
prompt alone (`model.text_prompt = prompt`). The Trainer's mid-task checkpoints do not hold it in their weights
either (transformers logs "missing keys ['text_prompt.ctx']" when a task resumes from one); the method state saved
beside them carries the prompt being trained, and resuming restores it exactly.

**With CLL-CLIP** (language streams): list `prompt` after `cllclip` and add
`trainable: [text_model.embeddings.token_embedding.weight]` so θ_t trains beside the prompt.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..tokenization import MAX_CONTEXT_LENGTH
from ..validation import ConfigError
from .base import ContinualMethod, MethodConfig, TaskContext
from .loading import CheckpointLoader, checkpoint_folder
from .registry import register_method
from .state import STATE_JSON, load_method_states
from .trainable import freeze_base, requires_grad_flags, restore_flags

if TYPE_CHECKING:
    from transformers import CLIPTextModel

    from ..modeling import ContinualCLIPModel

SCHEDULES = ("per_task", "shared")
LEGACY_EOS_TOKEN_ID = 2


def pooling_positions(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Where `CLIPTextModel` pools each row: the first `eos_token_id` (or, with the legacy id 2, `argmax`)."""
    ids = input_ids.to(dtype=torch.int)
    if eos_token_id == LEGACY_EOS_TOKEN_ID:
        return ids.argmax(dim=-1)
    return (ids == eos_token_id).int().argmax(dim=-1)


def fit_length(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, room: int, eos_token_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Truncate token rows to `room` positions, keeping each row's pooled token (EOS) as its last one.

    Rows whose pooled token lies at or beyond `room` lose their last content tokens and get that token at `room - 1`
    (as a tokenizer truncating to `room` would give); shorter rows only lose padding.
    """
    if input_ids.shape[1] <= room:
        return input_ids, attention_mask
    if room < 2:
        raise ValueError(f"No room for the text: {room} positions left after the prompt (BOS and EOS need 2)")
    pool = pooling_positions(input_ids, eos_token_id).to(input_ids.device)
    long_rows = (pool >= room).nonzero(as_tuple=True)[0]
    ids = input_ids[:, :room].clone()
    ids[long_rows, room - 1] = input_ids[long_rows, pool[long_rows]]
    mask = attention_mask[:, :room] if attention_mask is not None else None
    return ids, mask


class TextPrompt(nn.Module):
    """Learned context vectors inserted after BOS; called by `ContinualCLIPModel.get_text_features`.

    `forward(text_model, input_ids, attention_mask)` returns the text tower's output (`last_hidden_state` with the
    context positions, `pooler_output` before `text_projection`), exactly as `CLIPTextModel` computes it.
    """

    def __init__(self, n_ctx: int, hidden_size: int, init_std: float = 0.02, ctx: torch.Tensor | None = None):
        super().__init__()
        if ctx is None:
            ctx = torch.empty(n_ctx, hidden_size).normal_(0.0, init_std)
        if tuple(ctx.shape) != (n_ctx, hidden_size):
            raise ValueError(f"Context of shape {tuple(ctx.shape)}, expected ({n_ctx}, {hidden_size})")
        self.ctx = nn.Parameter(ctx.detach().clone())

    @property
    def n_ctx(self) -> int:
        return self.ctx.shape[0]

    def forward(
        self, text_model: CLIPTextModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> BaseModelOutputWithPooling:
        from transformers.masking_utils import create_causal_mask

        n = self.n_ctx
        eos = text_model.eos_token_id
        if not isinstance(eos, int):
            raise ValueError(f"the text tower pools at one EOS id, it has {eos!r}: call model.align_special_tokens")
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        room = text_model.embeddings.position_embedding.num_embeddings - n
        input_ids, attention_mask = fit_length(input_ids, attention_mask, room, eos)
        batch = input_ids.shape[0]

        tokens = text_model.embeddings.token_embedding(input_ids)
        ctx = self.ctx.to(tokens.dtype).unsqueeze(0).expand(batch, -1, -1)
        embeds = torch.cat([tokens[:, :1], ctx, tokens[:, 1:]], dim=1)
        if attention_mask is not None:
            ones = attention_mask.new_ones(batch, n)
            attention_mask = torch.cat([attention_mask[:, :1], ones, attention_mask[:, 1:]], dim=1)

        hidden_states = text_model.embeddings(inputs_embeds=embeds)
        mask = create_causal_mask(
            config=text_model.config, inputs_embeds=hidden_states, attention_mask=attention_mask, past_key_values=None
        )
        encoded = text_model.encoder(inputs_embeds=hidden_states, attention_mask=mask, is_causal=True)
        last_hidden_state = text_model.final_layer_norm(encoded.last_hidden_state)
        positions = pooling_positions(input_ids, eos).to(last_hidden_state.device) + n
        pooled = last_hidden_state[torch.arange(batch, device=last_hidden_state.device), positions]
        return BaseModelOutputWithPooling(last_hidden_state=last_hidden_state, pooler_output=pooled)

    def extra_repr(self) -> str:
        return f"n_ctx={self.n_ctx}, hidden_size={self.ctx.shape[1]}"


@dataclass
class PromptConfig(MethodConfig):
    n_ctx: int = field(
        default=16, metadata={"help": "Number of learned context vectors after BOS (CoOp: 16); ignored with ctx_init."}
    )
    ctx_init: str | None = field(
        default=None,
        metadata={"help": "Initialise the context from this phrase's token embeddings (CoOp: 'a photo of a'); "
                          "n_ctx becomes its token count. None: N(0, init_std^2)."},
    )
    init_std: float = field(default=0.02, metadata={"help": "Std of the random context init (CoOp: 0.02)."})
    schedule: str = field(
        default="per_task",
        metadata={"help": "'per_task': a fresh prompt at every task (task-specific, the latest deployed); "
                          "'shared': one prompt continued through all tasks."},
    )
    trainable: list[str] = field(
        default_factory=list,
        metadata={"help": "fnmatch patterns of base parameters that also train (e.g. "
                          "'text_model.embeddings.token_embedding.weight'; '*' trains everything). All other base "
                          "parameters are frozen while a task trains."},
    )

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"prompt schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if not 0 <= self.n_ctx <= MAX_CONTEXT_LENGTH - 3:
            raise ConfigError(f"n_ctx must be in [0, {MAX_CONTEXT_LENGTH - 3}] (the context vectors, BOS, EOS and a "
                              f"token must fit the longest text context, {MAX_CONTEXT_LENGTH}), got {self.n_ctx}",
                              "n_ctx")
        if not (self.init_std >= 0 and math.isfinite(self.init_std)):
            raise ValueError(f"init_std must be a finite number >= 0, got {self.init_std}")


@register_method
class PromptLearning(ContinualMethod[PromptConfig]):
    """CoOp context vectors on the text tower, the rest of CLIP frozen (see the module docstring)."""

    fsdp_refusal = ("its text prompt is a module of its own on the model, which the plain model the loop gathers after "
                    "each task would not carry")
    name = "prompt"
    same_step_as = "lora"
    config_class = PromptConfig
    roles = {
        "previous_model": "learns a prompt for the previous task's model",
        "parameter_efficient": "freezes the model but for its context vectors (and `trainable`) during each task",
    }
    conflicts = {"parameter_efficient": "freezes the model but for its context vectors: each would freeze the "
                 "other's parameters"}
    checkpoint_loader = CheckpointLoader(
        module=__name__, function="load_prompted_model", keeps="its learned prompt (the context vectors)",
        plain_model="the model without its learned prompt (texts embedded without the context vectors)")

    def __init__(self, config: PromptConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.prompts: dict[int, torch.Tensor] = {}  # task index -> context after that task (CPU)
        self.deployed: int | None = None
        self._flags: dict[str, bool] = {}
        self._training: TextPrompt | None = None  # the prompt being trained (between task start and end)

    # ----- building prompts --------------------------------------------------------------------------------
    def initial_context(self, context: TaskContext) -> torch.Tensor:
        """The context task `context.task_index` starts from: the previous task's with `schedule: shared`, else a
        fresh one (the phrase's token embeddings, or seeded N(0, init_std^2))."""
        model = context.model
        previous = [k for k in self.prompts if k < context.task_index]
        if self.config.schedule == "shared" and previous:
            return self.prompts[max(previous)].clone()
        embedding = model.get_input_embeddings().weight
        if self.config.ctx_init:
            tokenizer = context.tokenizer
            if tokenizer is None:
                raise ValueError("prompt ctx_init needs the run's tokenizer (context.tokenizer)")
            ids = tokenizer(self.config.ctx_init, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"prompt ctx_init {self.config.ctx_init!r} has no tokens")
            return embedding[torch.tensor(ids, device=embedding.device)].detach().float().cpu().clone()
        generator = torch.Generator().manual_seed(int(context.seed))
        hidden = embedding.shape[1]
        return torch.randn(self.config.n_ctx, hidden, generator=generator) * self.config.init_std

    def prompt_module(self, task_index: int | None = None) -> TextPrompt:
        """A `TextPrompt` holding the context after task `task_index` (default: the deployed one)."""
        index = self.deployed if task_index is None else task_index
        if index is None or index not in self.prompts:
            raise ValueError(f"No prompt for task {index}; prompts exist for tasks {sorted(self.prompts)}")
        ctx = self.prompts[index]
        return TextPrompt(ctx.shape[0], ctx.shape[1], ctx=ctx)

    # ----- hooks -------------------------------------------------------------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        if not self.config.ctx_init and self.config.n_ctx + 3 > model.max_text_positions:
            raise ValueError(f"method_args.prompt.n_ctx={self.config.n_ctx} leaves no room for the text in the "
                             f"model's {model.max_text_positions} text positions (BOS, EOS and one token need 3): "
                             f"set it to at most {model.max_text_positions - 3}")
        model.text_prompt = None
        self._flags = requires_grad_flags(model)
        ctx = self.initial_context(context)
        weight = model.get_input_embeddings().weight
        self._training = TextPrompt(ctx.shape[0], ctx.shape[1], ctx=ctx).to(device=weight.device, dtype=weight.dtype)
        model.text_prompt = self._training
        freeze_base(model, self.config.trainable, is_own=lambda name: name.startswith("text_prompt."))

    def after_training(self, context: TaskContext) -> None:
        model = context.model
        prompt = model.text_prompt
        if not isinstance(prompt, TextPrompt):
            raise ValueError("The model lost its text prompt during training")
        self.prompts[context.task_index] = prompt.ctx.detach().float().cpu().clone()
        self.deployed = context.task_index
        self._training = None
        restore_flags(model, self._flags)

    def state_dict(self) -> dict[str, Any]:
        """The prompt after every task and the deployed one; within a task (the Trainer's mid-task checkpoints,
        whose `model.safetensors` never holds the prompt) also the prompt being trained, as `training`."""
        state: dict[str, Any] = {
            "prompts": {str(k): v for k, v in sorted(self.prompts.items())}, "deployed": self.deployed
        }
        if self._training is not None:
            state["training"] = self._training.ctx.detach()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; a `training` prompt (resuming a task from a Trainer checkpoint) is copied into
        the prompt this task attached to the model."""
        self.prompts = {int(k): v for k, v in state.get("prompts", {}).items()}
        deployed = state.get("deployed")
        self.deployed = int(deployed) if deployed is not None else None
        training = state.get("training")
        if training is not None:
            if self._training is None or self._training.ctx.shape != training.shape:
                raise ValueError("A mid-task prompt state can only be loaded into the task that wrote it")
            with torch.no_grad():
                self._training.ctx.copy_(training)


# ----------------------------------------------------------------------------------------------------------------
# Inference from a checkpoint
# ----------------------------------------------------------------------------------------------------------------
def load_prompt_method(checkpoint_dir: str | Path) -> PromptLearning:
    """The `prompt` method, with its state, of a task checkpoint written by a run that used it."""
    folder = Path(checkpoint_dir)
    states = json.loads((folder / STATE_JSON).read_text(encoding="utf-8"))
    if PromptLearning.name not in states:
        raise ValueError(f"{folder / STATE_JSON} holds no '{PromptLearning.name}' state: the run did not use prompt "
                         f"learning (methods: {sorted(states)})")
    method = PromptLearning(states[PromptLearning.name]["config"])
    load_method_states([method], folder)  # only ours: the run's other methods are not needed to embed texts
    return method


def load_prompt(checkpoint_dir: str | Path, task_index: int | None = None) -> TextPrompt:
    """The learned prompt saved in a task checkpoint (default: the deployed one, i.e. the latest task's); set it
    as `model.text_prompt` of a `ContinualCLIPModel` to embed texts with it."""
    return load_prompt_method(checkpoint_dir).prompt_module(task_index)


def load_prompted_model(
    name_or_path: str | Path, task_index: int | None = None, revision: str | None = None
) -> ContinualCLIPModel:
    """The checkpoint's CLIP (a `ContinualCLIPModel`) with its learned prompt attached: `get_text_features`,
    `embed_texts` and the evaluation functions then use the prompt. `name_or_path`: a task folder or a Hub
    repository id with its `revision` (`task-<k>`)."""
    from ..modeling import ContinualCLIPModel

    checkpoint_dir = checkpoint_folder(name_or_path, revision)
    model = ContinualCLIPModel.from_pretrained(str(checkpoint_dir))
    weight = model.get_input_embeddings().weight
    model.text_prompt = load_prompt(checkpoint_dir, task_index).to(device=weight.device, dtype=weight.dtype)
    return model
