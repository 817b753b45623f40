"""Plain clients get the numbers results.json reports, for every family (issue 25, items 2 and 3).

One tiny 2-task run per family (PACS photos scored with one prompt template, then sketches with two) pushes each task
as a revision to the local Hub server. A Python that never imports hf_ccl then loads every revision from that Hub
and scores every task of it two ways:

- `AutoProcessor` + `AutoModel`, the processor called with its saved defaults and each class embedded as the mean of
  its templates' normalised text embeddings (the card's recipe): top-1 accuracy equal to results.json's, exactly;
- `pipeline("zero-shot-image-classification")` with the task's template as `hypothesis_template`: it takes one
  template, so its accuracy equals results.json's on the one-template task, and on the two-template task it predicts
  what the one-template recipe above predicts.

And a run started from a Hub checkpoint (`model.pretrained=<repo id>`) whose tokenizer and image processor differ from
the family's defaults trains, evaluates and saves with that checkpoint's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from hf_ccl.cli import main
from hf_ccl.data.collate import load_tokenizer
from hf_ccl.data.images import decode_image
from hf_ccl.data.spec import build_stream_from_spec
from hf_ccl.data.templates import format_template
from hf_ccl.families import FAMILIES, default_image_processor, family_class, tiny_config
from hf_ccl.paths import default_tokenizer_path
from hf_ccl.processors import save_processor
from hf_ccl.tokenization import rebuild_tokenizer

NAMESPACE = "hf-ccl-test"
STREAM_ARGS = {"max_train_per_task": 16, "max_eval_per_task": 8}
STREAM = {"builder": "datasets", "name": "pacs-photo-sketch", "entries": [
    {"name": "photo", "train": "pacs", "where": {"domain": "photo"}, "label_column": "label",
     "train_templates": ["a photo of a {label}."], "eval_templates": ["a photo of a {label}."]},
    {"name": "sketch", "train": "pacs", "where": {"domain": "sketch"}, "label_column": "label",
     "train_templates": ["a sketch of a {label}."],
     "eval_templates": ["a sketch of a {label}.", "a drawing of a {label}."]},
]}
IMAGE_STATS = {"image_mean": [0.25, 0.5, 0.75], "image_std": [0.2, 0.3, 0.4]}
SIZES = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 32}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """One local Hub server for the module, with this process (and its subprocesses) pointed at it."""
    from hf_ccl.testing import LocalHubServer

    root = tmp_path_factory.mktemp("hub")
    with LocalHubServer(root / "repos") as server, server.patch_client(cache_dir=root / "cache"):
        yield server


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> Path:
    """The bundled CLIP BPE cut to its first 300 merges (814 tokens; built, not trained, so ids are the same in every
    session): a checkpoint's own tokenizer, unlike the 49,408-token default."""
    full = AutoTokenizer.from_pretrained(str(default_tokenizer_path()))
    data = json.loads(full.backend_tokenizer.to_str())
    size = 512 + 300  # the byte alphabet, with and without the end-of-word mark, then the merges' tokens
    data["model"]["merges"] = data["model"]["merges"][:300]
    data["model"]["vocab"] = {token: i for token, i in data["model"]["vocab"].items() if i < size}
    special = {full.bos_token: size, full.eos_token: size + 1}
    data["model"]["vocab"].update(special)
    for token in data["added_tokens"]:
        token["id"] = special[token["content"]]
    processor = data["post_processor"]
    processor["cls"], processor["sep"] = [full.bos_token, size], [full.eos_token, size + 1]
    folder = tmp_path_factory.mktemp("tokenizer")
    rebuild_tokenizer(full, data).save_pretrained(folder)
    return folder


