"""The method hooks, driven by a real 2-task run: call order, gradient edits before the step, logged loss terms."""

import math

import pytest
import torch
from transformers import TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import TrainingLogRecorder, tiny_clip
from hf_ccl.trainer import NonFiniteLossError


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
        output_dir=str(tmp_path), training={"max_steps": 1, "per_device_train_batch_size": 16, "warmup_steps": 0},
        progress=False
    )
    learner = ContinualLearner(model, stream, build_methods(["finetune"]), load_image_processor(32), clip_tokenizer, args)
    learner.fit()
    assert learner.model.logit_scale.item() == pytest.approx(math.log(100.0))


# ----- the non-finite check stays on the device between logging steps (issue 14) ----------------------------------
class _NaNFrom(ContinualMethod):
    """A NaN loss term from training step `step` on; optionally a solver that fails on NaN gradients."""

    name = "nan-from"

    def __init__(self, step: int, fail_on_nan_grad: bool = False):
        super().__init__()
        self.step, self.fail_on_nan_grad, self.calls = step, fail_on_nan_grad, 0

    def loss_terms(self, model, inputs, outputs, context):
        self.calls += 1
        value = float("nan") if self.calls >= self.step else 0.0
        return {"broken": value * model.text_projection.weight.sum()}  # NaN gradients too

    def pre_optimizer_step(self, model, context):
        grad = model.text_projection.weight.grad
        if self.fail_on_nan_grad and not torch.isfinite(grad).all():
            raise RuntimeError("the solver found no solution")  # what an SVD or a QP on NaN gradients would do

    def metrics(self):
        return {"calls": torch.tensor(float(self.calls))}


def _fit_nan(tmp_path, clip_tokenizer, method, **training):
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=8)
    stream.tasks = stream.tasks[:1]
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, evaluation={"initial": False},
                              training={"per_device_train_batch_size": 16, "max_steps": 6, "warmup_steps": 0,
                                        **training})
    recorder = _Logs()
    learner = ContinualLearner(tiny_clip(), stream, [*build_methods(["finetune"]), method], load_image_processor(32),
                               clip_tokenizer, args, callbacks=[recorder])
    return learner, recorder


class _Logs(TrainerCallback):
    """Every `on_log` of the run, as it happens (a task that fails keeps what it logged)."""

    def __init__(self):
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({**(logs or {}), "step": state.global_step})


def test_nan_between_logging_steps_names_its_first_step(tmp_path, clip_tokenizer):
    learner, recorder = _fit_nan(tmp_path, clip_tokenizer, _NaNFrom(step=5), logging_steps=4, max_steps=8)
    with pytest.raises(NonFiniteLossError, match=r"task 0 \('digits-01'\), step 5; no checkpoint.*"
                                                 r"contrastive=\d.*nan-from/broken=nan.*Found at the log of step 8"):
        learner.fit()
    steps = [log for log in recorder.logs if "loss" in log]
    assert [log["step"] for log in steps] == [4] and all(math.isfinite(log["loss"]) for log in steps)
    assert steps[0]["nan-from/calls"] == pytest.approx(2.5)  # a tensor metric, averaged over steps 1-4
    assert not (tmp_path / "task-0").exists()


def test_nan_is_found_before_a_checkpoint_is_saved(tmp_path, clip_tokenizer):
    learner, _ = _fit_nan(tmp_path, clip_tokenizer, _NaNFrom(step=3), logging_steps=100, save_strategy="steps",
                          save_steps=2)
    with pytest.raises(NonFiniteLossError, match=r"step 3;.*Found before saving checkpoint-4"):
        learner.fit()
    saved = sorted(path.name for path in (tmp_path / "trainer" / "task-0").glob("checkpoint-*"))
    assert saved == ["checkpoint-2"]  # the last finite model; nothing after the NaN


def test_a_hook_failing_on_nan_gradients_reports_the_loss(tmp_path, clip_tokenizer):
    learner, _ = _fit_nan(tmp_path, clip_tokenizer, _NaNFrom(step=2, fail_on_nan_grad=True), logging_steps=100)
    with pytest.raises(NonFiniteLossError, match=r"step 2;.*when training failed with RuntimeError: the solver") as error:
        learner.fit()
    assert isinstance(error.value.__cause__, RuntimeError)


def test_metrics_must_be_numbers_or_one_element_tensors(tmp_path, clip_tokenizer):
    class _BadMetric(ContinualMethod):
        name = "bad-metric"

        def metrics(self):
            return {"pair": torch.zeros(2)}

    learner, _ = _fit_nan(tmp_path, clip_tokenizer, _BadMetric(), max_steps=1)
    with pytest.raises(TypeError, match=r"bad-metric/pair must be a number or a one-element tensor, got shape \(2,\)"):
        learner.fit()


# ----- an update that overflows: the loss before it was finite (issue 25, item 10) -------------------------------
class _NaNAfterLastStep(ContinualMethod):
    """Sets a weight to NaN after the last optimizer step of task `task` (what lr=1e30 does to the last update: the
    loss of that step, computed before it, is finite)."""

    name = "nan-after-last-step"

    def __init__(self, task: int):
        super().__init__()
        self.task = task

    def post_optimizer_step(self, model, context):
        if context.task_index == self.task and context.global_step == context.training_args.max_steps - 1:
            with torch.no_grad():
                model.text_projection.weight[0, 0] = float("nan")


