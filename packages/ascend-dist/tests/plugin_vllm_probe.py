"""Run in a fresh process of the vLLM venv: load vLLM's general plugins as vLLM does, report registries.

`python plugin_vllm_probe.py [--preregister NAME]` prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import sys

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
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
    # Reading, never editing, vLLM's registries.
    seen = {
        "ours": sorted(registered_names()),
        "in_vllm": sorted(KVConnectorFactory._registry),
        "weight_engines": sorted(WeightTransferEngineFactory._registry),
        "trainer_engines": sorted(WeightTransferTrainerFactory._registry),
        "logs": capture.messages,
    }
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
