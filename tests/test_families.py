"""The dual-encoder families (`hf_ccl.families`): each saves a checkpoint its plain transformers class loads in a
Python without hf_ccl with the same embeddings; SigLIP's sigmoid loss by hand and against `SiglipModel`'s own; the
family found from a config, chosen in a run config, and the combinations refused before training.

Every method on every family (train, evaluate, save, reload with the plain class, resume exactly) is the exact-resume
matrix of `tests/test_method_registry.py`; the sigmoid loss over two processes is `tests/test_distributed.py`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, Siglip2Config, SiglipConfig, SiglipModel

from hf_ccl.config import RunConfig
from hf_ccl.data import load_tokenizer
from hf_ccl.evaluation.encode import encode_texts
from hf_ccl.families import (
    FAMILIES,
    check_family_methods,
    default_image_processor,
    family_of,
    load_continual_model,
)
from hf_ccl.losses import positive_mask, sigmoid_contrastive_loss
from hf_ccl.methods import build_methods
from hf_ccl.methods.distillation import student_similarity
from hf_ccl.methods.lwf import lwf_kl
from hf_ccl.run import check_config
from hf_ccl.testing import random_image_inputs, tiny_model
from hf_ccl.validation import ConfigError

TEXTS = ["a photo of a dog", "a sketch of a house", "zwei Hunde im Schnee"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """One saved tiny model per family (vocabulary grown by 3 rows, as a language task does), with the embeddings
    hf_ccl's class gives on fixed texts and pixels."""
    folder = tmp_path_factory.mktemp("families")
    expected = {}
    for family in FAMILIES:
        model = tiny_model(family, seed=3)
        model.align_special_tokens(tokenizer)
        model.resize_token_embeddings(len(tokenizer) + 3)
        model.eval()
        model.save_pretrained(folder / family)
        tokens = tokenizer(TEXTS, padding=model.text_padding, max_length=16, truncation=True, return_tensors="pt")
        images = random_image_inputs(model, seed=1)
        with torch.no_grad():
            expected[family] = {
                "inputs": {k: v.tolist() for k, v in model.text_inputs(tokens["input_ids"], tokens["attention_mask"]).items()},
                "images": {name: value.tolist() for name, value in images.items()},
                "text": model.embed_texts(tokens["input_ids"], tokens["attention_mask"], normalize=False).tolist(),
                "image": model.embed_images(**images, normalize=False).tolist(),
            }
    (folder / "expected.json").write_text(json.dumps(expected))
    return folder


PLAIN_CHECK = """
import json, sys, torch, transformers
folder = sys.argv[1]
expected = json.load(open(f"{folder}/expected.json"))
for family, values in expected.items():
    model = transformers.AutoModel.from_pretrained(f"{folder}/{family}")
    inputs = {k: torch.tensor(v) for k, v in values["inputs"].items()}
    with torch.no_grad():
        text = model.get_text_features(**inputs).pooler_output
        image = model.get_image_features(**{k: torch.tensor(v) for k, v in values["images"].items()}).pooler_output
    torch.testing.assert_close(text, torch.tensor(values["text"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(image, torch.tensor(values["image"]), rtol=1e-5, atol=1e-6)
    print(family, type(model).__name__)
assert not any(name.startswith("hf_ccl") for name in sys.modules), "hf_ccl was imported"
"""


def test_every_family_saves_what_its_plain_class_loads_in_a_python_without_hf_ccl(saved):
    result = subprocess.run([sys.executable, "-c", PLAIN_CHECK, str(saved)], capture_output=True, text=True,
                            timeout=300, cwd=saved)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = dict(line.split() for line in result.stdout.splitlines())
    assert loaded == {family: cls.plain_architecture for family, cls in FAMILIES.items()}
    for family, cls in FAMILIES.items():
        config = json.loads((saved / family / "config.json").read_text())
        assert config["architectures"] == [cls.plain_architecture]
        assert family_of(AutoConfig.from_pretrained(saved / family)) == family


def test_load_continual_model_picks_the_family_and_checks_model_family(saved):
    for family, cls in FAMILIES.items():
        assert type(load_continual_model(str(saved / family))) is cls
    with pytest.raises(ValueError, match="model.family is 'siglip' but .* is a 'clip' checkpoint"):
        load_continual_model(str(saved / "clip"), family="siglip")


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="'blip' is not supported; supported: clip, siglip, siglip2"):
        family_of("blip")
    assert family_of(SiglipConfig()) == "siglip" and family_of(Siglip2Config()) == "siglip2"


