"""The `weights` demo/bench scenario: a toy model, its worker processes and the raw baselines.

Reached only through the `ascend_dist.scenarios` entry point and the `ascend-dist demo`/`bench`
commands (and tests); library modules never import from here.
"""
