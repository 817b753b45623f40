"""The `lora` method: PEFT LoRA injected per task, merged after it; adapters saved, reloaded and re-merged."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import CLIPModel

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.data.task import TaskStream
from hf_ccl.methods import ContinualMethod, build_methods, load_method_states, save_method_states
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.lora import (
    LoRA,
    LoRAMethodConfig,
    adapter_state,
    apply_adapter,
    inject_lora,
    load_adapter_folder,
    lora_layers,
    merge_lora,
    save_adapter_folder,
)
from hf_ccl.testing import tiny_clip

LAYER = "text_model.encoder.layers.0.self_attn.q_proj"


def _randomise_adapter(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every LoRA A and B random values (B starts at zero, which would make any merge check trivial)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _tokens(tokenizer):
    return tokenizer(["a photo of a cat", "two dogs play in the snow"], padding=True, return_tensors="pt")


def test_config_validation():
    with pytest.raises(ValueError, match="towers"):
        LoRA({"towers": ["audio"]})
    with pytest.raises(ValueError, match="target_modules"):
        LoRA({"target_modules": ["query"]})
    with pytest.raises(ValueError, match="Unknown option"):
        LoRA({"rank": 4})
    text_only = LoRAMethodConfig(towers=["text"], target_modules=["q_proj", "v_proj"]).to_peft()
    model = inject_lora(tiny_clip(num_layers=2), text_only, "x")
    assert sorted(lora_layers(model)) == [
        f"text_model.encoder.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")
    ]


def test_merge_equals_base_plus_scaled_BA_by_hand(clip_tokenizer):
    model = tiny_clip()
    model.align_special_tokens(clip_tokenizer)
    model.eval()
    base = model.get_submodule(LAYER).weight.detach().clone()
    config = LoRAMethodConfig(r=4, alpha=8.0)
    inject_lora(model, config.to_peft(), "task-0")
    _randomise_adapter(model)
    layer = model.get_submodule(LAYER)
    A, B = layer.lora_A["task-0"].weight.detach(), layer.lora_B["task-0"].weight.detach()
    inputs = _tokens(clip_tokenizer)
    with torch.no_grad():
        adapted = model.embed_texts(inputs.input_ids, inputs.attention_mask, normalize=False)
    state = adapter_state(model, "task-0")
    assert f"{LAYER}.lora_A.weight" in state and not any("task-0" in key for key in state)

    merge_lora(model, "task-0")
    assert not lora_layers(model) and not hasattr(model, "peft_config")
    assert type(model.get_submodule(LAYER)) is torch.nn.Linear
    expected = base + (8.0 / 4) * B @ A
    torch.testing.assert_close(model.get_submodule(LAYER).weight, expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        merged = model.embed_texts(inputs.input_ids, inputs.attention_mask, normalize=False)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)  # the merged model computes the same


def test_adapters_save_reload_with_peft_and_merge_to_same_weights(tmp_path):
    base = tiny_clip()
    base.save_pretrained(tmp_path / "base")
    config = LoRAMethodConfig(r=2, alpha=4.0, towers=["text", "vision"]).to_peft(str(tmp_path / "base"))
    model = tiny_clip()
    inject_lora(model, config, "task-0")
    _randomise_adapter(model)
    state = adapter_state(model, "task-0")
    merged = merge_lora(model, "task-0").state_dict()

    folder = save_adapter_folder(tmp_path / "adapters" / "task-0", config, state)
    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    # 1. plain PEFT: base CLIPModel + PeftModel.from_pretrained(folder) + merge_and_unload
    plain = CLIPModel.from_pretrained(tmp_path / "base")
    peft_merged = PeftModel.from_pretrained(plain, str(folder)).merge_and_unload().state_dict()
    # 2. our helpers: the folder read back, re-injected and merged into a fresh base
    loaded_config, loaded_state = load_adapter_folder(folder)
    assert loaded_config.base_model_name_or_path == str(tmp_path / "base")
    assert set(loaded_state) == set(state)
    ours = apply_adapter(tiny_clip(), loaded_config, loaded_state).state_dict()
    for key, value in merged.items():
        torch.testing.assert_close(peft_merged[key], value, rtol=0, atol=1e-6, msg=key)
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)


def test_state_dict_round_trip(tmp_path):
    method = LoRA({"r": 2})
    model = tiny_clip()
    inject_lora(model, method.peft_config(), "task-0")
    _randomise_adapter(model)
    method.adapters[0] = adapter_state(model, "task-0")
    method.base_models[0] = None
    save_method_states([method], tmp_path)
    restored = LoRA({"r": 2})
    load_method_states([restored], tmp_path)
    assert restored.base_models == {0: None}
    assert set(restored.adapters[0]) == set(method.adapters[0])
    for key, value in method.adapters[0].items():
        assert torch.equal(restored.adapters[0][key], value)


class _FrozenBaseProbe(ContinualMethod):
    """Placed before `lora`: snapshots the plain weights at task start and, after training (before the merge), checks
    that only the adapter moved."""

    name = "frozen-base-probe"

    def __init__(self):
        super().__init__()
        self.checked: list[int] = []

    def on_task_start(self, context):
        self.before = {k: v.detach().clone() for k, v in context.model.state_dict().items()}

    def after_training(self, context):
        model = context.model
        assert lora_layers(model), "the adapter is merged only after this probe runs"
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable), trainable
        lora_B = [p for n, p in model.named_parameters() if ".lora_B." in n]
        assert any(p.abs().sum() > 0 for p in lora_B), "the adapter did not train"
        for key, value in model.state_dict().items():
            if ".lora_" in key:
                continue
            assert torch.equal(value, self.before[key.replace(".base_layer.", ".")]), f"{key} changed in training"
        self.checked.append(context.task_index)


def _run(stream, tokenizer, output_dir, methods, model=None):
    training = {"max_steps": 8, "per_device_train_batch_size": 16, "learning_rate": 5e-3}
    args = ContinualArguments(output_dir=str(output_dir), training=training, progress=False, evaluation={"batch_size": 64})
    learner = ContinualLearner(model or tiny_clip(), stream, methods, load_image_processor(32), tokenizer, args)
    return learner, learner.fit()


def test_two_task_digits_run_merges_saves_and_loads_in_plain_transformers(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    model = tiny_clip()
    model.save_pretrained(tmp_path / "initial")
    probe = _FrozenBaseProbe()
    methods = [probe, *build_methods(["lora"], {"lora": {"r": 4, "alpha": 8}})]
    learner, results = _run(stream, clip_tokenizer, tmp_path / "run", methods, model=model)
    assert probe.checked == [0, 1]
    assert results.headline().shape == (2, 2)
    assert not lora_layers(learner.model)  # deployed: a plain CLIP
    lora = methods[1]
    assert sorted(lora.adapters) == [0, 1]
    assert lora.base_models[1] == str(tmp_path / "run" / "task-0")

    # The checkpoint is a plain CLIP: same embeddings in plain transformers.
    plain = CLIPModel.from_pretrained(tmp_path / "run" / "task-1")
    inputs = _tokens(clip_tokenizer)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = learner.model.embed_texts(inputs.input_ids, inputs.attention_mask, normalize=False)
        theirs = plain.get_text_features(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask)
        torch.testing.assert_close(theirs.pooler_output, ours, rtol=0, atol=1e-6)
        torch.testing.assert_close(plain.get_image_features(pixel_values=pixels).pooler_output,
                                   learner.model.embed_images(pixels, normalize=False), rtol=0, atol=1e-6)

    # Each task's PEFT adapter folder, put on the previous checkpoint with PEFT, merges to that task's checkpoint.
    bases = {0: tmp_path / "initial", 1: tmp_path / "run" / "task-0"}
    for k, base in bases.items():
        folder = tmp_path / "run" / "adapters" / f"task-{k}"
        merged = PeftModel.from_pretrained(CLIPModel.from_pretrained(base), str(folder)).merge_and_unload()
        saved = CLIPModel.from_pretrained(tmp_path / "run" / f"task-{k}").state_dict()
        for key, value in merged.state_dict().items():
            torch.testing.assert_close(value, saved[key], rtol=0, atol=1e-6, msg=f"task {k}: {key}")

    # The checkpoint's method state holds every adapter so far, and reloads.
    restored = LoRA({"r": 4, "alpha": 8})
    load_method_states([restored], tmp_path / "run" / "task-1")
    for k in (0, 1):
        assert all(torch.equal(restored.adapters[k][key], v) for key, v in lora.adapters[k].items())


def test_language_stream_text_only_lora(tmp_path, clip_tokenizer):
    """A language stream (English then German Flickr8k captions), LoRA on the text tower only (CLL-CLIP's setting)."""
    english = build_stream("flickr8k-random5", max_train_per_task=32, max_eval_per_task=16)
    german = build_stream("flickr8k-random5", language="de", max_train_per_task=32, max_eval_per_task=16)
    stream = TaskStream("flickr8k-en-de", [dataclasses.replace(english[0], name="en"),
                                           dataclasses.replace(german[1], name="de")])
    methods = build_methods(["lora"], {"lora": {"towers": ["text"], "target_modules": ["q_proj", "v_proj"],
                                                "trainable": ["text_model.embeddings.token_embedding.weight"]}})
    model = tiny_clip()
    vision_before = {k: v.clone() for k, v in model.vision_model.state_dict().items()}
    embedding_before = model.get_input_embeddings().weight.detach().clone()
    learner, results = _run(stream, clip_tokenizer, tmp_path, methods, model=model)
    assert results.headline().shape == (2, 2)
    for key, value in learner.model.vision_model.state_dict().items():
        assert torch.equal(value, vision_before[key]), key
    assert not torch.equal(learner.model.get_input_embeddings().weight, embedding_before)  # `trainable` trained
    assert all(k.startswith("text_model.") for k in methods[0].adapters[1])
    assert all(p.requires_grad for p in learner.model.parameters())  # flags restored after the task


def test_resuming_mid_task_continues_the_adapter(tmp_path, clip_tokenizer):
    """A task resumed from the Trainer's mid-task checkpoint (which holds the injected adapter) ends with exactly the
    adapter and merged model of an uninterrupted run."""
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    training = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "save_strategy": "steps",
                "save_steps": 2}

    def fit(resume):
        args = ContinualArguments(output_dir=str(tmp_path), training=training, progress=False, evaluation={"batch_size": 64},
                                  resume_from_checkpoint=resume, keep_trainer_checkpoints=True)
        methods = build_methods(["lora"], {"lora": {"r": 2}})
        learner = ContinualLearner(tiny_clip(), stream, methods, load_image_processor(32), clip_tokenizer, args)
        learner.fit()
        return methods[0], learner.model.state_dict()

    uninterrupted, weights = fit(None)
    shutil.rmtree(tmp_path / "task-1")  # stopped in task 1, after its Trainer checkpoint at step 2
    shutil.rmtree(tmp_path / "trainer" / "task-1" / "checkpoint-4")
    resumed, resumed_weights = fit(True)
    for key, value in uninterrupted.adapters[1].items():
        assert torch.equal(resumed.adapters[1][key], value), key
    for key, value in weights.items():
        assert torch.equal(resumed_weights[key], value), key


