"""Classification tasks trained with the image-to-class-prompt cross-entropy (ZSCL Eq. 1) and scored task-aware or
task-agnostic (`class_scope`): the loss by hand, the prompts and labels, and real runs on the digits stream."""

import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from hf_ccl.class_prompts import ClassPrompts, class_prompt_loss, seen_class_names
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, build_stream
from hf_ccl.data.task import Task, TaskStream
from hf_ccl.families import default_image_processor
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip, tiny_model
from hf_ccl.trainer import ContinualTrainer
from hf_ccl.validation import ConfigError


def fake_model(scale: float, kind: str = "softmax", bias: float = 0.0):
    def logits(images, classes):
        out = scale * images @ classes.t()
        return out + bias if kind == "sigmoid" else out

    return SimpleNamespace(logits=logits, loss_kind=kind)


def test_cross_entropy_by_hand_with_and_without_candidates():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    classes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # class 2 duplicates class 0
    labels = torch.tensor([0, 1])
    # logits (scale 2): row 0 [2, 0, 2], row 1 [0, 2, 0].
    row0 = -math.log(math.exp(2) / (2 * math.exp(2) + 1))
    row1 = -math.log(math.exp(2) / (math.exp(2) + 2))
    loss = class_prompt_loss(fake_model(2.0), images, classes, labels)
    assert float(loss) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    # Task-aware: classes 0 and 1 are one task, class 2 another; both rows are of the first task.
    mask = torch.tensor([[True, True, False], [True, True, False]])
    masked = class_prompt_loss(fake_model(2.0), images, classes, labels, mask)
    expected = -math.log(math.exp(2) / (math.exp(2) + 1))
    assert float(masked) == pytest.approx(expected, rel=1e-6)


def test_sigmoid_family_scores_candidates_with_its_pairwise_loss():
    images = torch.tensor([[1.0, 0.0]])
    classes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([0])
    # logits = 2 * cos - 1: [1, -1, -3]; positive class 0, negatives 1 and 2.
    def nls(x):
        return math.log1p(math.exp(-x))  # -log sigmoid(x)

    model = fake_model(2.0, "sigmoid", -1.0)
    full = nls(1) + nls(1) + nls(3)
    assert float(class_prompt_loss(model, images, classes, labels)) == pytest.approx(full, rel=1e-6)
    mask = torch.tensor([[True, True, False]])  # class 2 is no candidate: it counts neither way
    assert float(class_prompt_loss(model, images, classes, labels, mask)) == pytest.approx(nls(1) + nls(1), rel=1e-6)


@pytest.fixture(scope="module")
def digits():
    stream = build_stream("digits", max_train_per_task=64)
    stream.tasks = stream.tasks[:2]
    return stream


def test_prompts_labels_embeddings_and_masks(digits, clip_tokenizer):
    first, second = digits.tasks
    original = first.train_templates
    first.train_templates = ["a photo of the digit {label}.", "a drawing of the digit {label}."]
    try:
        prompts = ClassPrompts.build([first, second], clip_tokenizer, scope="task")
        assert prompts.class_names == ["zero", "one", "two", "three"]
        assert prompts.labels(["a drawing of the digit one.", "a photo of the digit three."]) == [1, 3]
        with pytest.raises(ValueError, match="no class prompt"):
            prompts.labels(["a photo of a cat."])
        model = tiny_model()
        embeds = prompts.class_embeddings(model)
        with torch.no_grad():  # class 1 = the normalised mean of its two prompts' normalised embeddings
            texts = ["a photo of the digit one.", "a drawing of the digit one."]
            tokens = clip_tokenizer(texts, padding=True, return_tensors="pt")
            mean = model.embed_texts(tokens["input_ids"], tokens["attention_mask"]).mean(0)
        torch.testing.assert_close(embeds[1].detach(), torch.nn.functional.normalize(mean, dim=0), atol=1e-5,
                                   rtol=1e-5)
        mask = prompts.candidate_mask(torch.tensor([1, 2]))
        assert mask.tolist() == [[True, True, False, False], [False, False, True, True]]
        assert ClassPrompts.build([first, second], clip_tokenizer, scope="seen").candidate_mask(torch.tensor([1])) is None
    finally:
        first.train_templates = original
    assert seen_class_names([first], second) == ["zero", "one", "two", "three"]
    assert seen_class_names([], second) == ["two", "three"]


