"""The dual-encoder protocol (`ContinualDualEncoder`) and `ContinualCLIPModel`, its `transformers.CLIPModel` family.

`ContinualDualEncoder` is what the loop, the evaluator and every method use instead of one family's internals: image
and text features (`embed_images`, `embed_texts`), the logits and the family's own loss (`logits`,
`contrastive_loss`: CLIP's softmax or SigLIP's sigmoid), the logit scale and, where the family has one, its bias
(`logit_bias_or_none`), the input embeddings and the projections (`projection_names`). It is a mixin placed before a transformers class; each family (`hf_ccl.families`) is one small
subclass that keeps its parent's `from_pretrained` / `save_pretrained`, so its checkpoints load with the plain
transformers class (`CLIPModel`, `SiglipModel`, ...).

What it adds to its transformers parent, and nothing else:
- the family's loss over the *global* batch (differentiable all-gather), with a positive mask for duplicate
  texts or images; with one process and unique pairs it equals the parent's own loss;
- outputs that carry the global embeddings and mask, so method losses need not gather again;
- EOS pooling that stays right when the vocabulary grows (`align_special_tokens`);
- input-embedding access and `resize_token_embeddings` for the text tower;
- an optional `text_prompt` module (learned context vectors, `hf_ccl.methods.prompt`) that the text path consults
  when set; with none set (the default) `get_text_features` is `CLIPModel`'s own.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.clip.modeling_clip import CLIPOutput

from .distributed import all_gather_no_grad, all_gather_with_grad, rank, world_size
from .heads import LearnerHeads, PairOutput
from .losses import clip_contrastive_loss, positive_mask, sigmoid_contrastive_loss

logger = logging.getLogger(__name__)

LEGACY_EOS_TOKEN_ID = 2


@dataclass
class ContinualDualEncoderOutput(CLIPOutput):
    """`CLIPOutput` plus this process's projected features before normalisation (`image_features`,
    `text_features`) and the global batch: normalised embeddings gathered from every process (with gradients for
    this process's rows), the global logit matrix (image rows, text columns) and the positive mask."""

    image_features: torch.Tensor | None = None
    text_features: torch.Tensor | None = None
    all_image_embeds: torch.Tensor | None = None
    all_text_embeds: torch.Tensor | None = None
    global_logits_per_image: torch.Tensor | None = None
    global_positive_mask: torch.Tensor | None = None

    def global_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(`all_image_embeds`, `all_text_embeds`, `global_logits_per_image`): set by every full forward; a
        `features_only` output has none (ValueError)."""
        if self.all_image_embeds is None or self.all_text_embeds is None or self.global_logits_per_image is None:
            raise ValueError("this output holds no global batch: it is a features_only forward's")
        return self.all_image_embeds, self.all_text_embeds, self.global_logits_per_image


#: The name this output had when CLIP was the only family.
ContinualCLIPOutput = ContinualDualEncoderOutput


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


def set_eos_token_ids(model: ContinualDualEncoder, tokenizer: PreTrainedTokenizerBase) -> None:
    """Set a CLIP-style text tower's BOS/EOS/PAD ids to the tokenizer's (it pools at the first EOS token)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no EOS token; this text tower pools at its EOS position")
    text_config = model.config.text_config
    text_config.eos_token_id = tokenizer.eos_token_id
    text_config.bos_token_id = tokenizer.bos_token_id
    text_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    text_tower: Any = model.text_model  # the family's text transformer: its config and its pooling id
    text_tower.config.eos_token_id = tokenizer.eos_token_id
    text_tower.eos_token_id = tokenizer.eos_token_id


if TYPE_CHECKING:
    #: What the mixin is mixed into, for the type checker: every family's class is a transformers `PreTrainedModel`
    #: (an `nn.Module`), so `model.parameters()`, `model.eval()`, `model.config` type-check on a `ContinualDualEncoder`.
    _PreTrainedModel = PreTrainedModel
else:
    _PreTrainedModel = object


class ContinualDualEncoder(_PreTrainedModel):
    """The dual-encoder protocol and the continual-learning additions shared by every family (module docstring).

    A mixin: a family is `class ContinualXModel(ContinualDualEncoder, XModel)` with the class attributes below set.
    To the type checker it is a `PreTrainedModel` with the feature methods every family has (`get_image_features`,
    `get_text_features`).
    """

    #: The family's name in configs (`model.family`) and in errors.
    family: ClassVar[str] = ""
    #: The plain transformers class a saved checkpoint names in `architectures`.
    plain_architecture: ClassVar[str] = ""
    #: The transformers processor class a checkpoint saves (`hf_ccl.processors.family_processor`).
    processor_class: ClassVar[str] = "CLIPProcessor"
    #: "softmax" (CLIP's symmetric InfoNCE) or "sigmoid" (SigLIP's pairwise sigmoid loss with a learned bias).
    loss_kind: ClassVar[str] = "softmax"
    #: exp(logit_scale) is clamped to at most exp(max_logit_scale) after each step (OpenAI CLIP's 100); None: no clamp.
    max_logit_scale: ClassVar[float | None] = math.log(100.0)
    #: The last linear map of each tower into the shared space (DNS's default layers, the learner heads' fold
    #: targets); None where the family has none (SigLIP's image embedding is its attention-pooling head's output).
    projection_names: ClassVar[dict[str, str | None]] = {"image": "visual_projection", "text": "text_projection"}
    #: Where the text tower's token embedding lives.
    token_embedding_path: ClassVar[str] = "text_model.embeddings.token_embedding"
    #: How texts are padded for this family: "longest" (per batch) or "max_length" (SigLIP pools the last position).
    text_padding: ClassVar[str] = "longest"
    #: Whether the text tower is given an attention mask (SigLIP was trained without one).
    text_attention_mask: ClassVar[bool] = True
    #: Methods that cannot work on this family, each with the reason (refused before training).
    unsupported_methods: ClassVar[dict[str, str]] = {}
    #: The image tower's inputs, as the family's image processor returns them (`pixel_values`; SigLIP 2's NaFlex
    #: adds the patches' mask and grid). Every batch of images carries all of them (`image_inputs`).
    image_input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)

    config: Any
    logit_scale: nn.Parameter

    if TYPE_CHECKING:  # the family's transformers class defines them
        def get_image_features(self, pixel_values: torch.Tensor | None = None, **kwargs: Any) -> Any: ...

        def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                              position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any: ...

    def _init_continual(self) -> None:
        #: Optional text prompt (e.g. `hf_ccl.methods.prompt.TextPrompt`): a module called as
        #: `text_prompt(text_model, input_ids, attention_mask)` that returns the text tower's output (unprojected
        #: `pooler_output`) with its prompt inserted. A submodule, so its parameters train and move with the model,
        #: but never saved by `save_pretrained` (checkpoints stay plain; the prompt lives in method state).
        self.text_prompt: nn.Module | None = None
        #: Optional per-modality learner heads (`hf_ccl.heads.LearnerHeads`, CMCL's setting): a batch of cached
        #: frozen features (`features_a`, `features_b`, `modality_a`, `modality_b`) runs through them. Folded into
        #: the projections by `save_pretrained`, so checkpoints stay plain; the heads live in method state.
        self.learner_heads: LearnerHeads | None = None

    def require_learner_heads(self) -> LearnerHeads:
        """`learner_heads`, which the `learner_heads` method sets before a pair task trains (ValueError without)."""
        if self.learner_heads is None:
            raise ValueError("this model has no learner heads: add the learner_heads method")
        return self.learner_heads

    # ----- the protocol ------------------------------------------------------------------------------------
    @property
    def embed_dim(self) -> int:
        """The dimension of the shared embedding space."""
        return int(self.config.projection_dim)

    @property
    def max_text_positions(self) -> int:
        """How many tokens the text tower takes."""
        return int(self.config.text_config.max_position_embeddings)

    @property
    def image_size(self) -> int:
        return int(self.config.vision_config.image_size)

    def logit_bias_or_none(self) -> torch.Tensor | None:
        """The learned logit bias (sigmoid families), else None."""
        return getattr(self, "logit_bias", None) if self.loss_kind == "sigmoid" else None

    def logits(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
        """The family's logits of normalised embeddings, image rows and text columns: exp(t) * cos (+ b)."""
        logits = self.logit_scale.exp() * image_embeds @ text_embeds.t()
        bias = self.logit_bias_or_none()
        return logits if bias is None else logits + bias

    def contrastive_loss(self, logits_per_image: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The family's own loss on a full [N, N] logit matrix of one batch (image rows, text columns)."""
        if self.loss_kind == "sigmoid":
            return sigmoid_contrastive_loss(logits_per_image, mask)
        return clip_contrastive_loss(logits_per_image, mask)

    def projection(self, modality: str) -> nn.Linear | None:
        """The tower's final linear map into the shared space (`projection_names`), or None."""
        name = self.projection_names[modality]
        # `projection_names` name linear layers (nothing replaces them: LoRA adapts the encoder layers only)
        return None if name is None else cast(nn.Linear, self.get_submodule(name))

    def family_error(self, what: str) -> ValueError:
        return ValueError(f"{what} is not available for the {self.family} family ({type(self).__name__})")

    # ----- special tokens and vocabulary -------------------------------------------------------------------
    def align_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Check the tokenizer fits the token embedding (and, in families that pool at EOS, set the ids)."""
        if len(tokenizer) > self.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"The tokenizer has {len(tokenizer)} tokens but the model's token embedding only "
                f"{self.get_input_embeddings().num_embeddings} rows; call model.resize_token_embeddings(len(tokenizer))"
            )

    def get_input_embeddings(self) -> nn.Embedding:
        embedding = self.get_submodule(self.token_embedding_path)
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{self.token_embedding_path} is a {type(embedding).__name__}, not the token embedding")
        return embedding

    def set_input_embeddings(self, value: nn.Module) -> None:
        parent, _, name = self.token_embedding_path.rpartition(".")
        setattr(self.get_submodule(parent), name, value)

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Grow (or shrink) the text tower's token embedding; old rows are kept unchanged.

        `mean_resizing=False` leaves new rows at the default init, for methods that set their own (TEIR).
        """
        old = self.get_input_embeddings()
        embedding = self._get_resized_embeddings(
            old, new_num_tokens, pad_to_multiple_of=pad_to_multiple_of, mean_resizing=mean_resizing
        )
        self.set_input_embeddings(embedding)
        for config in {id(c): c for c in self._text_configs()}.values():
            config.vocab_size = embedding.num_embeddings
        return embedding

    def _text_configs(self) -> list[Any]:
        """The text config objects that name the vocabulary size (the model's and its text tower's)."""
        configs = [self.config.text_config]
        tower_config = getattr(getattr(self, "text_model", None), "config", None)
        if tower_config is not None:
            configs.append(tower_config)
        return configs

    # ----- embeddings --------------------------------------------------------------------------------------
    def image_inputs(
        self, batch: Mapping[str, Any], rows: torch.Tensor | None = None, device: torch.device | str | None = None
    ) -> dict[str, Any]:
        """The image tower's inputs of a collated batch (`image_input_names`: tensors), optionally only `rows` and on
        `device`: what `embed_images(**...)` and `get_image_features(**...)` take."""
        missing = [name for name in self.image_input_names if name not in batch]
        if missing:
            raise ValueError(f"the {self.family} image tower needs {missing} in the batch (from its image processor)")
        inputs = {name: batch[name] for name in self.image_input_names}
        if rows is not None:
            inputs = {name: value[rows.to(value.device)] for name, value in inputs.items()}
        return inputs if device is None else {name: value.to(device) for name, value in inputs.items()}

    def embed_images(
        self, pixel_values: torch.Tensor, normalize: bool = True, **image_inputs: torch.Tensor
    ) -> torch.Tensor:
        """Projected image embeddings [B, embed_dim]; `image_inputs`: the tower's other inputs (SigLIP 2)."""
        embeds = as_embedding(self.get_image_features(pixel_values=pixel_values, **image_inputs))
        return nn.functional.normalize(embeds, dim=-1) if normalize else embeds

    def text_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, Any]:
        """The text tower's inputs under this family's convention (no attention mask where it was trained without)."""
        inputs: dict[str, Any] = {"input_ids": input_ids}
        if self.text_attention_mask and attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        return inputs

    def embed_texts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, normalize: bool = True
    ) -> torch.Tensor:
        """Projected text embeddings [B, embed_dim]."""
        embeds = as_embedding(self.get_text_features(**self.text_inputs(input_ids, attention_mask)))
        return nn.functional.normalize(embeds, dim=-1) if normalize else embeds

    # ----- forward -----------------------------------------------------------------------------------------
    def forward(
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
    ) -> ContinualDualEncoderOutput | PairOutput:
        """Like the parent's `forward`, but the loss runs over the global batch and honours a positive mask.

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
        image_inputs = {name: kwargs.pop(name) for name in self.image_input_names[1:] if name in kwargs}
        image_features = as_embedding(self.get_image_features(pixel_values=pixel_values, **image_inputs))
        if input_ids is None:
            raise ValueError("a batch of images and texts needs input_ids")
        text_inputs = self.text_inputs(input_ids, attention_mask)
        if position_ids is not None:
            text_inputs["position_ids"] = position_ids
        text_features = as_embedding(self.get_text_features(**text_inputs))
        if features_only:
            return ContinualDualEncoderOutput(image_features=image_features, text_features=text_features)
        return self.contrastive_outputs(image_features, text_features, text_hash, image_hash, return_loss=return_loss)

    def contrastive_outputs(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        text_hash: torch.Tensor | None = None,
        image_hash: torch.Tensor | None = None,
        return_loss: bool | None = None,
    ) -> ContinualDualEncoderOutput:
        """Everything after the towers, from this process's projected features: normalisation, the global batch
        (differentiable all-gather), the logits, the positive mask and (with `return_loss`) the family's loss.

        Softmax families compute the loss over the whole global matrix on every process (identical on each; DDP's
        gradient averaging then gives the global loss's gradient). The sigmoid loss is a sum over pairs, so each
        process scores only its local images against every process's texts and scales that by the world size: the
        mean of the processes' losses is the single-process loss of the global batch, and so are the gradients after
        DDP's averaging (the all-gather sums the text gradients back to their process)."""
        image_embeds = nn.functional.normalize(image_features, dim=-1)
        text_embeds = nn.functional.normalize(text_features, dim=-1)
        logits_per_text = self.logits(image_embeds, text_embeds).t()

        all_image_embeds = all_gather_with_grad(image_embeds)
        all_text_embeds = all_gather_with_grad(text_embeds)
        global_logits = self.logits(all_image_embeds, all_text_embeds)
        mask = None
        if text_hash is not None:
            all_text_hash = all_gather_no_grad(text_hash)
            all_image_hash = all_gather_no_grad(image_hash) if image_hash is not None else None
            mask = positive_mask(all_text_hash, all_image_hash)

        loss = None
        if return_loss and self.loss_kind == "sigmoid":
            total, local_rows = global_logits.shape[0], image_embeds.shape[0]
            positives = mask if mask is not None else torch.eye(total, dtype=torch.bool, device=global_logits.device)
            rows = slice(rank() * local_rows, (rank() + 1) * local_rows) if world_size() > 1 else slice(None)
            loss = world_size() * sigmoid_contrastive_loss(global_logits[rows], positives[rows], num_rows=total)
        elif return_loss:
            loss = self.contrastive_loss(global_logits, mask)
        return ContinualDualEncoderOutput(
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
        """The weights of the plain model this one stands for: no `text_prompt`, the learner heads folded in."""
        state = {name: tensor for name, tensor in self.state_dict().items()
                 if not name.startswith(("text_prompt.", "learner_heads.", "moe_adapters.", "diki."))}
        if self.learner_heads is not None:
            names = self.projection_names["image"], self.projection_names["text"]
            if None in names:
                raise self.family_error("folding learner heads into the projections")
            visual, text = self.learner_heads.folded_projections(
                self.get_parameter(f"{names[0]}.weight").detach(), self.get_parameter(f"{names[1]}.weight").detach())
            state[f"{names[0]}.weight"], state[f"{names[1]}.weight"] = visual, text
        return state

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Save as a plain checkpoint of the family: `architectures` names the transformers class, so any
        transformers loads it.

        A `text_prompt` is never saved with the weights (an explicit `state_dict` argument is written as given): it
        belongs to the method's state, which also carries it in the Trainer's mid-task checkpoints. Neither are
        `learner_heads`: their image and text heads are folded into the projections."""
        if kwargs.get("state_dict") is None and (self.text_prompt is not None or self.learner_heads is not None):
            kwargs["state_dict"] = self.plain_state_dict()
        super().save_pretrained(save_directory, *args, **kwargs)
        config_path = os.path.join(save_directory, "config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as handle:
                config = json.load(handle)
            config["architectures"] = [self.plain_architecture]
            with open(config_path, "w", encoding="utf-8") as handle:
                json.dump(config, handle, indent=2, sort_keys=True)
                handle.write("\n")


class ContinualCLIPModel(ContinualDualEncoder, CLIPModel):
    """CLIP (and the families built like it) with a global-batch contrastive loss and a growable vocabulary.
    CLIP pools the text at its EOS token, so `align_special_tokens` sets the tower's ids to the tokenizer's."""

    family = "clip"
    plain_architecture = "CLIPModel"

    def __init__(self, config: CLIPConfig):
        super().__init__(config)
        self._init_continual()
        text_config = self.config.text_config
        if text_config.eos_token_id == LEGACY_EOS_TOKEN_ID and text_config.vocab_size > 3:
            logger.warning(
                "text_config.eos_token_id is the legacy value 2: CLIP then pools at input_ids.argmax(), which is "
                "wrong once tokens are added. Call model.align_special_tokens(tokenizer)."
            )

    def align_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Set the text tower's BOS/EOS/PAD ids to the tokenizer's, so pooling finds the real EOS token.

        `CLIPTextModel` pools at the first `eos_token_id` in each row (or at `argmax(input_ids)` when the id is the
        legacy 2); with the tokenizer's real EOS id this is right whatever the vocabulary size.
        """
        set_eos_token_ids(self, tokenizer)
        super().align_special_tokens(tokenizer)

    def get_text_features(
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