def test_a_tasks_adapter_starts_from_the_tasks_seed_whatever_the_global_rng(tmp_path, clip_tokenizer):
    """The loop seeds the task-start hooks with the task's seed, so a task's adapter is initialised alike in a run
    and in one resumed before it (whose global RNG has had another history)."""
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:2]

    def initial_adapter(rng_seed: int) -> dict[str, torch.Tensor]:
        args = ContinualArguments(output_dir=str(tmp_path), progress=False, seed=3)
        learner = ContinualLearner(tiny_clip(), stream, build_methods(["lora"]), load_image_processor(32),
                                   clip_tokenizer, args)
        context = TaskContext(1, stream[1], stream, learner.model, output_dir=tmp_path, seed=args.seed + 1,
                              tokenizer=clip_tokenizer)
        torch.manual_seed(rng_seed)  # the global RNG's history: a run's task 0, or a resume's restore
        learner._start_task(context)
        return adapter_state(learner.model, "task-1")

    first, second = initial_adapter(0), initial_adapter(1)
    assert any("lora_A" in key for key in first)
    for key, value in first.items():
        assert torch.equal(second[key], value), key


# ----- sizes: refused before anything is built ----------------------------------------------------------------------
TINY_RUN = ["train", "--config", "digits", "methods=[lora]", "model.config.hidden_size=32", "model.config.num_layers=1",
            "model.config.projection_dim=32"]


