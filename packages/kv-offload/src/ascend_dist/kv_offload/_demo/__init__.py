"""The `offload` demo/bench scenario of KV offload.

Reached only through the `ascend_dist.scenarios` entry point and the `ascend-dist demo`/`bench`
commands (and tests); library modules never import from here.
"""
