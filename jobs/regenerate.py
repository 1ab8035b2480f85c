"""Ray job entry point for `beagle-pipeline regenerate` on a cluster (self-distillation data).

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/regenerate.py --model /shared/models/target --data /shared/data/sharegpt.jsonl \
            --out /shared/data/target-answers.jsonl

Inside a Ray job the driver runs on the head node with RAY_ADDRESS set, so the command joins that
cluster (never a local Ray). Every flag of `beagle-pipeline regenerate` is accepted; see jobs/README.md.
"""
from __future__ import annotations

import sys

from jobs.cluster import run_joined
from pipeline.regenerate.cli import regenerate


def main(argv: list[str] | None = None) -> None:
    run_joined(regenerate, sys.argv[1:] if argv is None else argv, prog_name="jobs/regenerate.py")


if __name__ == "__main__":
    main()
