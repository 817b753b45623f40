"""Model cards of task checkpoints: a real 2-task run (Flickr8k captions, then RSSCN7 classes) and hand-built ones."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_ccl.cards import (
    BUNDLED_DATASET_TERMS,
    EVAL_METRICS,
    HEATMAP_FILE,
    build_model_card,
    write_model_card,
)
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.evaluation.matrix import ResultsMatrix
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

REPO_ID = "someone/clip-cards-test"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _cell(value: float, decimals: int = 1) -> str:
    return f"{value:.{decimals}f}" if math.isfinite(value) else "–"


def _expected_table_lines(matrix: ResultsMatrix) -> list[str]:
    """The matrix rows as the card should render them: `| label | 12.3 | – |`."""
    labelled = [] if matrix.initial is None else [("initial", matrix.initial_headline())]
    labelled += [(f"after {row.label}", values) for row, values in zip(matrix.rows, matrix.headline(), strict=True)]
    return ["| " + " | ".join([label, *(_cell(v) for v in values)]) + " |" for label, values in labelled]


def _eval_values(card: ModelCard) -> dict[tuple[str, str, str], float]:
    """{(dataset name, task type, metric type): value} from the card's parsed `model-index`."""
    return {
        (result.dataset_name, result.task_type, result.metric_type): result.metric_value
        for result in card.data.eval_results
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, clip_tokenizer) -> Path:
    stream = build_stream("domains5", max_train_per_task=16, max_eval_per_task=16)
    stream.tasks = [stream.tasks[0], stream.tasks[2]]  # flickr8k (Recall@K), rsscn7 (zero-shot accuracy)
    output_dir = tmp_path_factory.mktemp("cards")
    args = ContinualArguments(
        output_dir=str(output_dir), training={"max_steps": 2, "per_device_train_batch_size": 8}, progress=False
    )
    methods = build_methods(["finetune", "lwf"], {"lwf": {"temperature": 3.5, "alpha": 0.25}})
    ContinualLearner(tiny_clip(seed=0), stream, methods, load_image_processor(32), clip_tokenizer, args).fit()
    return output_dir


@pytest.fixture(scope="module")
def card_path(run_dir) -> Path:
    return write_model_card(run_dir / "task-1", repo_id=REPO_ID)


def test_card_body_of_a_real_checkpoint(run_dir, card_path):
    text = card_path.read_text(encoding="utf-8")
    assert card_path == run_dir / "task-1" / "README.md"
    matrix = ResultsMatrix.load(run_dir / "task-1")
    assert matrix.initial is not None and matrix.num_trained == 2
    for line in _expected_table_lines(matrix):
        assert line in text, line
    assert "| flickr8k (R_mean) | rsscn7 (accuracy) |" in text
    assert f"| final average | {_cell(matrix.summary()['final_average'], 2)} |" in text
    assert f"| backward transfer (BWT) | {_cell(matrix.summary()['backward_transfer'], 2)} |" in text
    assert "| temperature | 3.5 |" in text and "| alpha | 0.25 |" in text  # lwf's hyperparameters
    assert "| max_steps | 2 |" in text and "| per_device_train_batch_size | 8 |" in text
    assert f'AutoModel.from_pretrained("{REPO_ID}", revision="task-1")  # a CLIPModel' in text
    assert f'AutoProcessor.from_pretrained("{REPO_ID}", revision="task-1")' in text
    assert "**after task 2 of 2: rsscn7**" in text
    assert "randomly initialised" in text and "| vocabulary | 49,408 tokens |" in text
    assert f"- **flickr8k**: {BUNDLED_DATASET_TERMS['flickr8k']}" in text
    assert f"- **rsscn7**: {BUNDLED_DATASET_TERMS['rsscn7']}" in text
    assert "hf_ccl 0.1.0" in text
    if HAS_MATPLOTLIB:
        assert (run_dir / "task-1" / HEATMAP_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({HEATMAP_FILE})" in text
    else:
        assert HEATMAP_FILE not in text


def test_front_matter_round_trips_with_the_last_row(run_dir, card_path):
    card = ModelCard.load(card_path)
    data = card.data
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "zero-shot-image-classification"
    assert data.tags == ["clip", "continual-learning", "hf_ccl", "finetune", "lwf"]
    assert data.model_name == "clip-cards-test"
    assert data.base_model is None  # randomly initialised
    matrix = ResultsMatrix.load(run_dir / "task-1")
    values = _eval_values(card)
    expected = {
        (task, spec.task_type, spec.metric_type): matrix.rows[-1].metrics[task][spec.key]
        for task in matrix.task_names
        for spec in EVAL_METRICS
        if spec.key in matrix.rows[-1].metrics[task]
    }
    assert {task for task, _, _ in values} == {"flickr8k", "rsscn7"}
    assert set(values) == set(expected)
    assert ("flickr8k", "text-to-image-retrieval", "recall@10") in values
    assert ("rsscn7", "zero-shot-image-classification", "accuracy") in values
    for key, value in expected.items():
        assert values[key] == pytest.approx(value, abs=1e-4), key
    assert {result.dataset_type for result in data.eval_results} == {"flickr8k", "rsscn7"}


def test_first_task_card_without_repo_id(run_dir):
    card = build_model_card(run_dir / "task-0")
    text = str(card)
    assert "**after task 1 of 2: flickr8k**" in text and "not trained on yet" in text
    assert 'AutoModel.from_pretrained("<namespace>/<repo-name>", revision="task-0")' in text
    assert "| 2 | rsscn7 | rsscn7 | accuracy | no |" in text
    assert len(ResultsMatrix.load(run_dir / "task-0").rows) == 1
    assert card.data.model_name == "hf_ccl-domains5-finetune-lwf"


def test_missing_files_are_named(run_dir, tmp_path):
    folder = tmp_path / "task-0"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"continual_state\.json not found .*ContinualLearner\.save_checkpoint"):
        build_model_card(folder)
    (folder / "continual_state.json").write_bytes((run_dir / "task-0" / "continual_state.json").read_bytes())
    with pytest.raises(ValueError, match=r"results\.json not found .*ResultsMatrix\.save"):
        write_model_card(folder)
    assert not (folder / "README.md").exists()
    with pytest.raises(ValueError, match="is not a directory"):
        build_model_card(tmp_path / "nowhere")


