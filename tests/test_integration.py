"""End to end on real data: 3-task streams on digits and on a few dozen Flickr8k images.

Checks that learning and forgetting are real and measured, that each task's checkpoint is complete and loads with
plain `transformers.CLIPModel` giving the same embeddings, and that a NaN loss stops the run with a clear error.
"""

import json

import pytest
import torch
from transformers import CLIPModel, CLIPProcessor

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, decode_image, load_image_processor
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import tiny_clip
from hf_ccl.trainer import NonFiniteLossError


def _fit(stream, tokenizer, output_dir, training, model=None, methods=None):
    args = ContinualArguments(output_dir=str(output_dir), training=training, progress=False)
    model = model or tiny_clip(seed=0)
    learner = ContinualLearner(
        model, stream, methods or build_methods(["finetune"]), load_image_processor(32), tokenizer, args
    )
    return learner, learner.fit()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, clip_tokenizer):
    stream = build_stream("digits", max_eval_per_task=60)
    stream.tasks = stream.tasks[:3]
    training = {"num_train_epochs": 6, "per_device_train_batch_size": 32, "learning_rate": 1e-3,
                "warmup_steps": 0.1, "lr_scheduler_type": "cosine"}
    output_dir = tmp_path_factory.mktemp("digits")
    model = tiny_clip(seed=0, hidden_size=64, num_layers=2, projection_dim=64)
    learner, results = _fit(stream, clip_tokenizer, output_dir, training, model=model)
    return learner, results, output_dir


def test_digits_diagonal_beats_chance_and_finetune_forgets(digits_run):
    _, results, _ = digits_run
    matrix = results.headline()  # accuracy in %, zero-shot among each task's 2 classes: chance is 50
    assert matrix.shape == (3, 3)
    assert all(matrix[k, k] >= 75.0 for k in range(3)), matrix
    assert matrix[2, 0] <= matrix[0, 0] - 15.0, matrix  # the first task is forgotten under finetune
    summary = results.summary()
    assert summary["forgetting"] > 0 and summary["backward_transfer"] < 0


def test_digits_checkpoints_are_complete_and_plain(digits_run, clip_tokenizer):
    learner, results, output_dir = digits_run
    for k in range(3):
        folder = output_dir / f"task-{k}"
        for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer_config.json",
                     "method_state.json", "results.json", "results.md", "continual_state.json"):
            assert (folder / name).exists(), f"{folder / name} missing"
        saved = json.loads((folder / "results.json").read_text())
        assert len(saved["rows"]) == k + 1
    assert not list(output_dir.glob("*.partial"))
    plain = CLIPModel.from_pretrained(output_dir / "task-2")
    processor = CLIPProcessor.from_pretrained(output_dir / "task-2")
    task = learner.stream[0]
    images = [decode_image(task.eval[i]["image"], where="test") for i in range(8)]
    inputs = processor(images=images, text=[t[0] for t in task.eval[:8]["texts"]], return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        ours_image = learner.model.embed_images(inputs.pixel_values, normalize=False)
        ours_text = learner.model.embed_texts(inputs.input_ids, inputs.attention_mask, normalize=False)
        plain_image = plain.get_image_features(pixel_values=inputs.pixel_values).pooler_output
        plain_text = plain.get_text_features(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).pooler_output
    assert torch.allclose(ours_image, plain_image, atol=1e-5)
    assert torch.allclose(ours_text, plain_text, atol=1e-5)


def test_flickr8k_few_dozen_images(tmp_path, clip_tokenizer):
    stream = build_stream("flickr8k-random5", max_train_per_task=16, max_eval_per_task=16)
    stream.tasks = stream.tasks[:3]
    for task in stream.tasks:  # score each task on its own 16 images: can the model fit them at all?
        task.eval = task.train
    training = {"num_train_epochs": 30, "per_device_train_batch_size": 16, "learning_rate": 2e-3}
    _, results = _fit(stream, clip_tokenizer, tmp_path, training)
    matrix, initial = results.headline(), results.initial_headline()
    assert all(matrix[k, k] >= initial[k] + 30.0 for k in range(3)), (matrix, initial)  # R_mean in %
    assert matrix[2, 0] < matrix[0, 0] - 10.0, matrix
    row = results.rows[0].metrics[stream[0].name]
    assert {"i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "R_mean"} <= set(row)


class _NaNAtStep(ContinualMethod):
    """Returns a NaN loss term on task 1 from its third step on."""

    name = "nan-at-step"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def loss_terms(self, model, inputs, outputs, context):
        if context.task_index == 1:
            self.calls += 1
            if self.calls >= 3:
                return {"broken": torch.tensor(float("nan"))}
        return {}


def test_nan_loss_stops_with_task_and_step_and_keeps_last_checkpoint(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    training = {"max_steps": 5, "per_device_train_batch_size": 16}
    with pytest.raises(NonFiniteLossError, match=r"task 1 \('digits-23'\), step 3.*task-0.*nan-at-step/broken=nan"):
        _fit(stream, clip_tokenizer, tmp_path, training, methods=[*build_methods(["finetune"]), _NaNAtStep()])
    assert (tmp_path / "task-0" / "model.safetensors").exists()
    assert not (tmp_path / "task-1").exists()
