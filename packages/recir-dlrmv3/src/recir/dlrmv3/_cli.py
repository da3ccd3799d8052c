"""The `recir-dlrmv3` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    del argv
    print(
        "recir-dlrmv3: the DLRMv3 application is not built yet (issue 7: 'DLRMv3 on RecIR').\n"
        "The workspace, IR and lowering packages are usable from Python; see the README.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
