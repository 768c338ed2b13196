"""The helper modules next to the tests (rank_procs) are plain modules: --import-mode=importlib does not
put this folder on sys.path, so it is added here."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
