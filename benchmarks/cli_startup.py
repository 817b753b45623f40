"""Start-up time of the `hf-ccl` commands that only print: `--version`, `list`, `train --help`.

Each command runs in a fresh process (`python -m hf_ccl.cli ...`), `--runs` times; the table gives the median wall
time and whether the process imported torch. Optionally the same commands from other checkouts (`--baseline`, a
folder holding an older hf_ccl, repeatable) side by side. The machine's load average is recorded: timings on a busy machine
are longer.

    python benchmarks/cli_startup.py [--runs 5] [--baseline /path/to/old/checkout ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cli_startup.md"
COMMANDS = (["--version"], ["list"], ["train", "--help"])
PROBE = ("import runpy, sys\nsys.argv = ['hf-ccl', *sys.argv[1:]]\ntry:\n    runpy.run_module('hf_ccl.cli', "
         "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")


def time_command(checkout: Path, args: list[str], runs: int) -> tuple[float, bool]:
    """Median wall seconds of `args` in a fresh process importing hf_ccl from `checkout`, and whether it imported
    torch."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    times, torch = [], False
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True,
                              check=True, cwd=checkout)
        times.append(time.perf_counter() - start)
        torch = done.stderr.strip().splitlines()[-1] == "True"
    return statistics.median(times), torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", type=Path, action="append", default=[],
                        help="a checkout of an older hf_ccl to time beside this one (repeatable)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    checkouts = {"this checkout": ROOT, **{f"baseline ({folder})": folder for folder in args.baseline}}
    rows = []
    for command in COMMANDS:
        cells = []
        for checkout in checkouts.values():
            seconds, torch = time_command(checkout, command, args.runs)
            cells.append(f"{seconds:.2f} s ({'torch' if torch else 'no torch'})")
        rows.append(f"| `hf-ccl {' '.join(command)}` | " + " | ".join(cells) + " |")
    load_after = os.getloadavg()
    header = "| command | " + " | ".join(checkouts) + " |"
    lines = [
        "# CLI start-up time",
        "",
        f"Median wall time of {args.runs} fresh processes per command (`python -m hf_ccl.cli ...` through runpy, "
        f"OMP_NUM_THREADS=1), and whether the process imported torch. Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs; 1-minute load average {load_before[0]:.2f} before, {load_after[0]:.2f} after. "
        "Written by `python benchmarks/cli_startup.py`.",
        "",
        header,
        "|" + "---|" * (len(checkouts) + 1),
        *rows,
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