@pytest.mark.parametrize("rank", [10**6, 33])
def test_a_rank_above_the_layers_rank_is_refused_by_the_cli_before_anything_is_built(tmp_path, capsys, rank):
    """`method_args.lora.r=10^6` used to allocate until memory ran out: it is refused at once (exit 2, nothing
    written) with the bound, the rank of the adapted layers (32 x 32 attention projections of a hidden-32 CLIP)."""
    from hf_ccl.cli import main

    code = main([*TINY_RUN, f"method_args.lora.r={rank}", f"output_dir={tmp_path / 'run'}"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (tmp_path / "run").exists()
    assert len(error) == 1 and error[0].startswith(f"hf-ccl: error: method_args.lora.r={rank} exceeds the rank")
    assert "set r <= 32" in error[0]


def test_the_rank_bound_is_the_smallest_adapted_layers_rank():
    """r = min(d_in, d_out) of the smallest targeted linear passes, one more is refused, on the meta-device skeleton
    of the run and on the real model at task start (the Python path), before any adapter is injected."""
    from hf_ccl.methods.sizes import model_skeleton
    from hf_ccl.validation import ConfigError

    skeleton = model_skeleton({"config": {"hidden_size": 32, "num_layers": 1, "projection_dim": 32}})
    LoRA({"r": 32, "target_modules": ["fc1", "fc2"]}).check_model(skeleton)
    with pytest.raises(ConfigError, match=r"fc1 is 128 x 32 \(rank <= 32\)") as caught:  # 4 x 32 wide, rank 32
        LoRA({"r": 33, "target_modules": ["fc1"]}).check_model(skeleton)
    assert caught.value.key == "method_args.lora.r"
    model = tiny_clip()
    context = TaskContext(task_index=0, task=None, stream=TaskStream("s", []), model=model)
    with pytest.raises(ConfigError, match="exceeds the rank"):
        LoRA({"r": 33}).on_task_start(context)
    assert not lora_layers(model)