def test_siglip_2_batches_carry_its_naflex_inputs(tokenizer):
    """SigLIP 2's collated batch holds the patches, their mask and grid; its forward and `embed_images` read them."""
    from hf_ccl.data import CLIPCollator, build_stream

    model = tiny_model("siglip2")
    task = build_stream("digits", max_train_per_task=4).tasks[0]
    batch = CLIPCollator(default_image_processor(model), tokenizer, padding="max_length", max_length=16)(
        [task.train[i] for i in range(4)])
    assert batch["pixel_values"].shape == (4, 16, 3 * 8 * 8) and batch["spatial_shapes"].tolist() == [[4, 4]] * 4
    assert batch["input_ids"].shape == (4, 16)
    out = model(**batch, return_loss=True)
    torch.testing.assert_close(out.image_embeds, model.embed_images(**model.image_inputs(batch)))


# ----- SigLIP's loss ------------------------------------------------------------------------------------------------
def test_sigmoid_loss_by_hand():
    """L = -1/|B| sum_ij log sigmoid(z_ij l_ij), z = +1 on the positives (Zhai et al. 2023, Eq. 1)."""
    logits = torch.tensor([[2.0, -1.0], [0.5, 1.0]])

    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x))

    # positives l_00 = 2, l_11 = 1; negatives l_01 = -1 and l_10 = 0.5 enter negated (z = -1): +1 and -0.5
    diagonal = -(log_sigmoid(2.0) + log_sigmoid(1.0) + log_sigmoid(1.0) + log_sigmoid(-0.5)) / 2
    assert sigmoid_contrastive_loss(logits).item() == pytest.approx(diagonal, rel=1e-6)
    # the two texts are the same caption: every pair is positive
    both = -(log_sigmoid(2.0) + log_sigmoid(1.0) + log_sigmoid(-1.0) + log_sigmoid(0.5)) / 2
    mask = positive_mask(torch.tensor([7, 7]))
    assert sigmoid_contrastive_loss(logits, mask).item() == pytest.approx(both, rel=1e-6)
    # one process's row of the batch: divided by the batch's rows, not its own
    assert sigmoid_contrastive_loss(logits[:1], torch.eye(2, dtype=torch.bool)[:1], num_rows=2).item() == \
        pytest.approx(-(log_sigmoid(2.0) + log_sigmoid(1.0)) / 2, rel=1e-6)


def test_siglip_forward_loss_equals_siglip_model_loss(tokenizer):
    model = tiny_model("siglip", seed=0)
    tokens = tokenizer(TEXTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=tokens["input_ids"], pixel_values=pixels, return_loss=True)
        theirs = SiglipModel.forward(model, input_ids=tokens["input_ids"], pixel_values=pixels, return_loss=True)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.logits_per_image, theirs.logits_per_image, rtol=1e-5, atol=1e-6)
    # a fresh SigLIP starts from the paper's t' = log 10, b = -10, and its scale is not clamped at ln 100
    assert model.logit_scale.item() == pytest.approx(math.log(10.0)) and model.logit_bias.item() == -10.0
    assert model.max_logit_scale is None


def test_siglip_texts_are_padded_to_max_length_without_a_mask(tokenizer):
    """SigLIP pools the last position: evaluation pads every text to the limit and passes no attention mask, so a
    text embeds the same alone and beside a longer one."""
    model = tiny_model("siglip", seed=0)
    alone = encode_texts(model, tokenizer, ["a dog"], max_length=16)
    beside = encode_texts(model, tokenizer, ["a dog", "a much longer caption of a dog in the snow"], max_length=16)
    torch.testing.assert_close(alone[0], beside[0], rtol=1e-5, atol=1e-6)
    assert model.text_inputs(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4)).keys() == {"input_ids"}