# ----- the template alone, on hand-built checkpoints (no training) -----------------------------------------------
def _hand_built_checkpoint(folder: Path, matrix: ResultsMatrix, **state_overrides) -> Path:
    matrix.save(folder)
    state = {
        "task_index": matrix.num_trained - 1,
        "task_name": matrix.rows[-1].label,
        "stream": "hand-built",
        "task_names": matrix.task_names,
        "task_sources": ["/home/someone/shared/datasets/pacs", "someone/my-captions", "mystery"],
        "methods": ["ewc"],
        "method_configs": {"ewc": {"lambda_": 100.0, "online": True}},
        "base_model": "openai/clip-vit-base-patch32",
        "seed": 7,
        "training": {"learning_rate": 1e-05, "hub_token": "hf_abcdefghijklmnopqrstuvwxyz123456"},
        "first_task_epochs": 3,
        "hf_ccl_version": "9.9.9",
        **state_overrides,
    }
    (folder / "continual_state.json").write_text(json.dumps(state), encoding="utf-8")
    return folder


def test_template_renders_a_hand_built_matrix(tmp_path):
    matrix = ResultsMatrix(["sketches", "captions", "later"], ["accuracy", "R_mean", "accuracy"])
    matrix.add_row("initial", {"sketches": {"accuracy": 14.0}, "captions": {"R_mean": 9.0}, "later": {"accuracy": 3.0}})
    matrix.add_row("sketches", {"sketches": {"accuracy": 80.25}, "captions": {"R_mean": 7.5}})  # "later": missing
    captions = {"R_mean": 41.0, "i2t_R@1": 20.0, "i2t_R@5": 45.0, "i2t_R@10": 60.0, "t2i_R@1": 18.5,
                "t2i_R@5": 42.0, "t2i_R@10": math.nan}
    matrix.add_row("captions", {"sketches": {"accuracy": 61.0}, "captions": captions, "later": {"accuracy": 5.0}})
    folder = _hand_built_checkpoint(tmp_path, matrix)

    card = build_model_card(folder, repo_id="me/hand-built")
    text = str(card)
    assert "| after sketches | 80.2 | 7.5 | – |" in text  # a missing cell renders as an en dash
    for line in _expected_table_lines(matrix):
        assert line in text, line
    assert "**after task 2 of 3: captions**" in text and "not trained on yet" in text
    assert "Computed on the first 2 of 3 tasks" in text
    assert "| lambda_ | 100.0 |" in text and "| online | True |" in text
    assert "| learning_rate | 1e-05 |" in text and "| num_train_epochs (first task only) | 3 |" in text
    assert "hub_token" not in text and "hf_abcdefghijklmnopqrstuvwxyz" not in text
    assert "[`openai/clip-vit-base-patch32`](https://huggingface.co/openai/clip-vit-base-patch32)" in text
    assert f"- **pacs**: {BUNDLED_DATASET_TERMS['pacs']}" in text  # a local folder of a bundled dataset
    assert "/home/someone" not in text  # local paths are published by their folder name only
    assert "- **someone/my-captions**: see the dataset's own card: https://huggingface.co/datasets/someone/my-captions" in text
    assert "- **mystery**: see the dataset's own card" in text
    assert HEATMAP_FILE not in text  # build_model_card does not draw; the image line needs the file
    assert "hf_ccl 9.9.9" in text

    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert loaded.data.base_model == "openai/clip-vit-base-patch32"
    assert loaded.data.datasets == ["someone/my-captions"]
    assert loaded.data.tags == ["clip", "continual-learning", "hf_ccl", "ewc"]
    assert _eval_values(loaded) == {
        ("sketches", "zero-shot-image-classification", "accuracy"): 61.0,
        ("captions", "image-to-text-retrieval", "recall@1"): 20.0,
        ("captions", "image-to-text-retrieval", "recall@5"): 45.0,
        ("captions", "image-to-text-retrieval", "recall@10"): 60.0,
        ("captions", "text-to-image-retrieval", "recall@1"): 18.5,
        ("captions", "text-to-image-retrieval", "recall@5"): 42.0,  # recall@10 is NaN: left out
    }  # "later" is not trained yet: zero-shot transfer, in the matrix only
    assert {r.dataset_type for r in loaded.data.eval_results} == {"pacs", "someone/my-captions"}


