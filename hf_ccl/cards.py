"""Hub model cards for the task checkpoints of a continual run.

`write_model_card("outputs/run/task-2", repo_id="me/clip-pacs")` reads the checkpoint's `continual_state.json`,
`results.json`, `config.json` and method configs, writes `results_heatmap.png` (when matplotlib is installed) and
`README.md`: YAML front matter from `huggingface_hub.ModelCardData` (tags, pipeline, base model, a `model-index` of
the last row's scores) and the markdown of the Jinja2 template `hf_ccl/model_cards/continual_clip.md`.
Nothing from the environment goes into a card, and argument names that look like credentials are left out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .callbacks import StreamControl, StreamState, TaskCallback
from .compute import cost_table, task_records
from .data.task import find_task_kind
from .eval_results import benchmark_file, not_on_the_hub, task_datasets
from .evaluation.matrix import DERIVED_DESCRIPTIONS, INITIAL_LABEL, RESULTS_JSON, ResultsMatrix
from .processors import AUTO_MAP_NOTE
from .version import __version__

if TYPE_CHECKING:
    from .arguments import ContinualArguments

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
HEATMAP_FILE = "results_heatmap.png"
STATE_FILE = "continual_state.json"  # written by ContinualLearner.save_checkpoint (hf_ccl.continual.CHECKPOINT_STATE)
METHOD_STATE_FILE = "method_state.json"
SPATIAL_DISORDER_PNG = "spatial_disorder.png"
TEMPLATE_NAME = "continual_clip.md"
MISSING = "–"
REPO_PLACEHOLDER = "<namespace>/<repo-name>"
PIPELINE_TAG = "zero-shot-image-classification"
#: The length `pipeline("zero-shot-image-classification")` pads SigLIP texts to (fixed in transformers).
PIPELINE_SIGLIP_LENGTH = 64

#: Terms and citations of the bundled datasets (wording of shared/datasets/SOURCES.md), by folder name.
BUNDLED_DATASET_TERMS = {
    "flickr8k": "Hodosh et al. 2013 (research use, Flickr terms); Li et al. ICMR 2016; "
    "Elliott et al. 2016 (research, non-commercial); IMLIP 2022",
    "pacs": "Li et al., ICCV 2017",
    "rsscn7": "Zou et al., GRSL 2015",
    "fashion": "'Fashion Product Images (Small)', P. Aggarwal",
    "cifar10": "Krizhevsky 2009",
}
#: Datasets that ship with a library rather than in shared/datasets.
LIBRARY_DATASET_TERMS = {
    "digits": "scikit-learn's `load_digits`, a copy of the test set of the UCI Optical Recognition of Handwritten "
    "Digits data (Alpaydin & Kaynak 1998)",
}
UNKNOWN_TERMS = "see the dataset's own card"


@dataclass(frozen=True)
class EvalMetric:
    """How one metric of a results row becomes a `model-index` entry."""

    key: str  # the metric's name in results.json
    task_type: str
    task_name: str
    metric_type: str
    metric_name: str


EVAL_METRICS = (
    EvalMetric("accuracy", PIPELINE_TAG, "Zero-shot image classification", "accuracy", "top-1 accuracy (%)"),
    *(
        EvalMetric(f"{short}_R@{k}", task_type, task_name, f"recall@{k}", f"{short} R@{k} (%)")
        for short, task_type, task_name in (
            ("i2t", "image-to-text-retrieval", "Image-to-text retrieval"),
            ("t2i", "text-to-image-retrieval", "Text-to-image retrieval"),
        )
        for k in (1, 5, 10)
    ),
)

DERIVED_LABELS = {
    "final_average": "final average",
    "average_incremental": "average incremental",
    "forgetting": "forgetting",
    "backward_transfer": "backward transfer (BWT)",
    "forward_transfer": "forward transfer (FWT)",
    "initial_average": "initial average",
    "tic_id": "TiC in-domain",
    "tic_bwt": "TiC backward",
    "tic_fwt": "TiC forward",
    "tic_rel_bwt": "TiC relative backward",
    "tic_rel_fwt": "TiC relative forward",
    "mtil_transfer": "MTIL Transfer",
    "mtil_average": "MTIL Avg.",
    "mtil_last": "MTIL Last",
    "class_incremental_average": "class-incremental Avg",
    "class_incremental_last": "class-incremental Last",
}

_CREDENTIAL_KEY = re.compile(r"token|secret|password|passwd|api_?key|credential", re.IGNORECASE)
_TOKEN_VALUE = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# ----- reading a checkpoint -------------------------------------------------------------------------------------
def _read_json(path: Path, what_writes_it: str) -> Any:
    if not path.is_file():
        raise ValueError(
            f"{path.name} not found in {path.parent}: it is written by {what_writes_it}. "
            f"Point at a task checkpoint folder (output_dir/task-<k>/) of an hf_ccl run."
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from error


def _read_checkpoint(folder: Path) -> tuple[dict[str, Any], ResultsMatrix]:
    """The continual state and the results matrix of a task checkpoint, with errors that name the missing file."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory; expected a task checkpoint folder output_dir/task-<k>/")
    state = _read_json(folder / STATE_FILE, "ContinualLearner.save_checkpoint after every task")
    _read_json(folder / RESULTS_JSON, "ResultsMatrix.save, which ContinualLearner.save_checkpoint calls after every task")
    for key in ("task_index", "task_names"):
        if key not in state:
            raise ValueError(f"{folder / STATE_FILE} has no {key!r}; was it written by hf_ccl's ContinualLearner?")
    try:
        matrix = ResultsMatrix.load(folder)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{folder / RESULTS_JSON} is not a results matrix written by hf_ccl ({error!r})") from error
    return state, matrix


