"""The method hooks, driven by a real 2-task run: call order, gradient edits before the step, logged loss terms."""

import pytest
import torch

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import TrainingLogRecorder, tiny_clip


class _Recorder(ContinualMethod):
    """Records hook calls, freezes the vision tower by zeroing its gradients, adds a small L2 term."""

    name = "recorder"

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.saw_gradients = False

    def on_task_start(self, context):
        self.calls.append(f"start{context.task_index}")

    def train_dataset(self, context, dataset):
        self.calls.append(f"data{context.task_index}")
        return dataset.select(range(32))

    def loss_terms(self, model, inputs, outputs, context):
        return {"l2": 1e-4 * model.text_projection.weight.pow(2).sum()}

    def pre_optimizer_step(self, model, context):
        if "pre_step" not in self.calls[-1:]:
            self.calls.append("pre_step")
        grads = [p.grad for p in model.vision_model.parameters() if p.grad is not None]
        self.saw_gradients = self.saw_gradients or bool(grads)
        for grad in grads:
            grad.zero_()

    def on_task_end(self, context):
        self.calls.append(f"end{context.task_index}")
        assert context.image_processor is not None and context.tokenizer is not None
        assert len(context.train_dataset) == 32 and not context.collator.train

    def metrics(self):
        return {"half": 0.5}


def test_hooks_run_in_order_and_edit_gradients(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    model = tiny_clip(seed=0)
    vision_before = {n: p.detach().clone() for n, p in model.vision_model.named_parameters()}
    text_before = model.text_projection.weight.detach().clone()
    recorder = _Recorder()
    args = ContinualArguments(
        output_dir=str(tmp_path),
        # No weight decay: with zero gradients AdamW leaves the vision tower exactly unchanged.
        training={"max_steps": 3, "per_device_train_batch_size": 16, "logging_steps": 1, "weight_decay": 0.0},
        progress=False,
    )
    learner = ContinualLearner(
        model, stream, [*build_methods(["finetune"]), recorder], load_image_processor(32), clip_tokenizer, args
    )
    learner.fit()
    assert recorder.calls == ["start0", "data0", "pre_step", "end0", "start1", "data1", "pre_step", "end1"]
    assert recorder.saw_gradients
    for name, param in learner.model.vision_model.named_parameters():
        assert torch.equal(param, vision_before[name]), name
    assert not torch.equal(learner.model.text_projection.weight, text_before)


def test_each_loss_term_is_logged(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:1]
    args = ContinualArguments(
        output_dir=str(tmp_path), training={"max_steps": 2, "per_device_train_batch_size": 16, "logging_steps": 1},
        progress=False,
    )
    recorder = TrainingLogRecorder()
    learner = ContinualLearner(tiny_clip(), stream, [_Recorder()], load_image_processor(32), clip_tokenizer, args,
                               task_callbacks=[recorder])
    learner.fit()
    trainer_logs = recorder.logs[0]
    step_logs = [log for log in trainer_logs if "loss" in log]
    assert step_logs and all("loss/contrastive" in log and "loss/recorder/l2" in log for log in step_logs)
    assert all(log["recorder/half"] == 0.5 for log in step_logs)  # metrics() are logged, not added to the loss
    for log in step_logs:
        assert abs(log["loss"] - (log["loss/contrastive"] + log["loss/recorder/l2"])) < 1e-3


def test_logit_scale_is_clamped_after_each_step(tmp_path, clip_tokenizer):
    import math

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:1]
    model = tiny_clip()
    with torch.no_grad():
        model.logit_scale.fill_(7.0)  # exp(7) = 1097 > 100
    args = ContinualArguments(
        output_dir=str(tmp_path), training={"max_steps": 1, "per_device_train_batch_size": 16}, progress=False
    )
    learner = ContinualLearner(model, stream, build_methods(["finetune"]), load_image_processor(32), clip_tokenizer, args)
    learner.fit()
    assert learner.model.logit_scale.item() == pytest.approx(math.log(100.0))
