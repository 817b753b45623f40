"""ContinualCLIPModel: same loss as CLIPModel, EOS pooling after vocabulary growth, plain-CLIPModel reload."""

import torch
from transformers import CLIPModel

from hf_ccl.modeling import ContinualCLIPModel, tiny_clip_config
from hf_ccl.testing import TINY_CLIP


def _batch(tokenizer, texts):
    encoding = tokenizer(texts, padding=True, return_tensors="pt")
    torch.manual_seed(1)
    return encoding.input_ids, encoding.attention_mask, torch.randn(len(texts), 3, 32, 32)


def test_loss_equals_clip_loss_on_one_process(tiny_model, clip_tokenizer):
    tiny_model.align_special_tokens(clip_tokenizer)
    ids, mask, pixels = _batch(clip_tokenizer, ["a photo of a cat", "a dog runs", "two birds", "a red car"])
    ours = tiny_model(input_ids=ids, attention_mask=mask, pixel_values=pixels, return_loss=True)
    reference = CLIPModel.forward(tiny_model, input_ids=ids, attention_mask=mask, pixel_values=pixels, return_loss=True)
    assert torch.allclose(ours.loss, reference.loss, atol=1e-6)
    assert torch.allclose(ours.logits_per_image, reference.logits_per_image, atol=1e-5)
    assert torch.equal(ours.all_image_embeds, ours.image_embeds)


def test_eos_pooling_survives_vocabulary_growth(tiny_model, clip_tokenizer):
    tiny_model.align_special_tokens(clip_tokenizer)
    ids, mask, _ = _batch(clip_tokenizer, ["a photo of a cat", "a dog"])
    before = tiny_model.embed_texts(ids, mask)
    tiny_model.resize_token_embeddings(len(clip_tokenizer) + 10, mean_resizing=False)
    assert tiny_model.config.text_config.vocab_size == len(clip_tokenizer) + 10
    # A new token with the highest id inside the text: argmax pooling would pick it; EOS pooling must not.
    new_ids = ids.clone()
    new_ids[0, 2] = len(clip_tokenizer) + 5
    after = tiny_model.embed_texts(new_ids, mask)
    assert torch.allclose(after[1], before[1], atol=1e-6)
    eos_position = (new_ids[0] == clip_tokenizer.eos_token_id).nonzero()[0].item()
    hidden = tiny_model.text_model(input_ids=new_ids, attention_mask=mask).last_hidden_state
    pooled = tiny_model.text_projection(hidden[0, eos_position])
    assert torch.allclose(torch.nn.functional.normalize(pooled, dim=-1), after[0], atol=1e-5)


def test_checkpoint_loads_with_plain_clipmodel(tiny_model, clip_tokenizer, tmp_path):
    tiny_model.align_special_tokens(clip_tokenizer)
    tiny_model.resize_token_embeddings(len(clip_tokenizer) + 3)
    tiny_model.save_pretrained(tmp_path)
    plain = CLIPModel.from_pretrained(tmp_path)
    assert type(plain) is CLIPModel
    assert plain.config.architectures == ["CLIPModel"]
    assert plain.config.text_config.eos_token_id == clip_tokenizer.eos_token_id
    ids, mask, pixels = _batch(clip_tokenizer, ["a photo of a cat", "a dog"])
    ours_text = tiny_model.embed_texts(ids, mask, normalize=False)
    ours_image = tiny_model.embed_images(pixels, normalize=False)
    assert torch.allclose(plain.get_text_features(input_ids=ids, attention_mask=mask).pooler_output, ours_text, atol=1e-6)
    assert torch.allclose(plain.get_image_features(pixel_values=pixels).pooler_output, ours_image, atol=1e-6)


def test_loads_from_config_and_checkpoint(tmp_path):
    model = ContinualCLIPModel(tiny_clip_config(**TINY_CLIP))
    CLIPModel(model.config).save_pretrained(tmp_path)
    reloaded = ContinualCLIPModel.from_pretrained(tmp_path)
    assert isinstance(reloaded, ContinualCLIPModel)
    assert reloaded.get_input_embeddings().num_embeddings == 49408
