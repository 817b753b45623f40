"""The `prompt` method: CoOp context vectors after BOS, through CLIP's own text path, used in training and evaluation."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import CLIPModel

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.data.task import TaskStream
from hf_ccl.evaluation.encode import encode_texts
from hf_ccl.evaluation.evaluator import evaluate_task
from hf_ccl.methods import ContinualMethod, TaskContext, build_methods, load_method_states, save_method_states
from hf_ccl.methods.prompt import PromptLearning, TextPrompt, fit_length, load_prompt, load_prompted_model
from hf_ccl.testing import tiny_clip

TEXTS = ["a cat", "two dogs play in the snow near a red house", "x"]


def _model(tokenizer, **overrides):
    model = tiny_clip(**overrides)
    model.align_special_tokens(tokenizer)
    return model.eval()


def _features(model, tokens):
    with torch.no_grad():
        return model.get_text_features(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).pooler_output


def test_zero_context_equals_get_text_features(clip_tokenizer):
    model = _model(clip_tokenizer)
    tokens = clip_tokenizer(TEXTS, padding=True, return_tensors="pt")
    plain = _features(model, tokens)
    model.text_prompt = TextPrompt(0, model.config.text_config.hidden_size)
    assert torch.equal(_features(model, tokens), plain)
    model.text_prompt = TextPrompt(3, model.config.text_config.hidden_size)
    assert not torch.allclose(_features(model, tokens), plain)
    model.text_prompt = None  # the hook is off again: CLIP's own path
    assert torch.equal(_features(model, tokens), plain)


@pytest.mark.parametrize("max_positions", [77, 12])
def test_context_of_word_embeddings_equals_the_words_in_the_text(clip_tokenizer, max_positions):
    """Context vectors set to the token embeddings of 'a photo of' give exactly the plain CLIP features of
    'a photo of <text>': positions, masks, EOS pooling and (with 12 positions) truncation all line up."""
    model = _model(clip_tokenizer, max_position_embeddings=max_positions)
    phrase = clip_tokenizer("a photo of", add_special_tokens=False)["input_ids"]
    ctx = model.get_input_embeddings().weight[phrase].detach()
    long_text = "a very long caption " * 20
    texts = [*TEXTS, long_text]
    expected = _features(model, clip_tokenizer(
        [f"a photo of {t}" for t in texts], padding=True, truncation=True, max_length=max_positions,
        return_tensors="pt"))
    model.text_prompt = TextPrompt(len(phrase), ctx.shape[1], ctx=ctx)
    tokens = clip_tokenizer(texts, padding=True, truncation=True, max_length=max_positions, return_tensors="pt")
    torch.testing.assert_close(_features(model, tokens), expected, rtol=0, atol=1e-6)


def test_fit_length_keeps_eos_last():
    eos = 9
    ids = torch.tensor([[8, 1, 2, 3, 4, eos, eos], [8, 1, eos, eos, eos, eos, eos]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
    new_ids, new_mask = fit_length(ids, mask, room=4, eos_token_id=eos)
    assert new_ids.tolist() == [[8, 1, 2, eos], [8, 1, eos, eos]]
    assert new_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert fit_length(ids, mask, room=7, eos_token_id=eos)[0] is ids


def _context(model, index, tokenizer, tmp_path, seed=0):
    stream = TaskStream("s", [])
    return TaskContext(task_index=index, task=None, stream=stream, model=model, output_dir=tmp_path, seed=seed,
                       tokenizer=tokenizer)


def test_only_the_prompt_trains_and_flags_are_restored(clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer).train()
    method = PromptLearning({"n_ctx": 4})
    method.on_task_start(_context(model, 0, clip_tokenizer, tmp_path))
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["text_prompt.ctx"]
    tokens = clip_tokenizer(TEXTS, padding=True, return_tensors="pt")
    output = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                   pixel_values=torch.randn(3, 3, 32, 32), return_loss=True)
    output.loss.backward()
    assert model.text_prompt.ctx.grad.abs().sum() > 0
    method.after_training(_context(model, 0, clip_tokenizer, tmp_path))
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("text_prompt."))
    assert torch.equal(method.prompts[0], model.text_prompt.ctx.detach())


def test_schedules_and_init(clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer)
    per_task = PromptLearning({"n_ctx": 2})
    shared = PromptLearning({"n_ctx": 2, "schedule": "shared"})
    for method in (per_task, shared):
        method.prompts[0] = torch.ones(2, 32)
    assert torch.equal(shared.initial_context(_context(model, 1, clip_tokenizer, tmp_path)), torch.ones(2, 32))
    fresh = per_task.initial_context(_context(model, 1, clip_tokenizer, tmp_path, seed=1))
    assert fresh.shape == (2, 32) and 0.01 < fresh.std() < 0.04  # N(0, 0.02^2)
    phrase = PromptLearning({"ctx_init": "a photo of a"})
    ctx = phrase.initial_context(_context(model, 0, clip_tokenizer, tmp_path))
    ids = clip_tokenizer("a photo of a", add_special_tokens=False)["input_ids"]
    assert torch.equal(ctx, model.get_input_embeddings().weight[ids].detach())
    with pytest.raises(ValueError, match="schedule"):
        PromptLearning({"schedule": "sometimes"})
    with pytest.raises(ValueError, match="match no parameter"):
        PromptLearning({"trainable": ["no_such.weight"]}).on_task_start(_context(model, 0, clip_tokenizer, tmp_path))


def test_state_dict_round_trip(tmp_path):
    method = PromptLearning({"n_ctx": 3})
    method.prompts = {0: torch.randn(3, 32), 1: torch.randn(3, 32)}
    method.deployed = 1
    save_method_states([method], tmp_path)
    restored = PromptLearning({"n_ctx": 3})
    load_method_states([restored], tmp_path)
    assert restored.deployed == 1 and all(torch.equal(restored.prompts[k], method.prompts[k]) for k in (0, 1))


def _run(stream, tokenizer, output_dir, methods, model):
    training = {"max_steps": 8, "per_device_train_batch_size": 16, "learning_rate": 5e-2}
    args = ContinualArguments(output_dir=str(output_dir), training=training, progress=False, evaluation={"batch_size": 64})
    learner = ContinualLearner(model, stream, methods, load_image_processor(32), tokenizer, args)
    return learner, learner.fit()


class _PromptCallCounter(ContinualMethod):
    """Placed after `prompt`: counts the prompt's forward calls in training and in the evaluation after it."""

    name = "prompt-call-counter"

    def __init__(self):
        super().__init__()
        self.calls: list[dict[str, int]] = []

    def on_task_start(self, context):
        counts = {"train": 0, "eval": 0}
        self.calls.append(counts)

        def count(module, args, output):
            counts["train" if torch.is_grad_enabled() else "eval"] += 1

        self.handle = context.model.text_prompt.register_forward_hook(count)

    def on_task_end(self, context):  # after the task's evaluation
        self.handle.remove()


