"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU) by tests/test_pairs_distributed.py.

A 3-task modality-pair stream (precomputed features) with DNS and with GEM, on 2 processes: writes the heads and the
method state each rank ends with into `rank<r>.json` in the folder given as the first argument; the DNS run's
checkpoints go to `<folder>/dns/`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset

from hf_ccl.distributed import rank, world_size
from hf_ccl.pairs.encoders import PrecomputedEncoder
from hf_ccl.pairs.learner import PairStreamArguments, PairStreamLearner
from hf_ccl.pairs.task import PairStream, PairTask

DIM = 8


def toy_stream() -> PairStream:
    generator = torch.Generator().manual_seed(0)
    tasks = []
    for index, (a, b) in enumerate([("image", "en"), ("en", "de"), ("image", "de")]):
        base = torch.randn(64, DIM, generator=generator)
        rows = {a: base.tolist(), b: (base + 0.3 * torch.randn(64, DIM, generator=generator)).tolist()}
        tasks.append(PairTask(f"t{index}-{a}-{b}", a, b, Dataset.from_dict(rows), Dataset.from_dict(rows)))
    return PairStream(tasks)


def flat(state) -> dict:
    if isinstance(state, torch.Tensor):
        return {"sum": float(state.double().sum()), "abs": float(state.double().abs().sum())}
    if isinstance(state, dict):
        return {k: flat(v) for k, v in state.items()}
    if isinstance(state, list):
        return [flat(v) for v in state]
    return state


def main() -> None:
    folder = Path(sys.argv[1])
    PartialState()
    encoders = {m: PrecomputedEncoder(DIM, normalize=True) for m in ("image", "en", "de")}
    report = {"world_size": world_size()}
    for method in ("dns", "gem"):
        args = PairStreamArguments(
            output_dir=str(folder / method), batch_size=8, epochs=2, learning_rate=1e-2
        )
        options = {"gem": {"memory_per_task": 16}} if method == "gem" else None
        learner = PairStreamLearner(toy_stream(), encoders, args, methods=method, method_args=options)
        learner.run()
        report[method] = {
            "heads": {k: v.tolist() for k, v in learner.heads.state_dict().items()},
            "state": flat(learner.methods[0].state_dict()),
            "snapshots": {str(k): flat(v) for k, v in learner.snapshots.items()},
        }
    (folder / f"rank{rank()}.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    main()
