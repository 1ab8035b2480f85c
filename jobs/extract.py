"""Ray job entry point for `beagle-pipeline extract` on a cluster.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/extract.py --model /shared/models/target --data /shared/data/sharegpt.jsonl \
            --out /shared/stores/target-sharegpt

Inside a Ray job the driver runs on the head node with RAY_ADDRESS set, so the command joins that
cluster (never a local Ray). Every flag of `beagle-pipeline extract` is accepted; see jobs/README.md.
"""
from __future__ import annotations

import logging
import sys

from pipeline.extract.cli import extract


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--address" not in args:
        args += ["--address", "auto"]
    logging.basicConfig(level=logging.INFO if "-v" in args else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    args = [a for a in args if a != "-v"]
    extract.main(args=args, prog_name="jobs/extract.py")


if __name__ == "__main__":
    main()
