"""The `lada` method (LADA, Luo et al. ICML 2025): each equation by hand (the label-specific scores, the class-balanced
cross-entropy of Eq. 3, the Gaussian components and the distillation draws of Eq. 4 in both variants), the scorer the
evaluator ranks classes with, and one CLI run on the bundled digits stream, task-agnostic, loaded back as its card says.
Exact resume, accumulation, bf16, compile, no host sync and two processes: the every-method matrix."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import CLIPModel

from hf_ccl.data import build_stream
from hf_ccl.methods.lada import LADA, class_balanced_cross_entropy, load_lada_model
from hf_ccl.methods.lada_memory import LADAMemory, LADATask, gaussian_components, kmeans
from hf_ccl.testing import tiny_model


def _memory(alpha=0.5, beta=2.0, scale=10.0) -> LADAMemory:
    """One learned task of two classes in 2 dimensions, two units each (the second class's second unit unused)."""
    memory = LADAMemory(alpha, beta, scale)
    text = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    units = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.6, 0.8], [0.0, 0.0]]])
    valid = torch.tensor([[True, True], [True, False]])
    memory.add_task(["cat", "dog"], LADATask(text, units, torch.tensor([[0.5, 0.5], [1.0, 0.0]]), units,
                                             torch.full((2, 2, 2), 1e-4), valid))
    return memory


def test_label_specific_scores_by_hand():
    """s_c(v) = exp(t) cos(v, t_c) + α Σ_l valid exp(-β (1 - v·w_c(l))); an unlearned class: exp(t) cos(v, e_c)."""
    memory = _memory()
    v = torch.tensor([[1.0, 0.0]])
    cat = 10 * (1 / math.sqrt(2)) + 0.5 * (math.exp(0.0) + math.exp(-2.0))
    dog = 10 * 0.0 + 0.5 * math.exp(-2.0 * (1 - 0.6))  # the unused unit adds nothing
    assert memory.learned_scores(v, ["cat", "dog"])[0].tolist() == pytest.approx([cat, dog])
    assert memory.learned_scores(v, ["dog", "cat"])[0].tolist() == pytest.approx([dog, cat])  # by name, any order
    # the evaluator's hook: an unseen class ("owl") by its zero-shot embedding, image embeddings not normalised
    class_embeds = F.normalize(torch.tensor([[5.0, 5.0], [1.0, 0.0], [0.0, 1.0]]), dim=-1)
    scores = memory.class_scores(torch.tensor([[3.0, 0.0]]), class_embeds, ["dog", "owl", "cat"])
    assert scores[0].tolist() == pytest.approx([dog, 10.0, cat])
    assert LADAMemory(1.0, 1.0, 1.0).class_scores(v, class_embeds[:1], ["cat"]) is None  # nothing learned: cosine
    with pytest.raises(KeyError, match="owl"):
        memory.learned_scores(v, ["owl"])


def test_class_balanced_cross_entropy_by_hand():
    """Paper Eq. 3: Σ_j 1/|D_j| Σ_{v in D_j} CE(v, j) — the mean per class, summed over the classes present."""
    scores = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 3.0, 0.0]])
    targets = torch.tensor([0, 0, 1])

    def ce(row, j):
        return -math.log(math.exp(scores[row, j]) / sum(math.exp(x) for x in scores[row].tolist()))

    expected = (ce(0, 0) + ce(1, 0)) / 2 + ce(2, 1)
    assert class_balanced_cross_entropy(scores, targets, 3).item() == pytest.approx(expected, rel=1e-6)


def test_gaussian_components_by_hand():
    """λ = 2 components of two clear clusters: π = n_l / N, p = the cluster means, Σ = their per-dimension variance
    (the floor for a single member); λ above the image count: one unit per image, the rest marked unused."""
    features = torch.tensor([[1.0, 0.0], [0.8, 0.0], [0.0, 1.0]])
    stats = gaussian_components(features, 2, 10, torch.Generator().manual_seed(0), 1e-3)
    order = stats["means"][:, 0].argsort(descending=True)
    assert stats["weights"][order].tolist() == pytest.approx([2 / 3, 1 / 3])
    assert stats["means"][order].flatten().tolist() == pytest.approx([0.9, 0.0, 0.0, 1.0])
    assert stats["variances"][order].flatten().tolist() == pytest.approx([0.01, 1e-3, 1e-3, 1e-3])
    assert stats["valid"].all()
    few = gaussian_components(features[:1], 4, 10, torch.Generator().manual_seed(0), 1e-3)
    assert few["valid"].tolist() == [True, False, False, False] and few["weights"].tolist() == [1.0, 0.0, 0.0, 0.0]
    centres, assignment = kmeans(features, 2, 10, torch.Generator().manual_seed(0))
    again = kmeans(features, 2, 10, torch.Generator().manual_seed(0))
    assert torch.equal(centres, again[0]) and torch.equal(assignment, again[1])


