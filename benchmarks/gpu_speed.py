"""The GPU method-speed table in one command: images per second of every method at ViT-B/16 (or `--size`) with bf16,
`torch.compile` and gradient accumulation, ratios to `finetune` beside their limits, peak CUDA memory.

    python benchmarks/gpu_speed.py [--size vit-b-16] [--batch 128] [--accumulation 2] [--steps 10] [--rounds 2]

Runs `benchmarks/method_speed.py` with those settings and writes benchmarks/results/method_speed_gpu.md, the device
named in it. Refuses to run without a CUDA device (the CPU table is `method_speed.py`'s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import method_speed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="vit-b-16", choices=sorted(method_speed.SIZES))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "method_speed_gpu.md"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_speed.py: error: needs a CUDA GPU: torch.cuda.is_available() is False; on a CPU run "
              "benchmarks/method_speed.py", file=sys.stderr)
        sys.exit(2)
    sys.argv = [
        "method_speed.py", "--size", args.size, "--batch", str(args.batch), "--accumulation", str(args.accumulation),
        "--steps", str(args.steps), "--rounds", str(args.rounds), "--bf16", "--epochs", "3", "--output", args.output,
        *([] if args.no_compile else ["--compile"]),
    ]
    method_speed.main()


if __name__ == "__main__":
    main()