def run(stream, tmp_path, methods=("finetune",), method_args=None, epochs=2, batch=32, **options):
    model = tiny_model()
    from hf_ccl.data import load_tokenizer

    args = ContinualArguments(output_dir=str(tmp_path / "run"), save_checkpoints=False, progress=False,
                              training={"num_train_epochs": epochs, "per_device_train_batch_size": batch,
                                        "learning_rate": 1e-3, "logging_steps": 1}, **options)
    learner = ContinualLearner(model, stream, build_methods(list(methods), method_args), default_image_processor(model),
                               load_tokenizer(), args)
    losses = []

    class Record:
        def on_log(self, args, state, control, logs=None, **kwargs):
            losses.append(dict(logs or {}))

    learner.callbacks.append(type("R", (__import__("transformers").TrainerCallback,), {"on_log": Record.on_log})())
    return learner, learner.fit(), losses


def test_cross_entropy_run_logs_its_term_and_learns(digits, tmp_path):
    one_task = TaskStream("digits-01", digits.tasks[:1])
    learner, results, logs = run(one_task, tmp_path, epochs=8, batch=8, classification_loss="cross_entropy")
    terms = [log for log in logs if "loss/class_cross_entropy" in log]
    assert terms and not any("loss/contrastive" in log for log in logs)
    assert results.headline()[0, 0] > results.initial_headline()[0] + 10  # it learned task 0's two classes
    (record,) = learner.compute  # the class prompts' passes are measured in the MACs, every step
    assert record.macs_measured and record.macs > 0


def test_trainer_loss_is_eq1_of_the_models_embeddings(digits, tmp_path, clip_tokenizer):
    model = tiny_model()
    prompts = ClassPrompts.build([digits.tasks[0]], clip_tokenizer)
    from hf_ccl.data import CLIPCollator

    collator = CLIPCollator(default_image_processor(model), clip_tokenizer, train=False, class_labels=prompts.labels)
    batch = collator([digits.tasks[0].train[i] for i in range(8)])
    context = SimpleNamespace(class_prompts=prompts)
    trainer = ContinualTrainer.__new__(ContinualTrainer)
    trainer.methods, trainer.context = [], context
    model.eval()
    with torch.no_grad():
        outputs = model(**batch, return_loss=False)
        loss = trainer._total_loss(model, batch, outputs)
        images = model.embed_images(batch["pixel_values"])
        classes = prompts.class_embeddings(model)
        logits = model.logit_scale.exp() * images @ classes.t()
        expected = torch.nn.functional.cross_entropy(logits, batch["class_labels"])
    assert batch["class_labels"].tolist() == digits.tasks[0].train.select(range(8))["label"]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_seen_scope_scores_among_every_seen_class(digits, tmp_path):
    learner, results, _ = run(digits, tmp_path, class_scope="seen")
    assert results.headline_metrics == ["seen_accuracy", "seen_accuracy"]
    initial = results.initial.metrics
    for task in digits.task_names:  # before training, a task's seen classes are its own
        assert initial[task]["seen_accuracy"] == initial[task]["accuracy"]
    after = results.rows[-1].metrics
    for task in digits.task_names:  # more candidates can only lose: top-1 among 4 implies top-1 among its 2
        assert after[task]["seen_accuracy"] <= after[task]["accuracy"]
    assert results.rows[0].metrics[digits.task_names[1]]["seen_accuracy"] <= 100.0


def test_replayed_rows_keep_their_own_tasks_classes(digits, tmp_path):
    _, results, logs = run(digits, tmp_path, methods=("er",), method_args={"er": {"buffer_size": 16}},
                           classification_loss="cross_entropy")
    assert results.num_trained == 2 and any("loss/class_cross_entropy" in log for log in logs)


def test_options_refused_where_they_cannot_apply(tmp_path):
    with pytest.raises(ConfigError, match="classification_loss"):
        ContinualArguments(output_dir=str(tmp_path), classification_loss="ce")
    with pytest.raises(ConfigError, match="class_scope"):
        ContinualArguments(output_dir=str(tmp_path), class_scope="every")
    stream = build_stream("flickr8k-random5", max_train_per_task=8, max_eval_per_task=8)
    args = ContinualArguments(output_dir=str(tmp_path), classification_loss="cross_entropy")
    model = tiny_model()
    from hf_ccl.data import load_tokenizer

    with pytest.raises(ConfigError, match="has none"):
        ContinualLearner(model, stream, build_methods(["finetune"]), default_image_processor(model), load_tokenizer(),
                         args)