def _method_configs(folder: Path, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{method: hyperparameters}: from continual_state.json, else from the configs in method_state.json."""
    configs = state.get("method_configs")
    if configs is None and (folder / METHOD_STATE_FILE).is_file():
        saved = json.loads((folder / METHOD_STATE_FILE).read_text(encoding="utf-8"))
        configs = {name: entry.get("config", {}) for name, entry in saved.items()}
    configs = dict(configs or {})
    return {name: dict(configs.get(name) or {}) for name in state.get("methods") or configs}


def _parameter_count(path: Path) -> int | None:
    """Number of parameters in a safetensors file, read from its header alone (no tensor is loaded)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error):
        return None
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def _architecture(folder: Path) -> str:
    """The plain transformers class the checkpoint names (`CLIPModel`, `SiglipModel`, ...)."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return str((config.get("architectures") or ["CLIPModel"])[0])


def _model_sizes(folder: Path) -> list[tuple[str, str]]:
    """A few rows describing the architecture, from config.json (empty if it is missing)."""
    path = folder / "config.json"
    if not path.is_file():
        return []
    config = json.loads(path.read_text(encoding="utf-8"))
    text, vision = config.get("text_config", {}), config.get("vision_config", {})

    def encoder(part: Mapping[str, Any]) -> str:
        layers = part.get("num_hidden_layers", "?")
        return f"{part.get('hidden_size', '?')} wide, {layers} layer{'s' if layers != 1 else ''}, " \
               f"{part.get('num_attention_heads', '?')} heads"

    rows = [
        ("text encoder", f"{encoder(text)}, {text.get('max_position_embeddings', '?')} tokens of context"),
        ("vision encoder", f"{encoder(vision)}, {vision.get('image_size', '?')} px images, "
                           f"{vision.get('patch_size', '?')} px patches"),
        ("embedding dimension", str(config.get("projection_dim") or text.get("projection_size")
                                    or text.get("hidden_size", "?"))),
        ("vocabulary", f"{text['vocab_size']:,} tokens" if "vocab_size" in text else "?"),
    ]
    count = _parameter_count(folder / "model.safetensors")
    if count is not None:
        rows.append(("parameters", f"{count / 1e6:.2f} M"))
    return rows


# ----- formatting -----------------------------------------------------------------------------------------------
def _cell(text: Any) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(value: Any) -> str:
    """A hyperparameter or argument value as a table cell (tokens that look like Hub credentials are redacted)."""
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return _cell(_TOKEN_VALUE.sub("[redacted]", text))


def format_score(value: float, decimals: int = 1) -> str:
    """A matrix cell as the card shows it: `decimals` places, `–` for NaN or a missing metric."""
    return f"{value:.{decimals}f}" if math.isfinite(value) else MISSING


def _public_args(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows, leaving out anything named like a credential."""
    return [(_cell(name), _value(value)) for name, value in values.items() if not _CREDENTIAL_KEY.search(name)]


def _is_local_path(source: str) -> bool:
    return PurePath(source).is_absolute() or source.startswith((".", "~")) or os.path.exists(source)


