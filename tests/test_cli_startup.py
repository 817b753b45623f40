"""`hf-ccl --version`, `list` and `train --help` start without importing torch or transformers (seconds each), and
what `list` reads from the source is what the registries hold. Timings: benchmarks/cli_startup.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_ccl import catalog

HEAVY = ("torch", "transformers", "datasets", "accelerate", "peft")
#: Runs the command as the console script does, then prints which heavy modules it imported.
PROBE = """
import json, runpy, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["hf-ccl", *json.loads(sys.argv[1])]
try:
    runpy.run_module("hf_ccl.cli", run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": [name for name in heavy if name in sys.modules]}))
"""


def probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return {"output": "\n".join(lines[:-1]), **json.loads(lines[-1])}


@pytest.mark.parametrize("args", [("--version",), ("list",), ("train", "--help")], ids=" ".join)
def test_listing_commands_import_no_torch(args):
    result = probe(*args)
    assert result["code"] == 0
    assert result["output"]
    assert result["heavy"] == [], f"`hf-ccl {' '.join(args)}` imported {result['heavy']}"


def test_catalog_reads_what_the_registries_hold():
    from hf_ccl.data import NAMED_STREAMS
    from hf_ccl.families import FAMILIES
    from hf_ccl.methods import available_methods

    # the scans themselves (not their import fallback): a scan that stopped reading would make `list` slow again
    assert catalog._scan_methods() == available_methods()
    assert catalog._scan_streams() == sorted(NAMED_STREAMS)
    assert catalog._scan_families() == list(FAMILIES)
    assert catalog.method_names() == tuple(available_methods())
    assert catalog.family_names() == tuple(FAMILIES)