RECIPES = ["finetune", "lwf", "wise_ft", "zscl", "moe_adapters", "er", "diki", "condu"]


@pytest.mark.parametrize("method", RECIPES)
def test_the_mtil_recipes_run_from_the_command_line(tmp_path, capsys, method):
    """recipes/configs/<method>-mtil-bundled.yaml through `hf-ccl train` (what `accelerate launch recipes/train.py`
    runs) on two of its tasks and a tiny random CLIP: the cross-entropy trains, and results.md has MTIL's metrics."""
    from hf_ccl.cli import main

    overrides = [
        f"output_dir={tmp_path}", "progress=false", "training.max_steps=2", "training.per_device_train_batch_size=8",
        "stream_args={max_train_per_task: 16, max_eval_per_task: 8, tasks: [digits, rsscn7]}", "model.pretrained=null",
        "model.config={hidden_size: 32, num_layers: 1, num_heads: 2, image_size: 32, patch_size: 8, projection_dim: 32}",
    ]
    if method == "zscl":
        overrides.append("method_args.zscl={reference_examples: 16, reference_batch_size: 8, ensemble_every: 1}")
    assert main(["train", "--config", f"{method}-mtil-bundled", *overrides]) == 0
    assert "| after rsscn7 |" in capsys.readouterr().out
    results = (tmp_path / "results.md").read_text()
    assert "mtil_transfer" in results and "mtil_average" in results


def test_ewc_takes_the_fisher_of_the_loss_the_task_trained_with(digits, clip_tokenizer):
    """`batch_task_loss` (EWC's Fisher objective) is the class-prompt cross-entropy on a cross-entropy task's batch
    and the contrastive loss otherwise."""
    from hf_ccl.data import CLIPCollator
    from hf_ccl.methods.regularization import batch_contrastive_loss, batch_task_loss

    model = tiny_model().eval()
    prompts = ClassPrompts.build([digits.tasks[0]], clip_tokenizer)
    rows = [digits.tasks[0].train[i] for i in range(8)]
    batch = CLIPCollator(default_image_processor(model), clip_tokenizer, train=False, class_labels=prompts.labels)(rows)
    with torch.no_grad():
        images = model.embed_images(batch["pixel_values"])
        expected = class_prompt_loss(model, images, prompts.class_embeddings(model), batch["class_labels"],
                                     prompts.candidate_mask(batch["class_labels"]))
        torch.testing.assert_close(batch_task_loss(model, batch, prompts), expected)
        torch.testing.assert_close(batch_task_loss(model, batch, None), batch_contrastive_loss(model, batch))


def task_with_templates(name: str, classes: list[str], templates: list[str]) -> Task:
    empty = Dataset.from_dict({"texts": [["-"]]})
    return Task(name, empty, empty, kind="classification", class_names=classes, train_templates=templates)


def label_task(name: str, classes: list[str], template: str = "a photo of a {label}.") -> Task:
    return task_with_templates(name, classes, [template])


