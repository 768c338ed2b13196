"""The `hccl` benchmark scenario and the rank process it starts.

Reached only through the `ascend_dist.scenarios` entry point and the `ascend-dist demo`/`bench`
commands (and tests); library modules never import from here.
"""
