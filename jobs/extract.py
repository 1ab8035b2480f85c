"""Ray job entry point for `beagle-pipeline extract` on a cluster.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/extract.py --model /shared/models/target --data /shared/data/sharegpt.jsonl \
            --out /shared/stores/target-sharegpt

Inside a Ray job the driver runs on the head node with RAY_ADDRESS set, so the command joins that
cluster (never a local Ray). Every flag of `beagle-pipeline extract` is accepted; see jobs/README.md.
"""
from __future__ import annotations

import sys

from jobs.cluster import run_joined
from pipeline.extract.cli import extract


def main(argv: list[str] | None = None) -> None:
    run_joined(extract, sys.argv[1:] if argv is None else argv, prog_name="jobs/extract.py")


if __name__ == "__main__":
    main()