def test_the_softmax_distillation_terms_do_not_see_siglip_bias(tokenizer):
    """What the docstring says Mod-X and LwF mean on SigLIP: Mod-X reads raw cosines (no scale, no bias) and LwF's
    row-wise softmax of t*cos + b does not change with b, while the sigmoid task loss does."""
    model = tiny_model("siglip", seed=0)
    tokens = tokenizer(TEXTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model.eval()
    old = torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    terms = []
    with torch.no_grad():
        for shift in (0.0, 5.0):
            model.logit_bias.add_(shift)
            out = model(input_ids=tokens["input_ids"], pixel_values=pixels, return_loss=True)
            terms.append((out.loss, student_similarity(out), lwf_kl(old, out.global_logits_per_image, ["i2t", "t2i"])))
    (loss, cosines, kl), (shifted_loss, shifted_cosines, shifted_kl) = terms
    assert abs(loss.item() - shifted_loss.item()) > 1.0
    torch.testing.assert_close(cosines, shifted_cosines)
    torch.testing.assert_close(kl, shifted_kl, rtol=1e-5, atol=1e-6)


# ----- configs and refusals -----------------------------------------------------------------------------------------
def test_run_config_model_family(tmp_path):
    config = RunConfig(model={"family": "siglip", "config": {"hidden_size": 32, "projection_dim": 32}},
                       output_dir=str(tmp_path))
    assert config.model["family"] == "siglip"
    with pytest.raises(ConfigError, match="model.family: model family 'blip' is not supported"):
        RunConfig(model={"family": "blip"}, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="projection_dim .* must equal .*hidden_size"):
        RunConfig(model={"family": "siglip", "config": {"hidden_size": 32, "projection_dim": 64}},
                  output_dir=str(tmp_path))


@pytest.mark.parametrize(("family", "method", "reason"), [
    ("siglip", "dns", "no image projection"), ("siglip", "learner_heads", "fold an image head"),
    ("siglip", "prompt", "causal text tower"), ("altclip", "prompt", "causal text tower"),
])
def test_a_method_a_family_cannot_run_is_refused_before_training(tmp_path, family, method, reason):
    config = RunConfig(model={"family": family, "config": {"hidden_size": 32, "projection_dim": 32}},
                       methods=[method], output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=f"not available for the {family} family: {method}: .*{reason}"):
        check_config(config)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=reason):
        check_family_methods(tiny_model(family), build_methods([method]))


def test_the_families_image_processors():
    siglip, clip = default_image_processor(tiny_model("siglip")), default_image_processor(tiny_model("clip"))
    assert siglip.size == {"height": 32, "width": 32} and list(siglip.image_mean) == [0.5, 0.5, 0.5]
    assert clip.crop_size == {"height": 32, "width": 32}


# ----- a run through the CLI, and the pipeline on every task revision -----------------------------------------------
@pytest.mark.slow  # the default suite runs every family through the CLI and the pipeline in tests/test_plain_clients.py
@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "clip"])
def test_the_default_recipe_runs_every_family_and_the_pipeline_reads_every_task(tmp_path, capsys, family):
    """`hf-ccl train --config digits model.family=<family>`: trains, evaluates and saves each task; every task
    folder works with `pipeline("zero-shot-image-classification")`."""
    from PIL import Image
    from transformers import pipeline

    from hf_ccl.cli import main

    overrides = [
        f"output_dir={tmp_path}", "progress=false", "training.max_steps=2", "training.per_device_train_batch_size=16",
        "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=10", f"model.family={family}",
        "model.config.hidden_size=32", "model.config.num_layers=1", "model.config.projection_dim=32",
    ]
    assert main(["train", "--config", "digits", *overrides]) == 0
    assert "| after digits-89 |" in capsys.readouterr().out
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    for task in range(5):
        folder = tmp_path / f"task-{task}"
        assert json.loads((folder / "config.json").read_text())["architectures"] == [FAMILIES[family].plain_architecture]
        classifier = pipeline("zero-shot-image-classification", model=str(folder))
        scores = classifier(image, candidate_labels=["a photo of the digit 0", "a photo of the digit 1"])
        assert len(scores) == 2 and all(0.0 <= s["score"] <= 1.0 for s in scores)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_targets_the_attention_and_mlp_layers_of_every_family(family):
    """CLIP's names (`q_proj`, ..., `fc2`) reach every layer of both towers, BERT-style text layers included."""
    from hf_ccl.methods.lora import LoRAMethodConfig, inject_lora

    model = tiny_model(family)
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
               and (".encoder.layer" in name)}
    inject_lora(model, LoRAMethodConfig(target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])
                .to_peft())
    adapted = {name.removesuffix(".lora_A") for name, _ in model.named_modules() if name.endswith(".lora_A")}
    assert adapted == linears and len(adapted) == 12  # 6 per layer, 1 layer per tower


def test_a_run_starts_from_a_saved_checkpoint_of_another_family(saved, tmp_path, capsys):
    """`model.pretrained: <a SigLIP folder>` loads it into its family's class, checked against `model.family`. The
    folder has no tokenizer and a grown vocabulary: the bundled CLIP tokenizer does not fit it, so the run is refused
    before anything is built until `tokenizer` names one."""
    from hf_ccl.cli import main
    from hf_ccl.paths import default_tokenizer_path

    overrides = [f"output_dir={tmp_path / 'run'}", "progress=false", "training.max_steps=1", "training.warmup_steps=0",
                 "training.per_device_train_batch_size=8", "stream_args.max_train_per_task=16",
                 "stream_args.max_eval_per_task=8", f"model.pretrained={saved / 'siglip'}", "model.config={}"]
    assert main(["train", "--config", "digits", *overrides, "tokenizer=null"]) == 2
    assert "has no tokenizer (tokenizer_config.json) and its vocabulary (49411 tokens) is not the bundled CLIP " \
           "tokenizer's (49408): set `tokenizer`" in capsys.readouterr().err
    overrides.append(f"tokenizer={default_tokenizer_path()}")
    assert main(["train", "--config", "digits", *overrides, "model.family=clip"]) == 2  # refused: it is a SigLIP
    assert not (tmp_path / "run").exists()
    assert main(["train", "--config", "digits", *overrides]) == 0
    config = json.loads((tmp_path / "run" / "task-4" / "config.json").read_text())
    assert config["architectures"] == ["SiglipModel"] and config["model_type"] == "siglip"


