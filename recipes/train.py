"""Train a CLIP on a stream of tasks and print the results matrix: `hf-ccl train` as a script, for
`accelerate launch`. `--config` takes a shipped recipe by name or a YAML file.

    python recipes/train.py --config digits [key=value ...]
    python recipes/train.py --config recipes/configs/digits.yaml [key=value ...]
    accelerate launch recipes/train.py --config digits training.learning_rate=1e-3
"""

import sys

from hf_ccl.cli import main, process_start_time

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]], started_at=process_start_time()))
