"""The `eplb` demo/bench scenario, its rank worker and the forked-rank launcher.

Reached only through the `ascend_dist.scenarios` entry point and the `ascend-dist demo`/`bench`
commands (and tests); library modules never import from here.
"""