def test_two_task_digits_run_evaluates_with_the_prompt_and_saves_it_beside_a_plain_clip(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    model = tiny_clip()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    counter = _PromptCallCounter()
    methods = [*build_methods(["prompt"], {"prompt": {"n_ctx": 4}}), counter]
    learner, results = _run(stream, clip_tokenizer, tmp_path, methods, model)
    assert all(c["train"] >= 8 and c["eval"] >= 2 for c in counter.calls), counter.calls  # 8 steps; 2 eval tasks
    method = methods[0]
    assert sorted(method.prompts) == [0, 1] and method.deployed == 1
    assert not torch.equal(method.prompts[0], method.prompts[1])

    # The checkpoint holds the unchanged CLIP (no prompt in it): it loads in plain transformers.
    folder = tmp_path / "task-1"
    assert not any(key.startswith("text_prompt") for key in load_file(str(folder / "model.safetensors")))
    plain = CLIPModel.from_pretrained(folder)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, initial[key]), key

    # The prompt is in the method state; with it, the checkpoint embeds texts as the run's model did.
    prompted = load_prompted_model(folder)
    assert torch.equal(prompted.text_prompt.ctx.detach(), learner.model.text_prompt.ctx.detach())
    assert torch.equal(load_prompt(folder, 0).ctx.detach(), method.prompts[0])
    texts = ["a photo of the digit 2.", "a photo of the digit 3."]
    ours = encode_texts(learner.model, clip_tokenizer, texts)
    torch.testing.assert_close(encode_texts(prompted, clip_tokenizer, texts), ours, rtol=0, atol=1e-6)
    assert not torch.allclose(encode_texts(plain, clip_tokenizer, texts), ours)

    # Evaluation used the prompt: the results row is what the prompted checkpoint scores, not the plain one.
    processor = load_image_processor(32)
    row = results.rows[-1].metrics[stream[1].name]
    assert evaluate_task(prompted, stream[1], processor, clip_tokenizer) == pytest.approx(row)


def test_language_stream_shared_prompt(tmp_path, clip_tokenizer):
    """A language stream (English then German Flickr8k captions), one prompt continued through both tasks, the token
    embedding trained too."""
    english = build_stream("flickr8k-random5", max_train_per_task=32, max_eval_per_task=16)
    german = build_stream("flickr8k-random5", language="de", max_train_per_task=32, max_eval_per_task=16)
    stream = TaskStream("flickr8k-en-de", [dataclasses.replace(english[0], name="en"),
                                           dataclasses.replace(german[1], name="de")])
    methods = build_methods(["prompt"], {"prompt": {
        "ctx_init": "a photo of", "schedule": "shared", "trainable": ["text_model.embeddings.token_embedding.weight"]}})
    model = tiny_clip()
    embedding_before = model.get_input_embeddings().weight.detach().clone()
    learner, results = _run(stream, clip_tokenizer, tmp_path, methods, model)
    assert results.headline().shape == (2, 2)
    assert methods[0].prompts[0].shape == (3, 32)
    assert not torch.equal(learner.model.get_input_embeddings().weight, embedding_before)
    saved = CLIPModel.from_pretrained(tmp_path / "task-1").text_model.embeddings.token_embedding.weight
    assert torch.equal(saved, learner.model.get_input_embeddings().weight)  # trained base weights are saved


def test_resuming_mid_task_restores_the_prompt_being_trained(tmp_path, clip_tokenizer):
    """The Trainer's mid-task checkpoints do not hold the prompt in model.safetensors (it is never saved there): the
    method state carries it, and a resumed task ends with exactly the prompt of an uninterrupted run."""
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    training = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "save_strategy": "steps",
                "save_steps": 2}

    def fit(resume):
        args = ContinualArguments(output_dir=str(tmp_path), training=training, progress=False, evaluation={"batch_size": 64},
                                  resume_from_checkpoint=resume, keep_trainer_checkpoints=True)
        methods = build_methods(["prompt"], {"prompt": {"n_ctx": 2}})
        ContinualLearner(tiny_clip(), stream, methods, load_image_processor(32), clip_tokenizer, args).fit()
        return methods[0]

    uninterrupted = fit(None)
    shutil.rmtree(tmp_path / "task-1")  # stopped in task 1, after its Trainer checkpoint at step 2
    shutil.rmtree(tmp_path / "trainer" / "task-1" / "checkpoint-4")
    resumed = fit(True)
    assert torch.equal(resumed.prompts[0], uninterrupted.prompts[0])
    assert torch.equal(resumed.prompts[1], uninterrupted.prompts[1])
