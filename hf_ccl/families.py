"""The dual-encoder families hf_ccl trains: one small `ContinualDualEncoder` subclass per transformers class.

| family | class | loss | text pooling and padding | projections |
|---|---|---|---|---|
| clip | `ContinualCLIPModel` (`CLIPModel`) | softmax | EOS token, longest | visual_projection, text_projection |
| metaclip_2 | `ContinualMetaClip2Model` (`MetaClip2Model`) | softmax | EOS token, longest | visual_projection, text_projection |
| siglip | `ContinualSiglipModel` (`SiglipModel`) | sigmoid, learned bias | last position, max_length, no mask | text_model.head (image: none) |
| siglip2 | `ContinualSiglip2Model` (`Siglip2Model`) | sigmoid, learned bias | as SigLIP; NaFlex images | text_model.head (image: none) |
| altclip | `ContinualAltCLIPModel` (`AltCLIPModel`) | softmax | first token (XLM-R), longest | visual_projection, text_projection |
| chinese_clip | `ContinualChineseCLIPModel` (`ChineseCLIPModel`) | softmax | first token (BERT), longest | visual_projection, text_projection |

Each keeps its parent's `from_pretrained` / `save_pretrained`: a saved checkpoint names the plain class in
`architectures` and loads with it (or `AutoModel`) in a Python without hf_ccl. `family_of` finds the family from a
config (`model_type`), `load_continual_model` loads any checkpoint into its family's class, and `tiny_config` gives the
small random configs the tests and the default run use.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch
from transformers import (
    AltCLIPConfig,
    AltCLIPModel,
    AutoConfig,
    ChineseCLIPConfig,
    ChineseCLIPModel,
    MetaClip2Config,
    MetaClip2Model,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Siglip2Config,
    Siglip2ImageProcessorPil,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessorPil,
    SiglipModel,
)

from .data.collate import load_image_processor
from .modeling import ContinualCLIPModel, ContinualDualEncoder, set_eos_token_ids, tiny_clip_config

#: The start of that warning's text for the default SigLIP text config's BOS or EOS id (`_DefaultSiglipIdsFilter`).
_DEFAULT_SIGLIP_IDS_WARNING = "an integer within the vocabulary (between 0 and 31999), got 4940"


class _DefaultSiglipIdsFilter(logging.Filter):
    """transformers 5.23 builds a default `SiglipTextConfig` (32,000 tokens with CLIP's BOS/EOS ids 49406 and 49407)
    whenever it prints or saves a SigLIP config, and warns that those class defaults lie outside the vocabulary
    (huggingface/transformers#47612): twice per process, for every SigLIP checkpoint, about none of them (hf_ccl's
    configs carry their tokenizer's ids, `align_special_tokens`). This drops exactly that warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _DEFAULT_SIGLIP_IDS_WARNING not in record.getMessage()


logging.getLogger("transformers.configuration_utils").addFilter(_DefaultSiglipIdsFilter())

#: The text length of every released SigLIP and SigLIP 2 (and the one `pipeline("zero-shot-image-classification")`
#: pads their texts to): a random SigLIP gets as many positions, so it is trained and evaluated at that length.
SIGLIP_TEXT_LENGTH = 64

#: Why methods that reach into CLIP's text tower are refused on the other families.
_PROMPT_REASON = "the learned text prompt is written for CLIP's causal text tower (CLIPTextTransformer internals)"


class ContinualMetaClip2Model(ContinualDualEncoder, MetaClip2Model):
    """MetaCLIP 2: CLIP's architecture with a multilingual tokenizer (XLM-V); the text pools at its EOS token."""

    family = "metaclip_2"
    plain_architecture = "MetaClip2Model"
    unsupported_methods = {"prompt": _PROMPT_REASON}

    def __init__(self, config: MetaClip2Config):
        super().__init__(config)
        self._init_continual()

    def align_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        set_eos_token_ids(self, tokenizer)
        super().align_special_tokens(tokenizer)


class _SigmoidFamily(ContinualDualEncoder):
    """SigLIP's conventions (SigLIP and SigLIP 2): the pairwise sigmoid loss with a learned logit bias; the text pools
    at the last position, so texts are padded to the full length and given no attention mask (how the checkpoints
    were trained); the image embedding is the attention-pooling head's output (no linear projection to fold learner
    heads into or to project for DNS).

    A randomly initialised model starts from the paper's t' = log 10, b = -10 (Zhai et al. 2023, Sec. 3.2; transformers
    initialises both at 0); `from_pretrained` loads the checkpoint's values over them.

    The softmax-based method terms keep their meaning on these families: Mod-X and LwF distil the row-wise softmax of
    the model's similarities, which a shared bias does not change (softmax is shift-invariant), so they distil the
    same cosine structure as on CLIP; CTP's compatible and topology losses are its own InfoNCE with its own
    temperature, added to the sigmoid task loss; the replay and regularisation losses (DER++, EWC's Fisher, GEM's
    gradients) use the family's sigmoid loss.
    """

    loss_kind = "sigmoid"
    max_logit_scale = None
    projection_names = {"image": None, "text": "text_model.head"}
    text_padding = "max_length"
    text_attention_mask = False
    unsupported_methods = {
        "prompt": _PROMPT_REASON,
        "learner_heads": "SigLIP's image embedding has no linear projection to fold an image head into",
        "dns": "DNS projects the gradients of the two projections, and SigLIP has no image projection",
    }
    logit_bias: torch.nn.Parameter

    def _init_continual(self) -> None:
        super()._init_continual()
        with torch.no_grad():
            self.logit_scale.fill_(math.log(10.0))
            self.logit_bias.fill_(-10.0)

    def align_special_tokens(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """The text tower reads no special-token id (it pools the last position), but its config records them: they
        are set to the tokenizer's, so a saved config names ids inside its vocabulary."""
        text_config = self.config.text_config
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(text_config, name, getattr(tokenizer, name))
        super().align_special_tokens(tokenizer)

    @property
    def embed_dim(self) -> int:
        return int(self.config.text_config.projection_size)


class ContinualSiglipModel(_SigmoidFamily, SiglipModel):
    """SigLIP (`_SigmoidFamily`'s conventions)."""

    family = "siglip"
    plain_architecture = "SiglipModel"
    processor_class = "SiglipProcessor"

    def __init__(self, config: SiglipConfig):
        super().__init__(config)
        self._init_continual()


class ContinualSiglip2Model(_SigmoidFamily, Siglip2Model):
    """SigLIP 2: SigLIP's loss, text tower and conventions (`_SigmoidFamily`), with NaFlex images: each image is
    resized to keep its aspect ratio within `num_patches` patches, and its tower reads the patches (`pixel_values`),
    their padding mask (`pixel_attention_mask`) and grid (`spatial_shapes`), all three carried by every batch
    (`image_input_names`). The image cache (fixed-size pixels) does not apply to it."""

    family = "siglip2"
    plain_architecture = "Siglip2Model"
    processor_class = "Siglip2Processor"
    image_input_names = ("pixel_values", "pixel_attention_mask", "spatial_shapes")

    def __init__(self, config: Siglip2Config):
        super().__init__(config)
        self._init_continual()

    @property
    def image_size(self) -> int:
        """The side of a square image that fills the `num_patches` patches."""
        vision = self.config.vision_config
        return int(math.isqrt(vision.num_patches) * vision.patch_size)


class _FirstTokenTextFamily(ContinualDualEncoder):
    """Families whose text tower is a BERT-style encoder pooled at its first token (AltCLIP, Chinese-CLIP)."""

    unsupported_methods = {"prompt": _PROMPT_REASON}

    @property
    def max_text_positions(self) -> int:
        """RoBERTa-style position ids start after the padding id, so fewer tokens fit than there are positions."""
        text = self.config.text_config
        offset = text.pad_token_id + 1 if getattr(text, "position_embedding_type", "absolute") == "absolute" \
            and self.position_offset else 0
        return int(text.max_position_embeddings) - offset

    position_offset = False


class ContinualAltCLIPModel(_FirstTokenTextFamily, AltCLIPModel):
    """AltCLIP: CLIP's vision tower with an XLM-R text tower (multilingual), pooled at the first token."""

    family = "altclip"
    plain_architecture = "AltCLIPModel"
    processor_class = "AltCLIPProcessor"
    token_embedding_path = "text_model.roberta.embeddings.word_embeddings"
    position_offset = True

    def __init__(self, config: AltCLIPConfig):
        super().__init__(config)
        self._init_continual()


class ContinualChineseCLIPModel(_FirstTokenTextFamily, ChineseCLIPModel):
    """Chinese-CLIP: CLIP's vision tower with a Chinese RoBERTa (BERT layout) text tower, pooled at the first token."""

    family = "chinese_clip"
    plain_architecture = "ChineseCLIPModel"
    processor_class = "ChineseCLIPProcessor"
    token_embedding_path = "text_model.embeddings.word_embeddings"

    def __init__(self, config: ChineseCLIPConfig):
        super().__init__(config)
        self._init_continual()


#: Every supported family by name (its `model_type`).
FAMILIES: dict[str, type[ContinualDualEncoder]] = {
    cls.family: cls
    for cls in (ContinualCLIPModel, ContinualSiglipModel, ContinualSiglip2Model, ContinualAltCLIPModel,
                ContinualChineseCLIPModel, ContinualMetaClip2Model)
}


def family_of(config: PretrainedConfig | dict[str, Any] | str) -> str:
    """The family of a config (its `model_type`), a config dict, or a family name; an error names the supported ones."""
    model_type = config if isinstance(config, str) else (
        config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None))
    if model_type in FAMILIES:
        return str(model_type)
    raise ValueError(f"model family {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")


def family_class(family: str) -> type[ContinualDualEncoder]:
    return FAMILIES[family_of(family)]


def load_continual_model(name_or_path: str, family: str | None = None, **kwargs: Any) -> ContinualDualEncoder:
    """Load any supported checkpoint (Hub id or folder) into its family's continual class; `family` (if given) must
    match the checkpoint's `model_type`."""
    config = AutoConfig.from_pretrained(name_or_path, **kwargs)
    found = family_of(config)
    if family is not None and family_of(family) != found:
        raise ValueError(f"model.family is {family!r} but {name_or_path} is a {found!r} checkpoint")
    return FAMILIES[found].from_pretrained(name_or_path, config=config, **kwargs)


def tiny_config(family: str = "clip", **sizes: int) -> PretrainedConfig:
    """A small randomly initialisable config of `family` with `tiny_clip_config`'s options and defaults (sizes, and the
    bundled CLIP tokenizer's vocabulary and special-token ids: no other family's tokenizer is available offline;
    ENVIRONMENT.md). SigLIP and SigLIP 2 default to `SIGLIP_TEXT_LENGTH` text positions.

    SigLIP's embedding size is its hidden size (no projection): `projection_dim` must equal `hidden_size` there.
    """
    defaults = {name: p.default for name, p in inspect.signature(tiny_clip_config).parameters.items()}
    unknown = sorted(set(sizes) - set(defaults))
    if unknown:
        raise TypeError(f"tiny_config got unknown option(s) {unknown}; valid: {', '.join(defaults)}")
    values = {**defaults, **sizes}
    if family in ("siglip", "siglip2") and "max_position_embeddings" not in sizes:
        values["max_position_embeddings"] = SIGLIP_TEXT_LENGTH
    hidden_size, projection_dim = values["hidden_size"], values["projection_dim"]
    family = family_of(family)
    if family == "clip":
        return tiny_clip_config(**values)
    layers = {"hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
              "num_hidden_layers": values["num_layers"], "num_attention_heads": values["num_heads"]}
    vision = {**layers, "image_size": values["image_size"], "patch_size": values["patch_size"]}
    text = {**layers, **{key: values[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size",
                                                       "max_position_embeddings")}}
    if family == "metaclip_2":
        return MetaClip2Config(text_config=text, vision_config=vision, projection_dim=projection_dim)
    if family in ("siglip", "siglip2"):
        if projection_dim != hidden_size:
            raise ValueError(f"a SigLIP embeds into its hidden size: projection_dim ({projection_dim}) must equal "
                             f"hidden_size ({hidden_size})")
        if family == "siglip":
            return SiglipConfig(text_config=text, vision_config=vision)
        side = values["image_size"] // values["patch_size"]  # NaFlex: as many patches as the square image has
        vision = {key: value for key, value in vision.items() if key != "image_size"} | {"num_patches": side * side}
        return Siglip2Config(text_config=text, vision_config=vision)
    if family == "altclip":
        # RoBERTa numbers positions from its padding id + 1 (XLM-R's pad is 1), so the position table needs 2 more
        # rows; token 1 is then the padding row of the word embedding (zero, untrained) in this test config.
        text = {**text, "project_dim": hidden_size, "pad_token_id": 1,
                "max_position_embeddings": values["max_position_embeddings"] + 2}
        return AltCLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    return ChineseCLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)


def check_family_methods(family: str | ContinualDualEncoder | type[ContinualDualEncoder], methods: Any) -> None:
    """Refuse, before training, the methods that cannot work on the family (each with its reason). `methods` are
    method objects (their `name`) or names."""
    cls = family if isinstance(family, type) else type(family) if isinstance(family, ContinualDualEncoder) \
        else family_class(family)
    names = [getattr(method, "name", method) for method in methods]
    refused = [f"{name}: {cls.unsupported_methods[name]}" for name in names if name in cls.unsupported_methods]
    if refused:
        raise ValueError(f"method(s) not available for the {cls.family} family: " + "; ".join(refused))


def default_image_processor(model: ContinualDualEncoder) -> Any:
    """The family's image preprocessing at the model's image size (PIL backend): SigLIP resizes the whole image to a
    square and scales to [-1, 1]; the CLIP-style families resize the short side, centre-crop and use CLIP's mean and
    std."""
    size = model.image_size
    if model.family == "siglip":
        return SiglipImageProcessorPil(size={"height": size, "width": size})
    if model.family == "siglip2":
        vision = model.config.vision_config
        return Siglip2ImageProcessorPil(patch_size=vision.patch_size, max_num_patches=vision.num_patches)
    return load_image_processor(size)
