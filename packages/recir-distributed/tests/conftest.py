"""Makes this folder's helper modules (``_distributed_models``, ``_distributed_workers``) importable."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
