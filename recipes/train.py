"""Train a CLIP on a stream of tasks and print the results matrix.

    python recipes/train.py --config recipes/configs/digits.yaml [key=value ...]
    accelerate launch recipes/train.py --config recipes/configs/digits.yaml training.learning_rate=1e-3
"""

import argparse
import sys

from hf_ccl.cli import train_main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config; default: the built-in defaults (digits, finetune)")
    parser.add_argument("overrides", nargs="*", help="overrides key=value, e.g. methods=[joint] seed=1")
    args = parser.parse_args()
    sys.exit(train_main(args.config, args.overrides))
