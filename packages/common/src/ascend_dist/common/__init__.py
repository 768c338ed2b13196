"""ascend_dist.common: the substrate every ascend-dist package builds on.

Import the submodule you need (the error types are in `errors`); this package itself imports
nothing, so that `import ascend_dist.common` stays cheap (no torch, no numpy).

Planning (pure): `blocks`, `descriptors`, `regions`, `mappings`, `transfer_mappings`, `ports`, `units`,
`timeouts`, `hashing`.
Wire: `wire` (msgspec codecs, handshake with compatibility hash), `zmq_rpc` / `zmq_server`.
Runtime: `device` (NPU, CUDA or CPU simulation), `states`, `log`, `scenarios`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ascend-dist-common")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]
