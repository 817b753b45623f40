"""MkDocs hook: the pages generated from the code, so they cannot drift from it.

- `reference/methods.md`: every registered method (`hf_ccl.methods.METHODS`) with its description, what it declares
  (roles, conflicts, order rules, pair tasks, compute budget) and every option of its config dataclass (type,
  default, help from the field's metadata), and the model families it runs on;
- `reference/support.md`: the method x model family table, from each family's `unsupported_methods`
  (`hf_ccl.families.check_family_methods` refuses exactly those) and each method's `trains_pair_tasks`;
- `results/*.md` and `results/*.png`: the benchmark results of `benchmarks/results/`, so the pages link to them
  inside the site (`results/index.md` lists them).

A code block written ```` ```python skip ```` (or `yaml skip`) is one that `tests/test_docs.py` does not run; the
marker is removed before the page is rendered.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

#: The method family each shipped method is documented under (docs/methods/<page>.md). A method missing here (a
#: new method file) is still generated, under "other".
METHOD_FAMILIES: dict[str, tuple[str, str]] = {}
for _page, _title, _names in (
    ("baselines", "Baselines", "finetune joint sequential"),
    ("distillation", "Distillation", "modx ctp lwf zscl c_clip"),
    ("regularisation", "Regularisation", "ewc si mas"),
    ("replay", "Replay", "er der derpp"),
    ("projection", "Gradient projection", "gem agem dns"),
    ("tic", "TiC-CLIP data strategies", "cumulative_all cumulative_exp cumulative_equal restart oracle patching"),
    ("parameter-efficient", "Parameter-efficient", "lora prompt moe_adapters diki"),
    ("weight-space", "Weight-space ensembles", "wise_ft weight_ensemble magmax condu"),
    ("language", "New languages", "grow_vocab cllclip teir"),
    ("pairs", "Modality pairs", "learner_heads"),
):
    for _name in _names.split():
        METHOD_FAMILIES[_name] = (_page, _title)

SKIP_MARKER = re.compile(r"^(\s*```\w+) skip\b.*$", flags=re.M)


def _registry() -> tuple[dict[str, Any], dict[str, Any]]:
    sys.path.insert(0, str(ROOT))  # the checkout's hf_ccl, as the tests import it
    from hf_ccl.families import FAMILIES
    from hf_ccl.methods import METHODS

    return dict(sorted(METHODS.items())), FAMILIES


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _default(item: dataclasses.Field) -> str:
    if item.default is not dataclasses.MISSING:
        return f"`{item.default!r}`"
    if item.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{item.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def _type(item: dataclasses.Field) -> str:
    text = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", repr(item.type))
    return f"`{text}`"


def _description(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return re.sub(r"\s*\n\s*", " ", doc) or "(no description)"


def _family_support(name: str, families: dict[str, Any]) -> dict[str, str | None]:
    """family -> None when the method runs on it, else the reason it is refused."""
    return {family: cls.unsupported_methods.get(name) for family, cls in families.items()}


def methods_page(methods: dict[str, Any], families: dict[str, Any]) -> str:
    lines = [
        "# Every method's options",
        "",
        "Generated from the registry (`hf_ccl.methods.METHODS`) when the site is built: each method's description,",
        "what it declares, and every field of its config dataclass. Options go under `method_args.<method>` in a",
        "config, or `build_methods([...], {method: {option: value}})` in Python; each value is checked against the",
        "type below, then by the config's own range checks. The [support table](support.md) has every method x model",
        "family at once.",
        "",
    ]
    for name, cls in methods.items():
        page, title = METHOD_FAMILIES.get(name, (None, "other"))
        family_link = f"[{title}](../methods/{page}.md)" if page else title
        lines += [f"## `{name}` {{#{name}}}", "", _description(cls), "", f"- **Method family**: {family_link}",
                  f"- **Class**: `{cls.__module__}.{cls.__qualname__}`; config `{cls.config_class.__qualname__}`"]
        for label, declared in (("Roles", cls.roles), ("Cannot run with", cls.conflicts),
                                ("Runs after", cls.runs_after), ("Runs before", cls.runs_before)):
            if declared:
                lines.append(f"- **{label}**: " + "; ".join(f"`{role}` ({why})" for role, why in declared.items()))
        flags = [text for flag, text in (
            (cls.trains_pair_tasks, "trains modality-pair tasks (CMCL)"),
            (cls.needs_compute_budget, "needs a compute budget (`samples_per_task`)"),
            (cls.trains_on_past_tasks, "trains on earlier tasks' rows"),
            (cls.replaces_contrastive_loss, "its terms replace the contrastive loss"),
            (cls.checkpoint_loader is not None, "the evaluated model needs its own loader (see the model card)"),
        ) if flag]
        if flags:
            lines.append("- **Declares**: " + "; ".join(flags))
        support = _family_support(name, families)
        refused = {family: why for family, why in support.items() if why}
        runs_on = ", ".join(f"`{family}`" for family, why in support.items() if not why)
        lines.append(f"- **Model families**: {runs_on}" + "".join(
            f"; not `{family}`: {why}" for family, why in refused.items()))
        fields = [item for item in dataclasses.fields(cls.config_class) if item.init]
        lines.append("")
        if not fields:
            lines += ["No options.", ""]
            continue
        lines += ["| option | type | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{item.name}` | {_cell(_type(item))} | {_cell(_default(item))} | "
                  f"{_cell(item.metadata.get('help', ''))} |" for item in fields]
        lines.append("")
    return "\n".join(lines)


def support_page(methods: dict[str, Any], families: dict[str, Any]) -> str:
    lines = [
        "# Methods x model families",
        "",
        "Generated from the code when the site is built: a method is refused on a family where the family's class",
        "lists it in `unsupported_methods` (what `hf_ccl.families.check_family_methods` checks before anything is",
        "built: `hf-ccl train` exits 2 naming the reason), and on a modality-pair stream (CMCL) unless it declares",
        "`trains_pair_tasks`. ✓ runs, ✗ refused (the reasons are below the table).",
        "",
        "| method | method family | " + " | ".join(f"`{family}`" for family in families) + " | pair streams |",
        "|---|---|" + "---|" * len(families) + "---|",
    ]
    reasons: dict[str, str] = {}
    for name, cls in methods.items():
        page, title = METHOD_FAMILIES.get(name, (None, "other"))
        cells = []
        for family, why in _family_support(name, families).items():
            cells.append("✗" if why else "✓")
            if why:
                reasons[f"`{name}` on `{family}`"] = why
        family_link = f"[{title}](../methods/{page}.md)" if page else title
        lines.append(f"| [`{name}`](methods.md#{name}) | {family_link} | " + " | ".join(cells)
                     + f" | {'✓' if cls.trains_pair_tasks else '✗'} |")
    lines += ["", "Why a method is refused:", ""]
    lines += [f"- {where}: {why}" for where, why in reasons.items()]
    lines += ["", "Model families: " + ", ".join(
        f"`{family}` (`{cls.__name__}`, saved as `{cls.plain_architecture}`)" for family, cls in families.items())
        + ". See [Models and families](../models.md).", ""]
    return "\n".join(lines)


def results_index(names: list[str]) -> str:
    lines = ["# Benchmark results", "",
             "The result files of `benchmarks/results/`, as the benchmark scripts wrote them (each page starts with "
             "the command that produced it). [Benchmarks](../benchmarks.md) says what each script measures; "
             "[Sizing](../sizing.md) summarises time and memory.", ""]
    lines += [f"- [{name}]({name}.md)" for name in names]
    return "\n".join(lines) + "\n"


def on_files(files: Files, config: Any) -> Files:
    methods, families = _registry()
    files.append(File.generated(config, "reference/methods.md", content=methods_page(methods, families)))
    files.append(File.generated(config, "reference/support.md", content=support_page(methods, families)))
    names = sorted(path.stem for path in RESULTS.glob("*.md"))
    for name in names:
        files.append(File.generated(config, f"results/{name}.md", abs_src_path=str(RESULTS / f"{name}.md")))
    for path in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    files.append(File.generated(config, "results/index.md", content=results_index(names)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Drop the `skip` marker of code blocks the docs test does not run (superfences reads it as no fence); in the
    benchmark results, escape matrix cells such as `R[1][0]`, which would read as reference links."""
    markdown = SKIP_MARKER.sub(r"\1", markdown)
    if page.file.src_uri.startswith("results/"):
        markdown = re.sub(r"\]\[(\d+)\]", r"]\\[\1]", markdown)
    return markdown
