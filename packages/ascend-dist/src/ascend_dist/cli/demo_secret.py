"""`ascend-dist demo` runs with peer authentication on: a fresh key file in a private temp folder.

Runs in: the `ascend-dist` command's process, around the scenarios. The scenarios' child processes
(P, D, pool workers, real engines) inherit ``ASCEND_DIST_SECRET_FILE`` and so share the key; a
secret the operator already configured is used as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ascend_dist.common.secret import SECRET_ENV, SECRET_FILE_ENV, write_secret_file

__all__ = ["demo_secret"]


@contextmanager
def demo_secret() -> Iterator[str]:
    """Set ``ASCEND_DIST_SECRET_FILE`` to a new key for the block (unless a secret is set); yields its source."""
    if os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV):
        yield "the configured deployment secret"
        return
    folder = Path(tempfile.mkdtemp(prefix="ascend-dist-demo-key-"))  # mode 0700: only we can enter it
    path = folder / "secret"
    try:
        write_secret_file(path)
        os.environ[SECRET_FILE_ENV] = str(path)
        yield f"a fresh key in {path}"
    finally:
        os.environ.pop(SECRET_FILE_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)