def _prepared(distribution: str, samples: int = 3) -> LADA:
    """A LADA at the start of its second task: task 0 ("cat", "dog") learned, task 1 ("owl") training."""
    method = LADA({"distribution": distribution, "samples_per_class": samples})
    memory = _memory()
    memory.add_task(["owl"], LADATask(torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2, 2), torch.tensor([[1.0, 0.0]]),
                                      torch.zeros(1, 2, 2), torch.ones(1, 2, 2), torch.tensor([[True, False]])))
    method._memory = memory
    method.prepare(memory)
    return method


def test_distillation_on_prototypes_is_eq_4_on_the_stored_centres():
    """`distribution: prototypes`: the valid centres of every earlier class, normalised, with their loss columns
    (cat 0, dog 1, owl 2); the new task's classes are not distilled."""
    method = _prepared("prototypes")
    samples, columns = method.distillation_samples(SimpleNamespace(seed=0, task_index=1, global_step=5))
    assert columns.tolist() == [0, 0, 1]
    assert samples.flatten().tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0, 0.6, 0.8])


def test_distillation_draws_from_the_components_seeded_by_the_step():
    """`distribution: gmm`: `samples_per_class` draws per earlier class, a component by π (dog's unused unit never),
    p + Σ^½ ε renormalised; the same step draws the same, another step others."""
    method = _prepared("gmm", samples=4)
    context = SimpleNamespace(seed=0, task_index=1, global_step=7)
    samples, columns = method.distillation_samples(context)
    assert columns.tolist() == [0] * 4 + [1] * 4
    assert torch.allclose(samples.norm(dim=-1), torch.ones(8))
    assert torch.allclose(samples[4:], torch.tensor([0.6, 0.8]).expand(4, 2), atol=0.05)  # near dog's one centre
    assert torch.equal(samples, method.distillation_samples(context)[0])
    assert not torch.equal(samples, method.distillation_samples(SimpleNamespace(seed=0, task_index=1,
                                                                                global_step=8))[0])


def test_loss_terms_are_eq_3_on_the_batch_and_eq_4_on_the_earlier_classes():
    """`current` on the batch's rows (their class in the task, `class_labels`, mapped to the seen columns) and
    `distill` on the prototypes, both class-balanced over the three seen classes; only the new task's parameters get
    gradients."""
    method = _prepared("prototypes")
    memory = method._memory
    memory.task(0).requires_grad_(False)
    images = F.normalize(torch.tensor([[1.0, 0.2], [0.3, 1.0]]), dim=-1)
    outputs = SimpleNamespace(image_embeds=images)
    terms = method.loss_terms(None, {"class_labels": torch.tensor([0, 0])}, outputs,
                              SimpleNamespace(seed=0, task_index=1, global_step=0))
    scores = memory.learned_scores(images, ["cat", "dog", "owl"])
    assert terms["current"].item() == pytest.approx(F.cross_entropy(scores, torch.tensor([2, 2])).item(), rel=1e-6)
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    distill = class_balanced_cross_entropy(memory.learned_scores(prototypes, ["cat", "dog", "owl"]),
                                           torch.tensor([0, 0, 1]), 3)
    assert terms["distill"].item() == pytest.approx(distill.item(), rel=1e-6)
    (terms["current"] + terms["distill"]).backward()
    assert memory.task(1).text.grad is not None and memory.task(1).memory.grad is not None
    assert memory.task(0).text.grad is None


@pytest.mark.parametrize(("option", "value"), [("num_units", 0), ("beta", -1.0), ("distribution", "em"),
                                               ("samples_per_class", 0), ("variance_floor", 0.0)])
def test_bad_values_are_refused_naming_the_option(option, value):
    from hf_ccl.validation import ConfigError

    with pytest.raises(ConfigError, match=f"method_args.lada: {option}"):
        LADA({option: value})


