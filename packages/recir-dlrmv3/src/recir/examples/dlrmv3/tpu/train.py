"""`python -m recir.examples.dlrmv3.tpu.train FLAGS` is `recir-dlrmv3 train --target tpu FLAGS`: the same
flags and code path; see `--help`."""

import sys

from recir.dlrmv3._cli import train_main

if __name__ == "__main__":
    sys.exit(train_main("tpu"))
