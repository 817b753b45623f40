"""The docs' code, run as a reader would run it: every ```python block of README.md and docs/**/*.md, every
`hf-ccl ...` line of a ```bash block, and every ```yaml block (a config).

- Python: each page's blocks run in order in one namespace (a page is a walk-through), in a fresh empty folder of
  its own, all pages in one subprocess (one import of torch; a method a page registers stays out of this process's
  registry). A block written ```` ```python skip ```` is not run (it needs the Hub, say) and is counted.
- Bash: every line that starts with `hf-ccl` is parsed by the CLI's own parser; a `train` line whose `--config` is a
  shipped recipe also has its config and overrides loaded and checked (`hf_ccl.config.load_config`).
- YAML: every block is a complete config and loads with `hf_ccl.config.load_config`: a refusal fails the test.

The snippets are written to run in seconds (tiny models, `max_train_per_task=64`, one epoch).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import traceback
import types
from pathlib import Path

import pytest

from hf_ccl.cli import _parser
from hf_ccl.config import available_recipes, load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   flags=re.S | re.M)


def code_blocks(path: Path, language: str) -> list[tuple[int, str, str]]:
    """The ```<language> blocks of a Markdown file: (line of the fence, code, the rest of the info string)."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        if match["lang"] != language:
            continue
        line = text.count("\n", 0, match.start()) + 1
        body = textwrap.dedent(match["body"]) if match["indent"] else match["body"]
        blocks.append((line, body, match["info"]))
    return blocks


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(language: str) -> list[tuple[str, int, str, bool]]:
    """(page, line, code, marked `skip`) of every ```<language> block."""
    return [(_name(path), line, code, info.split()[:1] == ["skip"])
            for path in PAGES for line, code, info in code_blocks(path, language)]


def _files() -> list[tuple[str, int, str, str]]:
    """(page, line, code, file name) of every block titled with a file name: ```yaml title="my-run.yaml"."""
    found = []
    for path in PAGES:
        for line, code, info in code_blocks(path, "yaml"):
            title = re.search(r'title="([\w.-]+)"', info)
            if title:
                found.append((_name(path), line, code, title[1]))
    return found


PYTHON = _blocks("python")
BASH_LINES = [(page, line, command) for page, line, code, skip in _blocks("bash") if not skip
              for command in re.sub(r"\\\n", " ", code).splitlines() if command.strip().startswith("hf-ccl")]
YAML = [block for block in _blocks("yaml") if not block[3]]
FILES = _files()


def run_pages(pages: dict[str, list[tuple[int, str, str | None]]], workdir: Path) -> dict[str, list[dict]]:
    """Run each page's blocks in order in one namespace, in `workdir/<n>/`; a failed block ends its page. A block
    with a file name (a ```` ```yaml title="my-run.yaml" ```` block) is written to that file instead, as a reader
    would save it. Returns {page: [{"line", "ok", "error"}]} for the Python blocks that ran."""
    results: dict[str, list[dict]] = {}
    for index, (page, blocks) in enumerate(pages.items()):
        folder = workdir / str(index)
        folder.mkdir(parents=True)
        os.chdir(folder)
        module = types.ModuleType(f"docs_page_{index}")  # a module of its own: dataclasses look their class up there
        sys.modules[module.__name__] = module
        namespace = module.__dict__
        results[page] = []
        for line, code, file_name in blocks:
            if file_name:
                Path(file_name).write_text(code, encoding="utf-8")
                continue
            started = time.perf_counter()
            try:
                exec(compile(code, f"{page}:{line}", "exec"), namespace)  # noqa: S102 - the docs' own code
            except BaseException:  # a snippet that exits or raises anything is broken
                results[page].append({"line": line, "ok": False, "error": traceback.format_exc(limit=-3)})
                break
            results[page].append({"line": line, "ok": True, "error": "", "seconds": time.perf_counter() - started})
    return results


#: A page that must fail: proves a broken block is reported (and that the blocks after it do not run).
BROKEN = "<broken>"


@pytest.fixture(scope="module")
def python_results(tmp_path_factory):
    """Every page's Python blocks, run once in one subprocess (see the module docstring)."""
    pages: dict[str, list[tuple[int, str, str | None]]] = {}
    for page, line, code, skip in PYTHON:
        if not skip:
            pages.setdefault(page, []).append((line, code, None))
    for page, line, code, file_name in FILES:
        pages.setdefault(page, []).append((line, code, file_name))
    pages = {page: sorted(blocks) for page, blocks in pages.items()}
    pages[BROKEN] = [(1, "x = 1", None), (2, "x.no_such_attribute", None), (3, "raise SystemExit('never runs')", None)]
    workdir = tmp_path_factory.mktemp("docs")
    (workdir / "pages.json").write_text(json.dumps(pages), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(workdir)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((workdir / "results.json").read_text(encoding="utf-8"))


def test_a_broken_block_fails(python_results):
    broken = python_results[BROKEN]
    assert [result["ok"] for result in broken] == [True, False]
    assert "AttributeError" in broken[1]["error"] and "<broken>:2" in broken[1]["error"]


@pytest.mark.parametrize(("page", "line", "code", "skip"), PYTHON, ids=[f"{p}:{n}" for p, n, _, _ in PYTHON])
def test_python_block_runs(python_results, page, line, code, skip):
    if skip:
        pytest.skip("marked `python skip`")
    ran = {result["line"]: result for result in python_results[page]}
    assert line in ran, f"{page}:{line} did not run: an earlier block of the page failed"
    assert ran[line]["ok"], f"{page}:{line} failed:\n{ran[line]['error']}"


def test_blocks_found():
    """The extraction sees the docs (a renamed folder or fence style would otherwise pass vacuously)."""
    assert len([block for block in PYTHON if not block[3]]) >= 10
    assert len(BASH_LINES) >= 10 and len(YAML) >= 4
    skipped = [f"{page}:{line}" for page, line, _, skip in PYTHON if skip]
    assert len(skipped) <= 8, f"too many Python blocks are not run: {skipped}"


def test_readme_links_resolve():
    """The README is read on GitHub, not built by mkdocs: its relative links must name files that exist (the site's
    own links are checked by `mkdocs build --strict`), and its two commands stay first."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
    first_block = code_blocks(ROOT / "README.md", "bash")[0][1].splitlines()
    assert first_block[0].startswith("make run") and first_block[2].startswith("make test")


@pytest.mark.parametrize(("page", "line", "command"), BASH_LINES, ids=[f"{p}:{n}" for p, n, _ in BASH_LINES])
def test_cli_line_parses(page, line, command):
    argv = shlex.split(command, comments=True)[1:]
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # --help and --version exit 0; a parse error exits 2
        assert stop.code == 0, f"{page}:{line}: `{command}` is refused by the CLI's parser"
        return
    if args.command == "train" and args.config in available_recipes():
        load_config(args.config, args.overrides)


@pytest.mark.parametrize(("page", "line", "code", "skip"), YAML, ids=[f"{p}:{n}" for p, n, _, _ in YAML])
def test_yaml_block_is_a_config(tmp_path, page, line, code, skip):
    path = tmp_path / "config.yaml"
    path.write_text(code, encoding="utf-8")
    load_config(path)


if __name__ == "__main__":  # the subprocess of `python_results`
    workdir = Path(sys.argv[1])
    pages = json.loads((workdir / "pages.json").read_text(encoding="utf-8"))
    results = run_pages(pages, workdir / "pages")
    (workdir / "results.json").write_text(json.dumps(results), encoding="utf-8")
