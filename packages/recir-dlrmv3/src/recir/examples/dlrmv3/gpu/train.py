"""`python -m recir.examples.dlrmv3.gpu.train FLAGS` is `recir-dlrmv3 train --target gpu FLAGS`: the same
flags and code path; see `--help`."""

import sys

from recir.dlrmv3._cli import train_main

if __name__ == "__main__":
    sys.exit(train_main("gpu"))