def is_hub_id(name: str | None) -> bool:
    """True for a Hub repository id (`name` or `namespace/name`) that is not a local path."""
    if not name:
        return False
    return _HUB_ID.match(name) is not None and ".." not in name and not _is_local_path(name)


def _source_name(source: str) -> str:
    """A dataset source as published: a local folder by its name only (no local paths in a public card)."""
    return PurePath(source).name if source and _is_local_path(source) else source


def dataset_terms(source: str) -> tuple[str, bool]:
    """(terms or citation to show for a dataset source, whether it is one of the bundled datasets)."""
    name = source if source in BUNDLED_DATASET_TERMS or source in LIBRARY_DATASET_TERMS else None
    if name is None and source and _is_local_path(source):
        name = PurePath(source).name
    if name in BUNDLED_DATASET_TERMS:
        return BUNDLED_DATASET_TERMS[name], True
    if name in LIBRARY_DATASET_TERMS:
        return LIBRARY_DATASET_TERMS[name], False
    if "/" in source and is_hub_id(source):
        return f"{UNKNOWN_TERMS}: https://huggingface.co/datasets/{source}", False
    return UNKNOWN_TERMS, False


def _base_model_line(base_model: str | None) -> str:
    if not base_model:
        return ""
    if is_hub_id(base_model):
        return f"[`{base_model}`](https://huggingface.co/{base_model})"
    return f"a local checkpoint, `{PurePath(base_model).name}`"


# ----- the card -------------------------------------------------------------------------------------------------
#: The split every task is evaluated on (each task's `eval` split: the source's test split, or a held-out part).
EVAL_SPLIT = "eval"


