"""FrozenTeacher: no gradients, never changed by training, and its cache encodes each example once per task."""

import torch

from hf_ccl.data import CLIPCollator, build_stream
from hf_ccl.methods.teacher import FrozenTeacher


def test_teacher_is_frozen_and_cache_is_exact(tiny_model, clip_tokenizer, image_processor):
    tiny_model.align_special_tokens(clip_tokenizer)
    task = build_stream("flickr8k-random5", max_train_per_task=12)[0]
    collator = CLIPCollator(image_processor, clip_tokenizer, train=True, seed=0)
    teacher = FrozenTeacher(tiny_model, cache=True)
    plain = FrozenTeacher(tiny_model, cache=False)
    assert all(not p.requires_grad for p in teacher.parameters()) and not teacher.model.training
    rows = [task.train[i] for i in range(12)]
    first = collator(rows[:8])
    images, texts = teacher.embed(first)
    reference_images, reference_texts = plain.embed(first)
    assert torch.allclose(images, reference_images, atol=1e-6) and torch.allclose(texts, reference_texts, atol=1e-6)
    # A second batch sharing 4 images: only the 4 new images are encoded, and the results still match.
    second = collator(rows[4:12])
    images, texts = teacher.embed(second)
    reference_images, reference_texts = plain.embed(second)
    assert teacher.encoded_images == 12
    assert torch.allclose(images, reference_images, atol=1e-6) and torch.allclose(texts, reference_texts, atol=1e-5)
    # Training the student never changes the teacher.
    before = [p.clone() for p in teacher.parameters()]
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters(), strict=True))
