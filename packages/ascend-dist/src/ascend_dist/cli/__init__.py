"""The `ascend-dist` command: `doctor`, `demo` and `bench`."""

from ascend_dist.cli.main import main

__all__ = ["main"]
