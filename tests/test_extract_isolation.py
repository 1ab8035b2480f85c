"""A local extraction starts a Ray of its own, even when another Ray cluster runs on the same machine."""
import json
import os
import signal
import subprocess
import sys

import pytest

from pipeline.store import open_store, verify_store
from tests.tiny import build_target

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]
# A cluster as `ray start --head` or ray.cluster_utils leave it: one a bare ray.init() would auto-join.
OTHER_CLUSTER = ("import time\nfrom ray.cluster_utils import Cluster\n"
                 "cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 1})\n"
                 "print('up', flush=True)\n"
                 "try:\n    time.sleep(300)\nexcept KeyboardInterrupt:\n    cluster.shutdown()\n")


def test_local_extraction_ignores_another_ray_cluster_on_the_machine(tmp_path):
    target = build_target(tmp_path / "target", template="chatml")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"What is {i} plus {i}?"}, {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n"
        for i in range(4)))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    other = subprocess.Popen([sys.executable, "-c", OTHER_CLUSTER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline().strip() == "up"
        result = subprocess.run([*CLI, "extract", "--model", str(target), "--data", str(chats),
                                 "--out", str(tmp_path / "store"), "--dtype", "float32", "--no-progress"],
                                capture_output=True, text=True, env=env, timeout=240)
        assert result.returncode == 0, result.stderr[-2000:]
    finally:
        other.send_signal(signal.SIGINT)
        try:
            other.wait(timeout=30)
        except subprocess.TimeoutExpired:
            other.kill()
    assert len(open_store(str(tmp_path / "store"))) == 4
    assert verify_store(str(tmp_path / "store")).ok