def test_a_nan_weight_after_the_last_update_is_neither_evaluated_nor_saved(tmp_path, clip_tokenizer):
    from hf_ccl.checkpoint_files import verify_checkpoint
    from hf_ccl.trainer import NonFiniteModelError

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=8)
    stream.tasks = stream.tasks[:2]
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, evaluation={"initial": False},
                              training={"per_device_train_batch_size": 16, "max_steps": 2})
    learner = ContinualLearner(tiny_clip(), stream, [*build_methods(["finetune"]), _NaNAfterLastStep(1)],
                               load_image_processor(32), clip_tokenizer, args)
    with pytest.raises(NonFiniteModelError, match=rf"task 1 \('digits-23'\), step 2; the last good checkpoint is "
                                                  rf"kept at {tmp_path / 'task-0'}: weight text_projection\.weight, "
                                                  r"output text_features on the last training batch hold NaN.*found "
                                                  r"when the task's training ended"):
        learner.fit()
    verify_checkpoint(tmp_path / "task-0")  # the previous task's checkpoint, intact
    assert not (tmp_path / "task-1").exists() and learner.results.num_trained == 1  # neither evaluated nor saved


CLI_RUN = ["train", "--config", "digits", "progress=false", "training.max_steps=2",
           "training.per_device_train_batch_size=16", "stream_args.max_train_per_task=32",
           "stream_args.max_eval_per_task=12", "model.config.hidden_size=32", "model.config.num_layers=1"]


def test_a_diverging_cli_run_exits_1_naming_the_step_and_saves_nothing_of_it(tmp_path, capsys):
    """`training.learning_rate=1e30`: its last update overflows (the loss before it is finite); the run exited 0
    and scored 100 % on every task. The Trainer checkpoint of the step before is kept; none of the diverged model."""
    from hf_ccl.cli import main

    overrides = [f"output_dir={tmp_path}", "training.learning_rate=1e30", "training.save_strategy=steps",
                 "training.save_steps=1"]
    assert main([*CLI_RUN, *overrides]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("hf-ccl: error: Non-finite model at task 0 ('digits-01'), step 2; no checkpoint was "
                                "written yet: output image_features on the last training batch")
    assert "found before saving checkpoint-2" in error[-1] and "resume_from_checkpoint=auto" in error[-1]
    assert not (tmp_path / "task-0").exists() and not (tmp_path / "results.json").exists()
    assert [path.name for path in (tmp_path / "trainer" / "task-0").glob("checkpoint-*")] == ["checkpoint-1"]


@pytest.mark.slow
def test_a_diverged_task_resumes_with_a_sane_learning_rate(tmp_path, capsys):
    """Through the CLI: a run stopped after task 1 resumed with `training.learning_rate=1e30` (allowed) exits 1
    naming task 2 and its step, task 1's checkpoint intact and nothing of task 2 saved; resumed again with a sane lr
    it finishes with the matrix of the run that never diverged."""
    import json
    import shutil

    from hf_ccl.checkpoint_files import verify_checkpoint
    from hf_ccl.cli import main

    run = [*CLI_RUN, f"output_dir={tmp_path}"]
    resume = ["resume_from_checkpoint=true", "resume_allow_changes=[training.learning_rate]"]
    assert main(run) == 0
    reference = json.loads((tmp_path / "results.json").read_text())["rows"]
    for index in (2, 3, 4):  # as if the run had been stopped after task 1
        shutil.rmtree(tmp_path / f"task-{index}")
    capsys.readouterr()

    assert main([*run, *resume, "training.learning_rate=1e30"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("hf-ccl: error: Non-finite model at task 2 ('digits-45'), step 2; the last good "
                            f"checkpoint is kept at {tmp_path / 'task-1'}: output image_features")
    assert not (tmp_path / "task-2").exists()
    verify_checkpoint(tmp_path / "task-1")

    assert main([*run, *resume, "training.learning_rate=1e-3"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == reference


def test_a_non_finite_model_is_not_scored_by_the_loop(tmp_path, clip_tokenizer):
    """Evaluation's own check, through the loop: a model whose image tower outputs NaN (a checkpoint saved by a run
    without these checks) fails at the initial evaluation, naming the model, the step and the task."""
    from hf_ccl.evaluation import NonFiniteEmbeddingError

    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:1]
    model = tiny_clip()
    with torch.no_grad():
        model.visual_projection.weight.fill_(float("nan"))
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, training={"max_steps": 1, "warmup_steps": 0})
    learner = ContinualLearner(model, stream, build_methods(["finetune"]), load_image_processor(32), clip_tokenizer,
                               args)
    with pytest.raises(NonFiniteEmbeddingError, match=r"Non-finite embeddings of the initial model \(global step 0; "
                                                      r"no checkpoint was written\): task 'digits-01', eval split: "
                                                      r"image_embeds: 8 of 8 rows"):
        learner.fit()
    assert not (tmp_path / "results.json").exists()