def eval_results(
    matrix: ResultsMatrix, sources: Mapping[str, str] | None = None,
    datasets: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[EvalResult]:
    """`model-index` entries for the last trained row of `matrix`: every task trained so far, every metric of
    `EVAL_METRICS` (tasks not trained yet are zero-shot transfer, shown in the card's matrix only).

    Values are in percent, rounded to 4 decimals; NaN and missing metrics are left out. `dataset_type` is the task's
    Hub dataset (`datasets[task]["id"]`, with its `revision`: `hf_ccl.eval_results.task_datasets`), else its source
    (`sources[task]`; the task name when unknown), and `dataset_config` the task's name: the Hub merges results
    whose task type, dataset type, config and split agree, so tasks cut from one source stay apart.
    """
    if not matrix.rows:
        return []
    last, sources, datasets = matrix.rows[-1], sources or {}, datasets or {}
    results = []
    for task in matrix.task_names[: min(matrix.num_trained, matrix.num_tasks)]:
        metrics = last.metrics.get(task, {})
        hub = datasets.get(task) or {}
        dataset_type = hub.get("id") or _source_name(sources.get(task) or "") or task
        for spec in EVAL_METRICS:
            value = metrics.get(spec.key, math.nan)
            if math.isfinite(value):
                results.append(
                    EvalResult(
                        task_type=spec.task_type,
                        task_name=spec.task_name,
                        dataset_type=dataset_type,
                        dataset_name=task,
                        dataset_config=task,
                        dataset_split=EVAL_SPLIT,
                        dataset_revision=hub.get("revision"),
                        metric_type=spec.metric_type,
                        metric_name=spec.metric_name,
                        metric_value=round(value, 4),
                    )
                )
    return results


#: What a classification task's headline is scored among, per `class_scope` (`hf_ccl.class_prompts`).
SCORED_AMONG = {
    "task": "the task's own classes",
    "seen": "every class seen so far (`class_scope: seen`: the task's own and those of every task trained up to this "
            "checkpoint; no task identity)",
    "all": "every class of every task of the stream, trained or not (`class_scope: all`, X-TAIL; no domain identity)",
}


def chance_level(entry: Mapping[str, Any]) -> float | None:
    """The headline score (%) of a random guess, from the task's kind (`TaskKind.chance_level`): 100/classes for
    accuracy; for retrieval R_mean, the mean of K/N over K = 1, 5, 10 with N eval examples (one caption per image)."""
    kind = find_task_kind(entry.get("kind"))
    return None if kind is None else kind.chance_level(entry.get("examples"), entry.get("classes"))


def _protocol_rows(evaluation: list[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for entry in evaluation:
        chance = chance_level(entry)
        kind = find_task_kind(entry.get("kind"))
        rows.append([_cell(entry.get("task")), _cell(kind.description if kind else entry.get("kind") or MISSING), _cell(entry.get("split", "eval")), _value(entry.get("examples")),
                     _value(entry.get("classes")) if entry.get("classes") else MISSING,
                     _value(entry.get("templates")) if entry.get("templates") else MISSING,
                     MISSING if chance is None else format_score(chance, 2)])
    return rows


def _preprocessing(folder: Path) -> str:
    """Image preprocessing as saved with the checkpoint (`preprocessor_config.json`)."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return ""
    config = json.loads(path.read_text(encoding="utf-8"))
    size, crop = config.get("size"), config.get("crop_size")
    parts = [f"resize to {_value(size)}" if size else "", f"center crop {_value(crop)}" if crop else "",
             f"normalise with mean {_value(config.get('image_mean'))}, std {_value(config.get('image_std'))}"
             if config.get("image_mean") else ""]
    return "; ".join(part for part in parts if part)


def _text_convention(folder: Path) -> list[str]:
    """How the checkpoint's texts were tokenized and what the processor and the pipeline do with it, from the
    convention `hf_ccl.processors.save_processor` writes into tokenizer_config.json (empty when it is not there)."""
    path = folder / "tokenizer_config.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    padding, length = tokenizer.get("padding"), tokenizer.get("max_length")
    if padding is None or length is None:
        return []
    padded = f'padded to {length} tokens (`padding="max_length"`)' if padding == "max_length" else \
        "padded to the longest text of a batch"
    mask = "with the attention mask" if "attention_mask" in tokenizer.get("model_input_names", ["attention_mask"]) \
        else "with no attention mask (the text tower pools the last position and was trained without one)"
    lines = [f"Texts: the saved `{_cell(tokenizer.get('tokenizer_class'))}`, {padded}, truncated at {length} tokens, "
             f"{mask}. The saved processor does the same by default (`processor(text=..., return_tensors=\"pt\")`: "
             "the defaults are in tokenizer_config.json).",
             "The pipeline embeds each label with one prompt template (`hypothesis_template`, default "
             '`"This is a photo of {}."`): with a task\'s template it gives that task\'s accuracy where the task is '
             "scored with one template (see *Evaluation protocol*); where a task averages several templates, the "
             "snippet below reproduces it."]
    config_path = folder / "config.json"
    model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type", "") if config_path.is_file() \
        else ""
    if "siglip" in model_type:
        lines.append(f"The pipeline pads SigLIP texts to {PIPELINE_SIGLIP_LENGTH} tokens"
                     + (", as this checkpoint was evaluated." if length == PIPELINE_SIGLIP_LENGTH else
                        f", but this checkpoint was trained and evaluated at {length}: the pipeline's scores differ "
                        "from results.json's; use the processor."))
    if "auto_map" in tokenizer:
        lines.append(f"SigLIP 2: {AUTO_MAP_NOTE}.")
    return lines


def _samples_seen(folder: Path) -> int | None:
    path = folder / "compute.json"
    if not path.is_file():
        return None
    tasks = json.loads(path.read_text(encoding="utf-8")).get("tasks", [])
    return sum(int(task.get("samples_seen", 0)) for task in tasks)


def _samples_seen_text(samples: int | None) -> str:
    if samples is None:
        return "the number of training samples is not recorded"
    return f"{samples:,} training samples seen over the whole stream so far"


def _derived_rows(matrix: ResultsMatrix) -> tuple[list[tuple[str, str, str]], list[str]]:
    summary = matrix.summary()
    order = {name: position for position, name in enumerate(DERIVED_LABELS)}
    rows = [
        (DERIVED_LABELS.get(name, name), format_score(value, 2), DERIVED_DESCRIPTIONS.get(name, ""))
        for name, value in sorted(summary.items(), key=lambda item: order.get(item[0], len(order)))
    ]
    notes = ["All in percentage points; `–` where a metric needs two trained tasks or is undefined."] if rows else []
    k = min(matrix.num_trained, matrix.num_tasks)
    if rows and k < matrix.num_tasks:
        notes.append(f"Computed on the first {k} of {matrix.num_tasks} tasks (the {k} x {k} block trained so far).")
    if rows and len(set(matrix.headline_metrics)) > 1:
        notes.append("Averages mix the headline metrics of different tasks (all in percent).")
    return rows, notes


def _matrix_rows(matrix: ResultsMatrix) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = []
    initial = matrix.initial_headline()
    if initial is not None:
        rows.append((INITIAL_LABEL, [format_score(v) for v in initial]))
    for row, values in zip(matrix.rows, matrix.headline(), strict=True):
        rows.append((_cell(f"after {row.label}"), [format_score(v) for v in values]))
    return rows


def _eval_results_files(on_hub: Mapping[str, Mapping[str, Any]], matrix: ResultsMatrix) -> list[str]:
    """The card's lines on `.eval_results/`: a file per Hub dataset and the tasks it scores (none when the last
    row was not evaluated)."""
    if not matrix.rows or not matrix.rows[-1].evaluated:
        return []
    headline = dict(zip(matrix.task_names, matrix.headline_metrics, strict=True))
    files: dict[str, list[str]] = {}
    for task, dataset in on_hub.items():
        if headline.get(task) not in matrix.rows[-1].metrics.get(task, {}):
            continue  # no headline in the row: no entry
        revision = f" at `{str(dataset['revision'])[:10]}`" if dataset.get("revision") else ""
        files.setdefault(f"`{benchmark_file(dataset['id'])}` (`{dataset['id']}`{revision})", []).append(_cell(task))
    return [f"{name}: {', '.join(tasks)}" for name, tasks in files.items()]


def checkpoint_loaders(methods: Mapping[str, Any]) -> list[dict[str, str]]:
    """The loaders of the methods whose evaluated model is not the checkpoint's weights alone
    (`ContinualMethod.checkpoint_loader`), for the card's "How to use"."""
    from .methods import METHODS

    loaders = []
    for name in methods:
        loader = getattr(METHODS.get(name), "checkpoint_loader", None)
        if loader is not None:
            loaders.append({"method": name, "module": loader.module, "function": loader.function,
                            "keeps": loader.keeps, "plain_model": loader.plain_model})
    return loaders


def _template_text(template_path: str | Path | None) -> str:
    if template_path is not None:
        return Path(template_path).read_text(encoding="utf-8")
    return resources.files("hf_ccl").joinpath("model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


@lru_cache(maxsize=8)
def _compiled_template(text: str) -> jinja2.Template:
    """A card template compiled once per text (compiling costs more than rendering: once per task otherwise)."""
    environment = jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined
    )
    return environment.from_string(text)


def build_model_card(
    checkpoint_dir: str | Path, repo_id: str | None = None, *, template_path: str | Path | None = None
) -> ModelCard:
    """The Hub model card of a task checkpoint folder (`output_dir/task-<k>/`), not yet written anywhere.

    `repo_id` names the Hub repository in the loading snippet and the card's title (a placeholder when None). The
    heatmap image is referenced only if `results_heatmap.png` is already in the folder (`write_model_card` draws
    it). Raises ValueError when `continual_state.json` or `results.json` is missing or malformed.
    """
    folder = Path(checkpoint_dir)
    state, matrix = _read_checkpoint(folder)
    task_names = list(state["task_names"])
    task_index = int(state["task_index"])
    sources = dict(zip(task_names, state.get("task_sources") or [""] * len(task_names), strict=False))
    methods = _method_configs(folder, state)
    stream = str(state.get("stream") or "custom")
    base_model = state.get("base_model")
    headline = dict(zip(matrix.task_names, matrix.headline_metrics, strict=True))

    model_name = repo_id.split("/")[-1] if repo_id else f"hf_ccl-{stream}-{'-'.join(methods) or 'clip'}"
    on_hub = task_datasets(state)
    results = eval_results(matrix, sources, on_hub)
    hub_datasets = list(dict.fromkeys([*(d["id"] for d in on_hub.values()),
                                       *(source for source in sources.values() if "/" in source and is_hub_id(source))]))
    card_data = ModelCardData(
        license=state.get("card_license") or "other",
        model_name=model_name,
        library_name="transformers",
        pipeline_tag=PIPELINE_TAG,
        tags=list(dict.fromkeys(["clip", "continual-learning", "hf_ccl", *methods])),
        base_model=base_model if is_hub_id(base_model) else None,
        datasets=hub_datasets or None,
        eval_results=results or None,
    )

    training = _public_args(state.get("training") or {})
    if state.get("seed") is not None:
        training.append(("seed (run)", _value(state["seed"])))
    if state.get("first_task_epochs") is not None:
        training.append(("num_train_epochs (first task only)", _value(state["first_task_epochs"])))

    datasets: dict[str, tuple[str, bool]] = {}
    for task in task_names:
        source = sources.get(task) or ""
        datasets.setdefault(_cell(_source_name(source) or task), dataset_terms(source))
    derived, derived_notes = _derived_rows(matrix)
    context = {
        "card_data": card_data.to_yaml(),
        "model_name": _cell(model_name),
        "stream": _cell(stream),
        "method_list": ", ".join(f"`{name}`" for name in methods) or "(none recorded)",
        "task_position": task_index + 1,
        "task_index": task_index,
        "num_tasks": len(task_names),
        "task_name": _cell(state.get("task_name") or task_names[task_index]),
        "base_model": _base_model_line(base_model),
        "model_sizes": _model_sizes(folder),
        "architecture": _architecture(folder),
        "tasks": [
            {
                "number": i + 1,
                "name": _cell(task),
                "source": _cell(_source_name(sources.get(task) or "") or MISSING),
                "metric": headline.get(task, MISSING),
                "trained": i <= task_index,
            }
            for i, task in enumerate(task_names)
        ],
        "methods": [{"name": name, "params": _public_args(config)} for name, config in methods.items()],
        "training": training,
        "matrix_header": ["model"] + [
            _cell(f"{task} ({metric})") for task, metric in zip(matrix.task_names, matrix.headline_metrics, strict=True)
        ],
        "matrix_rows": _matrix_rows(matrix),
        "heatmap": HEATMAP_FILE if (folder / HEATMAP_FILE).is_file() else "",
        "derived": derived,
        "derived_notes": derived_notes,
        "spatial_disorder": SPATIAL_DISORDER_PNG if (folder / SPATIAL_DISORDER_PNG).is_file() else "",
        "loaders": checkpoint_loaders(methods),
        "repo_id": repo_id or REPO_PLACEHOLDER,
        "repo_id_placeholder": repo_id is None,
        "datasets": [(name, terms) for name, (terms, _) in datasets.items()],
        "any_bundled": any(bundled for _, bundled in datasets.values()),
        "hf_ccl_version": state.get("hf_ccl_version") or __version__,
        "license": state.get("card_license"),
        "protocol": _protocol_rows(state.get("evaluation") or []),
        "scored_among": SCORED_AMONG.get(state.get("class_scope", "task"), SCORED_AMONG["task"]),
        "preprocessing": _preprocessing(folder),
        "convention": _text_convention(folder),
        "samples_seen_text": _samples_seen_text(_samples_seen(folder)),
        "cost_table": cost_table(task_records(matrix.cost), matrix.cost_run),
        "resume_changes": [(change.get("after_task"), _cell(change.get("key")), _value(change.get("saved")),
                            _value(change.get("now"))) for change in state.get("resume_changes") or []],
        "eval_results_files": _eval_results_files(on_hub, matrix),
        "eval_results_left_out": [_cell(task) for task in not_on_the_hub(state)] if "task_datasets" in state else [],
    }
    content = _compiled_template(_template_text(template_path)).render(**context)
    return ModelCard(content)


def write_model_card(checkpoint_dir: str | Path, repo_id: str | None = None) -> Path:
    """Write `README.md` (and `results_heatmap.png`, when matplotlib is installed) into a task checkpoint folder.

    Returns the path of the README. See `build_model_card` for the contents and the errors.
    """
    folder = Path(checkpoint_dir)
    state, matrix = _read_checkpoint(folder)
    try:
        from .evaluation.plots import plot_matrix_heatmap

        position = f"after task {int(state['task_index']) + 1} of {len(state['task_names'])}"
        plot_matrix_heatmap(matrix, folder / HEATMAP_FILE, title=f"{state.get('stream') or 'results'}: {position}")
    except ImportError:
        logger.info("matplotlib is not installed: %s not written, the card has no heatmap", HEATMAP_FILE)
    card = build_model_card(folder, repo_id)
    path = folder / CARD_FILE
    card.save(path)
    return path


class ModelCardCallback(TaskCallback):
    """Writes the model card (`README.md`, and the heatmap) into every task checkpoint, from its files."""

    def on_save(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if kwargs["task_folder"]:
            write_model_card(kwargs["folder"], repo_id=args.hub.model_id)
