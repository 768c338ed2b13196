"""Demo and benchmark code for the ``pd``, ``pd-hybrid``, ``pd-layerwise`` and ``pd-sfa`` scenarios.

Synthetic models over the real transports, peer processes and the scenario factories named by the
``ascend_dist.scenarios`` entry points. Library modules never import this package (a test checks).
"""

__all__: list[str] = []
