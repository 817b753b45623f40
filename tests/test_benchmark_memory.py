"""benchmarks/memory.py: the bytes per parameter it expects are the rule of thumb docs/scale.md gives, a run's outcome
names the CLI's one-line error, and `--merge` keeps the runs it does not redo (no training here: the runs themselves
are the benchmark's)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory  # noqa: E402  (benchmarks/ is not a package)

P = 1_000_000


def _docs_table() -> dict[str, int]:
    """docs/scale.md's "bytes per parameter, one process" column, by method."""
    section = (ROOT / "docs" / "scale.md").read_text().split("## Fit a larger model: bytes per parameter")[1]
    return {name: int(value) for name, value in re.findall(r"^\| `(\w+)` \|[^|]*\| (\d+)", section, re.M)}


def test_the_expectation_is_the_documented_rule_of_thumb():
    documented = _docs_table()
    assert set(documented) == set(memory.METHODS)
    for method, per_parameter in documented.items():
        assert memory.expected_bytes(P, method, "one process").total == per_parameter * P
        assert memory.expected_bytes(P, method, "DDP x2").total == (per_parameter + 4) * P  # the gradient buckets
    # FSDP2 over 2 processes: student, gradients, AdamW (and ZSCL's ensemble mean) halved; the other copies whole
    assert [memory.expected_bytes(P, m, "FSDP2 x2").total / P for m in memory.METHODS] == [8, 12, 16, 18]


def test_an_outcome_is_the_cli_error_line():
    stderr = "Traceback ...\nhf-ccl: error: training.fsdp: FSDP1 is refused\nmore\n"
    assert memory.first_error(stderr) == "training.fsdp: FSDP1 is refused"
    assert memory.first_error("a\nKilled\n") == "Killed"


def test_merge_keeps_earlier_runs_and_refuses_other_steps():
    old = {"command": "python benchmarks/memory.py", "steps": 2, "methods": ["ctp"], "sizes": {"vit-b-32": {}},
           "runs": [{"size": "vit-b-32", "method": "ctp", "mode": "DDP x2"}]}
    new = {"command": "python benchmarks/memory.py --merge", "methods": ["finetune"], "sizes": {}, "runs": []}
    args = argparse.Namespace(steps=2, methods=["finetune"], output="memory.md")
    merged = memory.merged(old, dict(new), args)
    assert merged["runs"] == old["runs"] and merged["methods"] == ["finetune", "ctp"]
    assert merged["command"].endswith("then `python benchmarks/memory.py --merge")
    with pytest.raises(SystemExit, match="--steps 2, not 3"):
        memory.merged(old, dict(new), argparse.Namespace(steps=3, methods=[], output="memory.md"))