def _third_party_checkpoint(family: str, folder: Path, tokenizer_dir: Path) -> None:
    """A tiny checkpoint of `family` with its own tokenizer (814 tokens, not the bundled 49,408) and image processor
    (another mean and std than the family's), saved as hf_ccl saves one (SigLIP 2's tokenizer steered)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    sizes = {**SIZES, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)
    model = family_class(family)(tiny_config(family, **sizes))
    model.align_special_tokens(tokenizer)
    image_processor = default_image_processor(model)
    image_processor.image_mean, image_processor.image_std = IMAGE_STATS["image_mean"], IMAGE_STATS["image_std"]
    model.save_pretrained(folder)
    save_processor(folder, model, image_processor, tokenizer, model.max_text_positions)


@pytest.fixture(scope="module")
def runs(hub, small_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """{family: output_dir} of one 2-task run per family started from `<NAMESPACE>/third-party-<family>` on the Hub,
    each task pushed to `<NAMESPACE>/plain-<family>`."""
    from huggingface_hub import HfApi

    root = tmp_path_factory.mktemp("runs")
    done = {}
    for family in FAMILIES:
        start = f"{NAMESPACE}/third-party-{family}"
        _third_party_checkpoint(family, root / start, small_tokenizer)
        HfApi().create_repo(start)
        HfApi().upload_folder(repo_id=start, folder_path=root / start)
        config = {"stream": STREAM, "stream_args": STREAM_ARGS, "methods": ["finetune"], "progress": False,
                  "model": {"pretrained": start}, "output_dir": str(root / family),
                  "hub": {"model_id": f"{NAMESPACE}/plain-{family}"}, "evaluation": {"initial": False},
                  "training": {"max_steps": 4, "per_device_train_batch_size": 8, "learning_rate": 1e-2}}
        path = root / f"{family}.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        assert main(["train", "--config", str(path)]) == 0, family
        done[family] = root / family
    return done


@pytest.fixture(scope="module")
def eval_sets(tmp_path_factory) -> Path:
    """Each task's eval images (PNG), labels, class names and templates, as a plain client would have them."""
    folder = tmp_path_factory.mktemp("eval")
    stream = build_stream_from_spec(STREAM, **STREAM_ARGS)
    tasks = []
    for task in stream.tasks:
        images = []
        for index, row in enumerate(task.eval):
            path = folder / f"{task.name}-{index}.png"
            decode_image(row["image"], path.name).save(path)
            images.append(str(path))
        tasks.append({"name": task.name, "images": images, "labels": [row["label"] for row in task.eval],
                      "classes": list(task.class_names),
                      "prompts": [[format_template(t, name) for t in task.eval_templates] for name in task.class_names],
                      "pipeline_templates": [t.replace("{label}", "{}") for t in task.eval_templates]})
    (folder / "tasks.json").write_text(json.dumps(tasks), encoding="utf-8")
    return folder


PLAIN_CLIENT = r"""
import json, sys
import torch
from PIL import Image
from huggingface_hub import hf_hub_download
from transformers import AutoModel, AutoProcessor, pipeline

tasks = json.load(open(sys.argv[1]))
repos = sys.argv[2:]
TIE = 1e-5


def embed(output):
    return torch.nn.functional.normalize(output.pooler_output, dim=-1)


def ties(similarity):  # images whose two best classes are closer than float32 noise: either may win
    top2 = similarity.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1] < TIE).nonzero().flatten().tolist()


def accuracy(predictions, labels):
    return 100.0 * sum(int(p == l) for p, l in zip(predictions, labels)) / len(labels)


report = {}
for repo in repos:
    for revision in ("task-0", "task-1"):
        results = json.load(open(hf_hub_download(repo, "results.json", revision=revision)))
        expected = results["rows"][-1]["metrics"]
        model = AutoModel.from_pretrained(repo, revision=revision).eval()
        processor = AutoProcessor.from_pretrained(repo, revision=revision)
        classifier = pipeline("zero-shot-image-classification", model=repo, revision=revision)
        for task in tasks:
            images = [Image.open(path).convert("RGB") for path in task["images"]]
            with torch.no_grad():
                image_embeds = embed(model.get_image_features(**processor(images=images, return_tensors="pt")))
                per_template = [embed(model.get_text_features(**processor(text=[p[t] for p in task["prompts"]],
                                                                          return_tensors="pt")))
                                for t in range(len(task["prompts"][0]))]
            ensemble = torch.nn.functional.normalize(torch.stack(per_template).mean(0), dim=-1)
            similarity = image_embeds @ ensemble.T
            scores = [classifier(images, candidate_labels=task["classes"], hypothesis_template=template)
                      for template in task["pipeline_templates"]]
            piped = [[task["classes"].index(ranked[0]["label"]) for ranked in by_image] for by_image in scores]
            one_template = [image_embeds @ text.T for text in per_template]
            report[f"{repo}@{revision}/{task['name']}"] = {
                "results_json": expected[task["name"]]["accuracy"],
                "plain": accuracy(similarity.argmax(-1).tolist(), task["labels"]), "ties": ties(similarity),
                "pipeline": [accuracy(p, task["labels"]) for p in piped],
                "pipeline_differs": [[i for i, (p, q) in enumerate(zip(by_image, text.argmax(-1).tolist())) if p != q]
                                     for by_image, text in zip(piped, one_template)],
                "one_template_ties": [ties(plain_t) for plain_t in one_template],
                "processor": type(processor).__name__, "tokenizer": type(processor.tokenizer).__name__,
                "pipeline_tokenizer": type(classifier.tokenizer).__name__,
            }
assert not any(name.startswith("hf_ccl") for name in sys.modules), "hf_ccl was imported"
print(json.dumps(report))
"""

PROCESSORS = {"clip": "CLIPProcessor", "metaclip_2": "CLIPProcessor", "siglip": "SiglipProcessor",
              "siglip2": "SiglipProcessor", "altclip": "AltCLIPProcessor", "chinese_clip": "ChineseCLIPProcessor"}


