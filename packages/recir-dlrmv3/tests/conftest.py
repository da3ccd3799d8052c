"""Makes this folder's helper module (``_dlrmv3_workers``) importable, also in spawned processes."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
