"""`ContinualCLIPModel`: a `transformers.CLIPModel` that continual-learning methods can build on.

What it adds to `CLIPModel`, and nothing else (its checkpoints load with plain `CLIPModel.from_pretrained`):
- the contrastive loss over the *global* batch (differentiable all-gather), with a positive mask for duplicate
  texts or images; with one process and unique pairs it equals `CLIPModel`'s own loss;
- outputs that carry the global embeddings and mask, so method losses need not gather again;
- EOS pooling that stays right when the vocabulary grows (`align_special_tokens`);
- input-embedding access and `resize_token_embeddings` for the text tower;
- an optional `text_prompt` module (learned context vectors, `hf_ccl.methods.prompt`) that the text path consults
  when set; with none set (the default) `get_text_features` is `CLIPModel`'s own.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerBase
from transformers.models.clip.modeling_clip import CLIPOutput

from .distributed import all_gather_no_grad, all_gather_with_grad
from .heads import PairOutput
from .losses import clip_contrastive_loss, positive_mask

logger = logging.getLogger(__name__)

LEGACY_EOS_TOKEN_ID = 2


@dataclass
class ContinualCLIPOutput(CLIPOutput):
    """`CLIPOutput` plus this process's projected features before normalisation (`image_features`,
    `text_features`) and the global batch: normalised embeddings gathered from every process (with gradients for
    this process's rows), the global logit matrix (image rows, text columns) and the positive mask."""

    image_features: torch.Tensor | None = None
    text_features: torch.Tensor | None = None
    all_image_embeds: torch.Tensor | None = None
    all_text_embeds: torch.Tensor | None = None
    global_logits_per_image: torch.Tensor | None = None
    global_positive_mask: torch.Tensor | None = None


def tiny_clip_config(
    vocab_size: int = 49408,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    projection_dim: int = 64,
    max_position_embeddings: int = 77,
    bos_token_id: int = 49406,
    eos_token_id: int = 49407,
    pad_token_id: int = 49407,
) -> CLIPConfig:
    """A small randomly initialisable CLIP config (defaults: the 0.24 M-parameter towers of ENVIRONMENT.md
    plus the real 49,408-token vocabulary), with special-token ids of the real CLIP tokenizer."""
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    vision_config = {
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    return CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=projection_dim)


def as_embedding(output: Any) -> torch.Tensor:
    """The projected embedding from `get_*_features`: a bare tensor (transformers 4.x), or an output object's
    `pooler_output` (transformers 5)."""
    if isinstance(output, torch.Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return pooled
    raise TypeError(f"cannot read an embedding from {type(output).__name__}; expected a tensor or pooler_output")


class ContinualCLIPModel(CLIPModel):
    """CLIP with a global-batch contrastive loss and a growable vocabulary. See the module docstring."""

    def __init__(self, config: CLIPConfig):
        super().__init__(config)
        #: Optional text prompt (e.g. `hf_ccl.methods.prompt.TextPrompt`): a module called as
        #: `text_prompt(text_model, input_ids, attention_mask)` that returns the text tower's output (unprojected
        #: `pooler_output`) with its prompt inserted. A submodule, so its parameters train and move with the model,
        #: but never saved by `save_pretrained` (checkpoints stay plain CLIPs; the prompt lives in method state).
        self.text_prompt: nn.Module | None = None
        #: Optional per-modality learner heads (`hf_ccl.heads.LearnerHeads`, CMCL's setting): a batch of cached
        #: frozen features (`features_a`, `features_b`, `modality_a`, `modality_b`) runs through them. Folded into
        #: the projections by `save_pretrained`, so checkpoints stay plain CLIPs; the heads live in method state.
        self.learner_heads: nn.Module | None = None
        if config.text_config.eos_token_id == LEGACY_EOS_TOKEN_ID and config.text_config.vocab_size > 3:
            logger.warning(
                "text_config.eos_token_id is the legacy value 2: CLIP then pools at input_ids.argmax(), which is "
                "wrong once tokens are added. Call model.align_special_tokens(tokenizer)."
            )

    # ----- special tokens and vocabulary -------------------------------------------------------------------
    def align_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Set the text tower's BOS/EOS/PAD ids to the tokenizer's, so pooling finds the real EOS token.

        `CLIPTextModel` pools at the first `eos_token_id` in each row (or at `argmax(input_ids)` when the id is the
        legacy 2); with the tokenizer's real EOS id this is right whatever the vocabulary size.
        """
        if tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has no EOS token; CLIP pools the text at its EOS position")
        text_config = self.config.text_config
        text_config.eos_token_id = tokenizer.eos_token_id
        text_config.bos_token_id = tokenizer.bos_token_id
        text_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.text_model.config.eos_token_id = tokenizer.eos_token_id
        self.text_model.eos_token_id = tokenizer.eos_token_id
        if len(tokenizer) > self.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"The tokenizer has {len(tokenizer)} tokens but the model's token embedding only "
                f"{self.get_input_embeddings().num_embeddings} rows; call model.resize_token_embeddings(len(tokenizer))"
            )

    def get_input_embeddings(self) -> nn.Module:
        return self.text_model.embeddings.token_embedding

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.text_model.embeddings.token_embedding = value

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Grow (or shrink) the text tower's token embedding; old rows are kept unchanged.

        `mean_resizing=False` leaves new rows at the default init, for methods that set their own (TEIR).
        """
        embedding = self.text_model.resize_token_embeddings(
            new_num_tokens, pad_to_multiple_of=pad_to_multiple_of, mean_resizing=mean_resizing
        )
        self.config.text_config.vocab_size = embedding.num_embeddings
        return embedding

    # ----- embeddings --------------------------------------------------------------------------------------
    def embed_images(self, pixel_values: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Projected image embeddings [B, projection_dim]."""
        embeds = as_embedding(self.get_image_features(pixel_values=pixel_values))
        return nn.functional.normalize(embeds, dim=-1) if normalize else embeds

    def get_text_features(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """`CLIPModel.get_text_features`, or, when `text_prompt` is set, the same through the prompt: the text
        tower's prompted output with `pooler_output` projected by `text_projection`."""
        if self.text_prompt is None:
            return super().get_text_features(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )
        if position_ids is not None:
            raise ValueError("position_ids cannot be given with a text prompt: the prompt sets the positions")
        outputs = self.text_prompt(self.text_model, input_ids, attention_mask)
        outputs.pooler_output = self.text_projection(outputs.pooler_output)
        return outputs

    def embed_texts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, normalize: bool = True
    ) -> torch.Tensor:
        """Projected text embeddings [B, projection_dim]."""
        embeds = as_embedding(self.get_text_features(input_ids=input_ids, attention_mask=attention_mask))
        return nn.functional.normalize(embeds, dim=-1) if normalize else embeds

    # ----- forward -----------------------------------------------------------------------------------------
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.FloatTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        return_loss: bool | None = None,
        text_hash: torch.Tensor | None = None,
        image_hash: torch.Tensor | None = None,
        features_only: bool = False,
        features_a: torch.Tensor | None = None,
        features_b: torch.Tensor | None = None,
        modality_a: str | None = None,
        modality_b: str | None = None,
        **kwargs: Any,
    ) -> ContinualCLIPOutput | PairOutput:
        """Like `CLIPModel.forward`, but the loss runs over the global batch and honours a positive mask.

        `text_hash` / `image_hash` (int64 per example, from `CLIPCollator`) mark duplicate texts and images: the
        pairs that share either are positives of each other (DESIGN.md, "Positives in a batch").
        `features_only=True` stops after the towers: the output holds only `image_features` and `text_features`
        (what `ContinualTrainer`'s exact gradient accumulation encodes chunk by chunk; `contrastive_outputs` does
        the rest over the whole accumulated batch).

        A pair batch (`features_a`, `features_b` and their modality names, from `PairFeatureCollator`) runs through
        `learner_heads` instead and returns its `PairOutput` (the pair loss of Eq. 2, CMCL).
        """
        kwargs.pop("num_items_in_batch", None)
        if features_a is not None or features_b is not None:
            if self.learner_heads is None:
                raise ValueError("a pair batch (features_a/features_b) needs learner heads: add the learner_heads "
                                 "method")
            if features_a is None or features_b is None or modality_a is None or modality_b is None:
                raise ValueError("a pair batch needs features_a, features_b, modality_a and modality_b")
            return self.learner_heads(modality_a, modality_b, features_a, features_b, return_loss=bool(return_loss))
        image_features = as_embedding(self.get_image_features(pixel_values=pixel_values))
        text_features = as_embedding(
            self.get_text_features(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        )
        if features_only:
            return ContinualCLIPOutput(image_features=image_features, text_features=text_features)
        return self.contrastive_outputs(image_features, text_features, text_hash, image_hash, return_loss=return_loss)

    def contrastive_outputs(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        text_hash: torch.Tensor | None = None,
        image_hash: torch.Tensor | None = None,
        return_loss: bool | None = None,
    ) -> ContinualCLIPOutput:
        """Everything after the towers, from this process's projected features: normalisation, the global batch
        (differentiable all-gather), the logits, the positive mask and (with `return_loss`) the contrastive loss."""
        image_embeds = nn.functional.normalize(image_features, dim=-1)
        text_embeds = nn.functional.normalize(text_features, dim=-1)
        scale = self.logit_scale.exp()
        logits_per_text = scale * text_embeds @ image_embeds.t()

        all_image_embeds = all_gather_with_grad(image_embeds)
        all_text_embeds = all_gather_with_grad(text_embeds)
        global_logits = scale * all_image_embeds @ all_text_embeds.t()
        mask = None
        if text_hash is not None:
            all_text_hash = all_gather_no_grad(text_hash)
            all_image_hash = all_gather_no_grad(image_hash) if image_hash is not None else None
            mask = positive_mask(all_text_hash, all_image_hash)

        loss = clip_contrastive_loss(global_logits, mask) if return_loss else None
        return ContinualCLIPOutput(
            loss=loss,
            logits_per_image=logits_per_text.t(),
            logits_per_text=logits_per_text,
            text_embeds=text_embeds,
            image_embeds=image_embeds,
            image_features=image_features,
            text_features=text_features,
            all_image_embeds=all_image_embeds,
            all_text_embeds=all_text_embeds,
            global_logits_per_image=global_logits,
            global_positive_mask=mask,
        )

    # ----- saving ------------------------------------------------------------------------------------------
    def plain_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights of the plain CLIP this model stands for: no `text_prompt`, the learner heads folded in."""
        state = {name: tensor for name, tensor in self.state_dict().items()
                 if not name.startswith(("text_prompt.", "learner_heads."))}
        if self.learner_heads is not None:
            visual, text = self.learner_heads.folded_projections(
                self.visual_projection.weight.detach(), self.text_projection.weight.detach())
            state["visual_projection.weight"], state["text_projection.weight"] = visual, text
        return state

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Save as a plain CLIP checkpoint: `architectures` says `CLIPModel`, so any transformers loads it.

        A `text_prompt` is never saved with the weights (an explicit `state_dict` argument is written as given): it
        belongs to the method's state, which also carries it in the Trainer's mid-task checkpoints. Neither are
        `learner_heads`: their image and text heads are folded into `visual_projection` and `text_projection`."""
        if kwargs.get("state_dict") is None and (self.text_prompt is not None or self.learner_heads is not None):
            kwargs["state_dict"] = self.plain_state_dict()
        super().save_pretrained(save_directory, *args, **kwargs)
        config_path = os.path.join(save_directory, "config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as handle:
                config = json.load(handle)
            config["architectures"] = ["CLIPModel"]
            with open(config_path, "w", encoding="utf-8") as handle:
                json.dump(config, handle, indent=2, sort_keys=True)
                handle.write("\n")