def test_every_family_s_revisions_give_plain_clients_the_numbers_of_results_json(runs, eval_sets, tmp_path):
    repos = [f"{NAMESPACE}/plain-{family}" for family in runs]
    result = subprocess.run([sys.executable, "-c", PLAIN_CLIENT, str(eval_sets / "tasks.json"), *repos],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert len(report) == len(FAMILIES) * 2 * 2
    for key, entry in report.items():
        family = key.split("/plain-")[1].split("@")[0]
        step = 100.0 / STREAM_ARGS["max_eval_per_task"]  # one image
        # exact, but for images whose two best classes tie within float32 noise (either may win in either process)
        assert abs(entry["plain"] - entry["results_json"]) <= step * len(entry["ties"]), (key, entry)
        for differs, ties in zip(entry["pipeline_differs"], entry["one_template_ties"], strict=True):
            assert set(differs) <= set(ties), (key, entry)  # the pipeline predicts what the card's recipe does
        if key.endswith("/photo"):  # scored with one template: the pipeline gives results.json's number
            (piped,) = entry["pipeline"]
            assert abs(piped - entry["results_json"]) <= step * len(entry["ties"]), (key, entry)
        assert entry["processor"] == PROCESSORS[family], (key, entry)
        assert entry["tokenizer"] == entry["pipeline_tokenizer"] == "CLIPTokenizer", (key, entry)  # SigLIP 2 too
    assert sum(len(entry["ties"]) for entry in report.values()) <= 2, report  # the checks above stay exact
    warnings = [line for line in result.stderr.splitlines() if "must be `None` or an integer within the vocab" in line]
    assert all("(between 0 and 31999), got 4940" in line for line in warnings), warnings  # transformers' defaults only


def test_the_saved_tokenizer_carries_each_family_s_convention(runs):
    for family, output_dir in runs.items():
        config = json.loads((output_dir / "task-1" / "tokenizer_config.json").read_text())
        sigmoid = family in ("siglip", "siglip2")
        assert config["padding"] == ("max_length" if sigmoid else "longest"), family
        assert config["model_input_names"] == (["input_ids"] if sigmoid else ["input_ids", "attention_mask"])
        assert config["max_length"] == (64 if sigmoid else 77) and config["truncation"] is True
        assert config.get("auto_map") == ({"AutoTokenizer": ["tokenization_clip.CLIPTokenizer", None]}
                                          if family == "siglip2" else None)
        assert not {"is_local", "local_files_only"} & set(config)
        text = json.loads((output_dir / "task-1" / "config.json").read_text())["text_config"]
        assert all(0 <= text[name] < text["vocab_size"] for name in ("bos_token_id", "eos_token_id")), family
    with pytest.raises(OSError, match="tokenization_clip.py"):  # the card: load it without trust_remote_code
        AutoTokenizer.from_pretrained(runs["siglip2"] / "task-1", trust_remote_code=True)


def test_a_run_from_a_hub_checkpoint_uses_its_own_tokenizer_and_image_processor(runs, small_tokenizer):
    """`model.pretrained=<Hub id>`, no `tokenizer`: every family trains and saves with the checkpoint's tokenizer (814
    tokens; the bundled default has 49,408) and image processor (its mean and std, not the family's)."""
    expected = AutoTokenizer.from_pretrained(str(small_tokenizer))
    for family, output_dir in runs.items():
        saved = output_dir / "task-1"
        tokenizer = load_tokenizer(saved)
        assert type(tokenizer) is type(expected) and tokenizer.get_vocab() == expected.get_vocab(), family
        image = json.loads((saved / "preprocessor_config.json").read_text())
        assert {key: image[key] for key in IMAGE_STATS} == IMAGE_STATS, family
        state = json.loads((saved / "continual_state.json").read_text())
        assert state["base_model"] == f"{NAMESPACE}/third-party-{family}"


def test_a_hub_checkpoint_without_a_tokenizer_that_the_default_does_not_fit_is_an_error(hub, small_tokenizer, tmp_path):
    from huggingface_hub import HfApi

    from hf_ccl.config import RunConfig
    from hf_ccl.families import load_continual_model
    from hf_ccl.run import load_processors

    repo = f"{NAMESPACE}/no-tokenizer"
    _third_party_checkpoint("siglip", tmp_path, small_tokenizer)
    HfApi().create_repo(repo)
    HfApi().upload_folder(repo_id=repo, folder_path=tmp_path, allow_patterns=["config.json", "model.safetensors"])
    config = RunConfig(model={"pretrained": repo}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="has no tokenizer .* vocabulary \\(814 tokens\\) is not the bundled CLIP"):
        load_processors(config, load_continual_model(repo))