def test_a_prompt_two_tasks_train_is_one_class_in_the_seen_scope(clip_tokenizer):
    """"a photo of a dog." in two tasks: one column, so a model that puts each image on its class's embedding
    reaches a loss of ~0 (two columns with one embedding would hold every dog row at >= ln 2)."""
    first, second = label_task("first", ["dog", "cat"]), label_task("second", ["bird", "dog"])
    prompts = ClassPrompts.build([first, second], clip_tokenizer, scope="seen")
    assert prompts.class_names == ["dog", "cat", "bird"] == seen_class_names([first], second)
    captions = ["a photo of a dog.", "a photo of a cat.", "a photo of a bird.", "a photo of a dog."]
    labels = torch.tensor(prompts.labels(captions, [0, 1, 0, 1]))
    assert labels.tolist() == [0, 1, 2, 0] and prompts.candidate_mask(labels) is None
    model = tiny_clip()
    model.logit_scale.data.fill_(math.log(1e4))  # cos gaps here are >= 0.02: logit gaps >= 200
    with torch.no_grad():
        classes = prompts.class_embeddings(model)
        loss = class_prompt_loss(model, classes[labels], classes, labels)
        doubled = class_prompt_loss(model, classes[labels], torch.cat([classes, classes[:1]]), labels)
    assert classes.shape[0] == 3 and float(loss) < 1e-6
    assert float(doubled) >= math.log(2) / 2  # the old layout: dog twice, half the rows stuck at ln 2
    # Different training templates are different prompts, so different classes with their own embeddings.
    sketch = label_task("sketch", ["dog"], "a sketch of a {label}.")
    assert ClassPrompts.build([first, sketch], clip_tokenizer, scope="seen").class_names == ["dog", "cat", "dog"]
    linked = task_with_templates("linked", ["og"], ["d{label}", "cat{label}"])  # "dog" and "catog": one class
    with pytest.raises(ValueError, match="one class through prompts"):
        ClassPrompts.build([task_with_templates("own", ["dog", "catog"], ["{label}"]), linked], clip_tokenizer,
                           scope="seen")


def test_a_replayed_row_is_scored_among_its_own_tasks_classes(clip_tokenizer):
    """Task scope with past tasks (replay): the shared prompt is a column of each task's block and the row's label
    picks its own task; a prompt two tasks train at one index among different classes is refused."""
    first, second = label_task("first", ["dog", "cat"]), label_task("second", ["bird", "dog"])
    prompts = ClassPrompts.build([first, second], clip_tokenizer, scope="task")
    assert prompts.class_names == ["dog", "cat", "bird", "dog"]
    labels = torch.tensor(prompts.labels(["a photo of a dog.", "a photo of a dog."], [0, 1]))  # first's, second's
    assert labels.tolist() == [0, 3]
    assert prompts.candidate_mask(labels).tolist() == [[True, True, False, False], [False, False, True, True]]
    with pytest.raises(ValueError, match="give each row's label"):
        prompts.labels(["a photo of a dog."])
    same = label_task("again", ["dog", "cat"])  # the same classes again: either block scores a row alike
    assert ClassPrompts.build([first, same], clip_tokenizer, scope="task").labels(["a photo of a dog."], [0]) == [0]
    with pytest.raises(ValueError, match="cannot be told"):
        ClassPrompts.build([first, label_task("other", ["dog", "horse"])], clip_tokenizer, scope="task")
    with pytest.raises(ValueError, match="share the training prompt"):
        ClassPrompts.build([label_task("twice", ["dog", "dog"])], clip_tokenizer)


def test_mtil_bundled_photo_has_44_classes_in_the_loss_and_in_evaluation(clip_tokenizer):
    """`mtil-bundled` with `pacs_domain: photo`: CIFAR-10 and PACS both train "a photo of a dog." and "... horse.":
    46 classes, 44 prompts. The collator's labels put a replayed CIFAR-10 dog among CIFAR-10's classes."""
    stream = build_stream("mtil-bundled", pacs_domain="photo", max_train_per_task=4, max_eval_per_task=4)
    tasks = stream.tasks
    seen = ClassPrompts.build(tasks, clip_tokenizer, scope="seen")
    evaluated = seen_class_names(tasks[:-1], tasks[-1])  # what the evaluator scores the last task among
    assert sum(len(task.class_names) for task in tasks) == 46
    assert len(seen.class_names) == len(set(seen.class_names)) == 44 and seen.class_names == evaluated
    by_name = {task.name: task for task in tasks}
    cifar, pacs = by_name["cifar10"], by_name["pacs-photo"]
    prompts = ClassPrompts.build([cifar, pacs], clip_tokenizer, scope="task")
    rows = [{**task.train[0], "texts": ["a photo of a dog."], "label": task.class_names.index("dog")}
            for task in (cifar, pacs)]  # a replayed CIFAR-10 dog beside a PACS dog
    model = tiny_clip()
    batch = CLIPCollator(default_image_processor(model), clip_tokenizer, train=False, class_labels=prompts.labels)(rows)
    candidates = prompts.candidate_mask(batch["class_labels"])
    assert [[prompts.class_names[c] for c in mask.nonzero().flatten().tolist()] for mask in candidates] == [
        cifar.class_names, pacs.class_names]
