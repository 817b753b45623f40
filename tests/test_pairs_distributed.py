"""Modality-pair streams on two processes (gloo, CPU): the ranks agree, and DNS's covariances are those of the data."""

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_ccl.pairs.encoders import PrecomputedEncoder
from hf_ccl.pairs.learner import PairStreamArguments, PairStreamLearner

SCRIPT = Path(__file__).parent / "scripts" / "pairs_two_process.py"
sys.path.insert(0, str(SCRIPT.parent))
from pairs_two_process import DIM, toy_stream  # noqa: E402
from test_distributed import launch_two_processes  # noqa: E402


@pytest.mark.multiprocess
def test_pair_methods_on_two_processes(tmp_path):
    launch_two_processes(SCRIPT, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["world_size"] == 2
    for method in ("dns", "gem"):
        assert reports[0][method] == reports[1][method], f"{method}: ranks disagree"

    # The 2-process checkpoint resumes in one process with the same heads and DNS state, and DNS's input
    # covariances are the running means of the cached features (Alg. 1 l.16-18) whatever the process count.
    encoders = {m: PrecomputedEncoder(DIM, normalize=True) for m in ("image", "en", "de")}
    args = PairStreamArguments(output_dir=str(tmp_path / "dns"), batch_size=8, epochs=2, learning_rate=1e-2)
    learner = PairStreamLearner(toy_stream(), encoders, args, methods="dns")
    learner.run()  # every task is in a checkpoint: nothing left to train
    for name, value in learner.heads.state_dict().items():
        assert torch.allclose(value, torch.tensor(reports[0]["dns"]["heads"][name]))
    dns = learner.methods[0]
    image = torch.cat([learner.features[0].train_a, learner.features[2].train_a]).double()
    assert torch.allclose(dns.covariances["image"]["in"], image.T @ image / len(image))
    for modality, sides in reports[0]["dns"]["state"]["covariances"].items():
        for side, stats in sides.items():
            assert float(dns.covariances[modality][side].sum()) == pytest.approx(stats["sum"], abs=1e-9)
