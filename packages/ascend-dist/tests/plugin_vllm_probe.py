"""Run in a fresh process of the vLLM venv: load vLLM's general plugins as vLLM does, report registries.

`python plugin_vllm_probe.py [--preregister NAME]` prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import sys

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    capture = Capture()
    logging.getLogger("ascend_dist").addHandler(capture)
    logging.getLogger("ascend_dist").setLevel(logging.DEBUG)
    if "--preregister" in sys.argv:
        name = sys.argv[sys.argv.index("--preregister") + 1]
        KVConnectorFactory.register_connector(name, "someone.else", "TheirConnector")
    load_general_plugins()
    load_general_plugins()
    from ascend_dist.plugin import register, registered_names

    register()
    registry = KVConnectorFactory._registry  # reading, never editing, vLLM's registry
    print(json.dumps({"ours": sorted(registered_names()), "in_vllm": sorted(registry), "logs": capture.messages}))


if __name__ == "__main__":
    main()