def test_single_task_card_has_undefined_metrics_as_dashes(tmp_path):
    matrix = ResultsMatrix(["only"], "accuracy")
    matrix.add_row("only", {"only": {"accuracy": 50.0}})
    folder = _hand_built_checkpoint(tmp_path, matrix, task_sources=["cifar10"], base_model=None)
    text = str(build_model_card(folder))
    assert "| after only | 50.0 |" in text and "| initial |" not in text
    assert "| forgetting | – |" in text and "| final average | 50.00 |" in text
    assert "randomly initialised" in text
    assert f"- **cifar10**: {BUNDLED_DATASET_TERMS['cifar10']}" in text


def test_repo_template_is_the_packaged_one():
    from importlib import resources

    packaged = resources.files("hf_ccl").joinpath("model_cards").joinpath("continual_clip.md").read_text("utf-8")
    repo_copy = Path(__file__).resolve().parents[1] / "model_cards" / "continual_clip.md"
    assert repo_copy.read_text(encoding="utf-8") == packaged
    assert packaged.startswith("---\n{{ card_data }}\n---\n")


def test_write_without_matplotlib_leaves_out_the_image(tmp_path, monkeypatch):
    import hf_ccl.evaluation.plots as plots

    def no_matplotlib(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr(plots, "plot_matrix_heatmap", no_matplotlib)
    matrix = ResultsMatrix(["only"], "accuracy")
    matrix.add_row("only", {"only": {"accuracy": 50.0}})
    path = write_model_card(_hand_built_checkpoint(tmp_path, matrix, task_sources=["pacs"]))
    assert not (tmp_path / HEATMAP_FILE).exists()
    assert HEATMAP_FILE not in path.read_text(encoding="utf-8")
    assert ModelCard.load(path).data.eval_results[0].metric_value == 50.0


# ----- what a Hub user needs to trust the card ---------------------------------------------------------------------
def test_license_intended_use_and_the_evaluation_protocol(run_dir, card_path):
    card = ModelCard.load(card_path)
    assert card.data.license == "other"  # none given: said plainly in the card
    assert "## Intended use and limitations" in card.text and "randomly initialised" in card.text
    assert "Not set by whoever trained this checkpoint" in card.text
    state = json.loads((run_dir / "task-1" / "continual_state.json").read_text())
    flickr, rsscn7 = state["evaluation"]
    assert flickr["kind"] == "retrieval" and flickr["examples"] == 16
    assert rsscn7["kind"] == "classification" and rsscn7["classes"] == 7 and rsscn7["templates"] >= 1
    # chance: R_mean of a random ranking over 16 images = mean(1/16, 5/16, 10/16); accuracy = 1/7
    assert f"| {flickr['task']} | image-text retrieval | eval | 16 | – | – | {100 * 16 / 48:.2f} |" in card.text
    assert (f"| {rsscn7['task']} | zero-shot classification | eval | 16 | 7 | {rsscn7['templates']} | "
            f"{100 / 7:.2f} |") in card.text
    assert "Images: resize to" in card.text and "normalise with mean" in card.text
    assert "training samples seen over the whole stream so far" in card.text


def test_a_given_license_and_resume_changes_are_shown(run_dir, tmp_path):
    folder = tmp_path / "task-1"
    import shutil

    shutil.copytree(run_dir / "task-1", folder)
    state = json.loads((folder / "continual_state.json").read_text())
    state["card_license"] = "apache-2.0"
    state["resume_changes"] = [{"after_task": 0, "key": "training.learning_rate", "saved": 0.001, "now": 0.002}]
    (folder / "continual_state.json").write_text(json.dumps(state))
    card = ModelCard.load(write_model_card(folder))
    assert card.data.license == "apache-2.0" and "`apache-2.0`, as set by" in card.text
    assert "| 0 | training.learning_rate | 0.001 | 0.002 |" in card.text


def test_the_cards_inference_example_runs_on_the_checkpoint(run_dir, card_path, capsys):
    """The pipeline snippet of the card, run as a user would, with the checkpoint folder for the repository."""
    text = ModelCard.load(card_path).text
    block = text.split("Zero-shot classification with the pipeline:\n\n```python\n", 1)[1].split("```", 1)[0]
    assert f'model="{REPO_ID}", revision="task-1"' in block
    exec(block.replace(REPO_ID, str(run_dir / "task-1")), {})  # noqa: S102 (the card's own example)
    printed = capsys.readouterr().out
    assert "'label': 'a photo of a dog'" in printed and "'score':" in printed


def test_the_card_states_the_text_convention_and_its_snippet_runs(run_dir, card_path, capsys):
    """A CLIP checkpoint: the tokenizer, its padding and mask as the card states them (from tokenizer_config.json),
    and the card's zero-shot snippet run on the checkpoint folder as a user would."""
    text = ModelCard.load(card_path).text
    assert ("- Texts: the saved `CLIPTokenizer`, padded to the longest text of a batch, truncated at 77 tokens, with "
            "the attention mask.") in text
    assert "one prompt template (`hypothesis_template`" in text and "pads SigLIP texts" not in text
    block = text.split("Zero-shot accuracy as results.json scores it:", 1)[1].split("```python\n", 1)[1]
    exec(block.split("```", 1)[0].replace(REPO_ID, str(run_dir / "task-1")), {})  # noqa: S102 (the card's example)
    assert capsys.readouterr().out.strip() in ("['dog']", "['cat']")


@pytest.mark.parametrize(("model_type", "length", "expected"), [
    ("siglip", 64, "The pipeline pads SigLIP texts to 64 tokens, as this checkpoint was evaluated."),
    ("siglip", 32, "but this checkpoint was trained and evaluated at 32: the pipeline's scores differ"),
    ("siglip2", 64, "SigLIP 2: its tokenizer_config.json names the tokenizer class in `auto_map`"),
])
def test_the_card_states_siglip_s_convention_and_where_the_pipeline_differs(tmp_path, model_type, length, expected):
    matrix = ResultsMatrix(["only"], "accuracy")
    matrix.add_row("only", {"only": {"accuracy": 50.0}})
    folder = _hand_built_checkpoint(tmp_path, matrix, task_sources=["pacs"])
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["SiglipModel"]}))
    tokenizer = {"tokenizer_class": "CLIPTokenizer", "padding": "max_length", "max_length": length,
                 "truncation": True, "model_input_names": ["input_ids"]}
    if model_type == "siglip2":
        tokenizer["auto_map"] = {"AutoTokenizer": ["tokenization_clip.CLIPTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    text = str(build_model_card(folder))
    assert (f'- Texts: the saved `CLIPTokenizer`, padded to {length} tokens (`padding="max_length"`), truncated at '
            f"{length} tokens, with no attention mask") in text
    assert expected in text