# ----- the run as a user makes it: the CLI, loaded back as the card says -------------------------------------------
CLI_RUN = ["train", "--config", "digits", "methods=[lada]", "model.config.hidden_size=32",
           "model.config.num_layers=1", "model.config.projection_dim=32", "stream_args.max_train_per_task=32",
           "stream_args.max_eval_per_task=16", "training.max_steps=2", "training.per_device_train_batch_size=16",
           "training.learning_rate=0.05", "training.warmup_steps=0", "class_scope=seen",
           "method_args.lada={num_units: 2, samples_per_class: 2}"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`hf-ccl train --config digits methods=[lada] class_scope=seen ...`: five tasks, scored task-agnostic too."""
    from hf_ccl.cli import main

    output = tmp_path_factory.mktemp("lada-cli") / "out"
    return SimpleNamespace(code=main([*CLI_RUN, f"output_dir={output}"]), output=output)


def test_the_cli_run_keeps_the_base_model_and_freezes_each_tasks_memory(cli_run):
    """Exit 0; every checkpoint's weights are the frozen start (no `lada.` key); each task adds its classes, and a
    task's text features and units are unchanged by the later tasks; the task-agnostic scores are recorded."""
    assert cli_run.code == 0
    start = tiny_model("clip", seed=0, hidden_size=32, num_layers=1, projection_dim=32).state_dict()
    last = cli_run.output / "task-4"
    weights = load_file(str(last / "model.safetensors"))
    assert not any(key.startswith("lada.") for key in weights)
    for key, value in weights.items():
        assert torch.equal(value, start[key]), key
    states = {k: json.loads((cli_run.output / f"task-{k}" / "method_state.json").read_text())["lada"]["state"]
              for k in (0, 4)}
    assert states[4]["class_names"] == [["zero", "one"], ["two", "three"], ["four", "five"], ["six", "seven"],
                                        ["eight", "nine"]]
    first, final = (load_file(str(cli_run.output / f"task-{k}" / "method_state.safetensors")) for k in (0, 4))
    for name in ("text", "memory", "means", "variances", "weights"):
        assert torch.equal(first[f"lada/tasks/0/{name}"], final[f"lada/tasks/0/{name}"]), name
    results = json.loads((last / "results.json").read_text())
    assert "seen_accuracy" in results["rows"][4]["metrics"]["digits-01"]


def _scores(model, processor, stream, trained=None) -> dict[str, dict[str, float]]:
    """Each task's metrics; with `trained` tasks, task-agnostic too (among every class seen, as the run scores)."""
    from hf_ccl.class_prompts import seen_class_names
    from hf_ccl.evaluation import evaluate_task

    return {task.name: evaluate_task(model, task, processor.image_processor, processor.tokenizer, seen_class_names=(
        None if trained is None else seen_class_names(stream.tasks[:trained], task))) for task in stream}


def test_the_cards_loader_gives_the_scored_model_and_plain_transformers_the_base_model(cli_run):
    """The card names `load_lada_model`; the model it loads scores task-1's row of results.json exactly, task-aware
    and task-agnostic; `CLIPModel.from_pretrained` of the same folder is the frozen start (the initial row)."""
    from transformers import AutoProcessor

    folder = cli_run.output / "task-1"
    card = (folder / "README.md").read_text(encoding="utf-8")
    assert "load_lada_model" in card
    results = json.loads((folder / "results.json").read_text())
    processor = AutoProcessor.from_pretrained(folder)
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=16)
    loaded = _scores(load_lada_model(folder), processor, stream, trained=2)
    row = results["rows"][1]["metrics"]
    for task, metrics in row.items():
        assert loaded[task]["accuracy"] == metrics["accuracy"], task
        assert loaded[task]["seen_accuracy"] == metrics["seen_accuracy"], task
    plain = _scores(CLIPModel.from_pretrained(folder), processor, stream)
    initial = results["initial"]["metrics"]
    assert {task: metrics["accuracy"] for task, metrics in plain.items()} == {
        task: metrics["accuracy"] for task, metrics in initial.items()}
    assert {task: m["accuracy"] for task, m in row.items()} != {task: m["accuracy"] for task, m in initial.items()}