def test_a_checkpoint_without_tokenizer_or_image_processor_gets_the_defaults_with_a_notice(tmp_path, caplog, tokenizer):
    """A checkpoint whose vocabulary is the bundled CLIP tokenizer's size falls back to it, and to the family's image
    processor at its image size, each with a logged warning."""
    from hf_ccl.run import load_processors

    model = tiny_model("siglip")
    model.save_pretrained(tmp_path)
    config = RunConfig(model={"pretrained": str(tmp_path)}, output_dir=str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="hf_ccl.run"):
        image_processor, used = load_processors(config, load_continual_model(str(tmp_path)))
    assert len(used) == len(tokenizer) == 49408 and type(used) is type(tokenizer)
    assert type(image_processor).__name__ == "SiglipImageProcessorPil" and image_processor.size["height"] == 32
    assert "has no tokenizer: using the bundled CLIP tokenizer" in caplog.text
    assert "has no image processor (preprocessor_config.json): using the siglip family's default" in caplog.text


def test_each_family_saves_its_own_processor_class(tokenizer):
    """SigLIP 2's `Siglip2Processor` only where its built-in image defaults (256 patches of 16 px) are the model's:
    they would override the image processor's own settings when the processor is called."""
    from transformers import Siglip2ImageProcessorPil, Siglip2Tokenizer

    from hf_ccl.processors import family_processor, needs_auto_map

    for family, name in [("clip", "CLIPProcessor"), ("metaclip_2", "CLIPProcessor"), ("siglip", "SiglipProcessor"),
                         ("altclip", "AltCLIPProcessor"), ("chinese_clip", "ChineseCLIPProcessor"),
                         ("siglip2", "SiglipProcessor")]:
        model = tiny_model(family)
        assert type(family_processor(model, default_image_processor(model), tokenizer)).__name__ == name, family
    model = tiny_model("siglip2")
    native = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256)
    assert type(family_processor(model, native, tokenizer)).__name__ == "Siglip2Processor"
    # transformers forces Siglip2Tokenizer on siglip2 checkpoints: any other class needs the auto_map, that one none
    assert needs_auto_map("siglip2", tokenizer) and not needs_auto_map("siglip", tokenizer)
    assert not needs_auto_map("siglip2", Siglip2Tokenizer())


def test_a_siglip2_checkpoint_s_tokenizer_loads_as_plain_transformers_loads_it(tmp_path, tokenizer):
    """Google's SigLIP 2 checkpoints name GemmaTokenizer; transformers loads them as Siglip2Tokenizer (lowercased),
    and so does hf_ccl. A SigLIP 2 checkpoint hf_ccl wrote before it steered transformers (no `auto_map`) loads as
    the class it names, the one it was trained with."""
    from transformers import AutoTokenizer, Siglip2Tokenizer

    google = tmp_path / "google"
    tiny_model("siglip2").config.save_pretrained(google)
    letters = {f"<{name}>": i for i, name in enumerate(["pad", "eos", "bos", "unk", "mask"])}
    Siglip2Tokenizer(vocab={**letters, **{chr(97 + i): 5 + i for i in range(26)}, "▁": 31}).save_pretrained(google)
    config = json.loads((google / "tokenizer_config.json").read_text())
    (google / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GemmaTokenizer"}))
    loaded = load_tokenizer(google)
    assert type(loaded) is type(AutoTokenizer.from_pretrained(google)) is Siglip2Tokenizer
    assert loaded("Ab C")["input_ids"] == loaded("ab c")["input_ids"]  # SigLIP 2 was trained on lowercased text

    older = tmp_path / "older"
    tiny_model("siglip2").config.save_pretrained(older)
    tokenizer.save_pretrained(older)
    (older / "continual_state.json").write_text("{}")
    assert type(AutoTokenizer.from_pretrained(older)) is Siglip2Tokenizer  # what plain transformers does with it
    assert load_tokenizer(older)("a dog")["input_ids"] == tokenizer("a dog")["input_ids"]