def test_streams_without_classes_are_refused_before_anything_trains(tmp_path, capsys):
    """A retrieval stream is refused once built (`check_stream`: exit 1, one line), before any task trains."""
    from hf_ccl.cli import main

    code = main(["train", "--config", "flickr8k-random5", "methods=[lada]", f"output_dir={tmp_path / 'run'}"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(error) == 1 and "use a classification stream" in error[0]
    assert not list((tmp_path / "run").glob("task-*"))


def test_the_cross_entropy_loss_is_refused_with_lada(tmp_path, capsys):
    """LADA's terms are the whole loss: `classification_loss: cross_entropy` is refused (one line, exit 2)."""
    from hf_ccl.cli import main

    code = main([*CLI_RUN[:4], "classification_loss=cross_entropy", f"output_dir={tmp_path / 'run'}"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1 and "lada" in error[0]


def test_the_memory_is_not_in_the_saved_weights_and_loads_where_it_is_needed(tmp_path):
    """`save_pretrained` of a model carrying a memory writes the plain model (and `load_lada_model` needs the
    method state: a folder without one is refused naming the file)."""
    model = tiny_model("clip")
    model.lada = _memory()
    model._keys_to_ignore_on_save = {f"lada.{key}" for key in model.lada.state_dict()}
    model.save_pretrained(tmp_path)
    assert not any(key.startswith("lada.") for key in load_file(str(tmp_path / "model.safetensors")))
    with pytest.raises(FileNotFoundError):
        load_lada_model(Path(tmp_path))


@pytest.mark.slow  # 10 s each; resuming after a task is the every-method matrix's (tests/test_method_registry.py)
@pytest.mark.parametrize("text_tuning", ["features", "adaptformer"])
def test_resuming_mid_task_ends_with_the_uninterrupted_memory(tmp_path, text_tuning):
    """A task resumed from a Trainer checkpoint (its model.safetensors holds no memory; the method state beside it
    does) ends with exactly the text features, units and components of an uninterrupted run, the draws included."""
    import shutil

    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import load_image_processor, load_tokenizer
    from hf_ccl.data.task import TaskStream

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=8)

    def fit(resume):
        args = ContinualArguments(
            output_dir=str(tmp_path), progress=False, resume_from_checkpoint=resume, keep_trainer_checkpoints=True,
            evaluation={"batch_size": 64, "initial": False},
            training={"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 5e-2,
                      "save_strategy": "steps", "save_steps": 2})
        method = LADA({"num_units": 2, "samples_per_class": 2, "text_tuning": text_tuning})
        ContinualLearner(tiny_model("clip"), TaskStream(stream.name, stream.tasks[:2]), [method],
                         load_image_processor(32), load_tokenizer(), args).fit()
        return method.state_dict()

    uninterrupted = fit(None)
    shutil.rmtree(tmp_path / "task-1")  # stopped in task 1, after its Trainer checkpoint at step 2
    shutil.rmtree(tmp_path / "trainer" / "task-1" / "checkpoint-4")
    resumed = fit(True)
    assert resumed["class_names"] == uninterrupted["class_names"] == [["zero", "one"], ["two", "three"]]
    for task, tensors in uninterrupted["tasks"].items():
        for key, value in tensors.items():
            torch.testing.assert_close(resumed["tasks"][task][key], value, rtol=0, atol=0, msg=f"{task}/{key}")


@pytest.mark.parametrize("other", ["lora", "er"])
def test_combinations_that_make_no_sense_are_refused_with_the_reason(other):
    """Another parameter-efficient method would freeze LADA's parameters (and LADA its); replay's rows of earlier
    tasks are not the current task's classes (LADA keeps earlier classes by its distillation)."""
    from hf_ccl.methods import build_methods
    from hf_ccl.validation import ConfigError

    with pytest.raises(ConfigError, match=f"'lada' and '{other}' cannot be combined"):
        build_methods(["lada", other])


def test_the_adaptformer_is_parallel_to_each_text_mlp_and_leaves_no_trace_when_removed():
    """With it installed, a text layer computes x + MLP(LN_2(x)) + s up(ReLU(down(x))) (x: the residual stream after
    attention); it starts at zero (the zero-shot features); removed, the tower is exactly the plain one."""
    from hf_ccl.methods.lada_text import TextAdaptFormer

    model = tiny_model("clip")
    ids = torch.tensor([[49406, 320, 1929, 49407]])
    plain = model.embed_texts(ids)
    adapter = TextAdaptFormer(model, 4, 0.1, torch.Generator().manual_seed(0))
    adapter.install()
    assert torch.equal(model.embed_texts(ids), plain)  # up starts at zero
    torch.nn.init.normal_(adapter.adapters[0].up_proj.weight, generator=torch.Generator().manual_seed(1))
    layer = model.text_model.encoder.layers[0]
    x = torch.randn(1, 4, layer.layer_norm2.normalized_shape[0], generator=torch.Generator().manual_seed(2))
    first = adapter.adapters[0]
    # `forward` bypasses the hooks: the plain MLP
    expected = layer.mlp.forward(layer.layer_norm2.forward(x)) + 0.1 * first.up_proj(torch.relu(first.down_proj(x)))
    assert torch.allclose(layer.mlp(layer.layer_norm2(x)), expected, atol=1e-6)  # hooked, as the layer runs them
    assert not torch.equal(model.embed_texts(ids), plain)
    adapter.remove()
    assert torch.equal(model.embed_texts(ids), plain)


def test_the_adaptformer_is_refused_where_the_text_tower_has_no_mlp_beside_its_residual_stream():
    """AltCLIP's post-norm XLM-R text tower: `text_tuning: adaptformer` is refused naming the option."""
    from hf_ccl.validation import ConfigError

    with pytest.raises(ConfigError, match="text_tuning=adaptformer.*use text_tuning: features"):
        LADA({"text_tuning": "adaptformer"}).check_model(tiny_model("altclip"))
    LADA({"text_tuning": "adaptformer"}).check_model(tiny_model("siglip"))


@pytest.mark.slow  # 5 s; the mid-task resume runs it too
def test_the_adaptformer_text_side_trains_the_tasks_text_features(tmp_path):
    """`text_tuning: adaptformer`: a two-task run stores each task's text features as its AdaptFormer made them
    (no longer the zero-shot ones), keeps the base model, and leaves no adapter on the model or in the state."""
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import load_image_processor, load_tokenizer
    from hf_ccl.data.task import TaskStream
    from hf_ccl.methods.lada import zero_shot_text

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=8)
    model, start = tiny_model("clip"), tiny_model("clip").state_dict()
    method = LADA({"num_units": 2, "samples_per_class": 2, "text_tuning": "adaptformer"})
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, evaluation={"batch_size": 64, "initial": False},
                              training={"max_steps": 3, "per_device_train_batch_size": 16, "learning_rate": 5e-2})
    learner = ContinualLearner(model, TaskStream(stream.name, stream.tasks[:2]), [method], load_image_processor(32),
                               load_tokenizer(), args)
    learner.fit()
    assert not hasattr(learner.model, "lada_text") and "text_adapter" not in method.state_dict()
    for key, value in learner.model.state_dict().items():
        if not key.startswith("lada."):
            assert torch.equal(value, start[key]), key
    context = SimpleNamespace(model=learner.model, task=stream.tasks[1], tokenizer=load_tokenizer(), max_length=None)
    zero_shot = zero_shot_text(context)
    trained = method._memory.task(1).text.detach()
    assert trained.shape == zero_shot.shape and not torch.allclose(trained, zero_shot, atol=1e-4)


def test_a_class_without_training_images_is_not_learned_and_max_per_class_subsamples_each_class():
    """A class absent from the task's training rows gets no memory (the evaluator scores it zero-shot, as a class
    never seen; logged); `max_per_class` fits each class's components on at most that many of its images."""
    from hf_ccl.data import load_image_processor, load_tokenizer
    from hf_ccl.methods.lada import task_features

    task = build_stream("digits", max_train_per_task=32, max_eval_per_task=8).tasks[0]
    task.train = task.train.filter(lambda row: row["label"] != 1)
    context = SimpleNamespace(model=tiny_model("clip"), task=task, image_processor=load_image_processor(32),
                              tokenizer=load_tokenizer(), seed=0, task_index=0, max_length=None, eval_batch_size=64)
    names, learned = LADA({"num_units": 2}).new_task(context)
    assert names == ["zero"] and learned.text.shape[0] == learned.memory.shape[0] == 1
    features, labels = task_features(context, max_per_class=3)
    assert features.shape[0] == 3 and labels.tolist() == [0, 0, 0]
