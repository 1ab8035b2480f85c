"""Extraction on a two-node Ray cluster writing to S3 (moto's S3 server on 127.0.0.1), then `info`,
`verify` and training straight from the bucket through a local cache.

Each node has one CPU and each forward actor needs one, so two actors means one per node; the run
records which node committed each shard.
"""
import json

import pytest
from click.testing import CliRunner

from pipeline.extract.pipeline import ExtractConfig, run_extract
from pipeline.store import open_store, verify_store
from pipeline.commands.store import info
from tests.local_s3 import local_s3_bucket
from tests.tiny import build_target

pytestmark = pytest.mark.slow
moto_server = pytest.importorskip("moto.server", reason="moto[server] and s3fs (dev extras) test the S3 path")
pytest.importorskip("s3fs")

CHATS = [{"id": f"c{i}", "conversations": [
    {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
    {"from": "gpt", "value": f"The answer is {2 * i}." + " Indeed." * (i % 4)}]} for i in range(8)]


@pytest.fixture(scope="module")
def s3_bucket():
    with local_s3_bucket() as bucket:
        yield bucket


@pytest.fixture(scope="module")
def two_nodes(s3_bucket):  # after the S3 environment is set: Ray processes inherit it
    import ray
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20,
                                                             "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def s3_store(two_nodes, s3_bucket, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    target = build_target(root / "target", template="chatml")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    url = f"{s3_bucket}/stores/tiny"
    config = ExtractConfig(model_path=str(target), data=(str(chats),), out=url, dtype="float32", max_length=64,
                           samples_per_shard=2, batch_tokens=128, tokenize_chunk=4, num_workers=2, threads=1,
                           address=two_nodes.address)
    return url, run_extract(config)


def test_two_nodes_write_shards_to_s3(s3_store):
    url, summary = s3_store
    assert summary.samples == 8 and summary.shards == 4
    assert summary.actors == 2 and summary.nodes == 2  # one CPU per node: one actor per node, both committed
    assert "on 2 node(s)" in "\n".join(summary.lines())

    store = open_store(url)
    assert len(store) == 8 and len(store.manifest["shards"]) == 4
    assert [store[i]["sample_id"] for i in range(8)] == [f"c{i}" for i in range(8)]
    assert store.manifest["counts"]["samples"] == 8
    assert verify_store(url).ok
    result = CliRunner().invoke(info, [url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["num_samples"] == 8


def test_training_from_s3_through_a_local_cache(s3_store, tmp_path):
    """Train straight from the bucket through a local cache (no copy of the store first)."""
    from beagle.trainer import train
    from beagle.train_config import TrainConfig
    url, _ = s3_store
    cache = tmp_path / "cache"
    result = train([url], tmp_path / "run", TrainConfig(max_steps=2, batch_tokens=128, window_size=2,
                                                          simulation_steps=1, device="cpu"),
                   cache_dir=str(cache))
    assert result.steps == 2
    assert any(p.is_file() for p in cache.rglob("*"))


def test_two_jobs_into_one_s3_store_the_second_is_refused_and_deletes_nothing(s3_bucket, tmp_path):
    """Object stores have no flock: the first job's lock object (a conditional write, with a lease) makes
    a second extraction into the same URL stop at once, before any Ray work, and leaves the first job's
    shards alone. A lock whose lease has run out (a dead job) is taken over."""
    import time

    import s3fs
    import torch

    from pipeline.extract.state_encoding import write_shard
    from pipeline.store import StoreConflictError
    from pipeline.store.writer import store_lock, write_store
    from tests.test_store import build, make_samples

    target = build_target(tmp_path / "target", template="chatml")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    url = f"{s3_bucket}/stores/contended"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    samples = make_samples(2, torch.float32)
    with store_lock(url):  # the first job, mid-way: it holds the store and has committed a shard
        write_shard(url, 0, samples, layers=[-1], dtype="float32")
        assert fs.exists(f"{url}/_lock.json")
        config = ExtractConfig(model_path=str(target), data=(str(chats),), out=url, dtype="float32", max_length=64,
                               overwrite=True)
        with pytest.raises(StoreConflictError, match=r"being written by another job .*_lock\.json"):
            run_extract(config)
        assert fs.exists(f"{url}/shards/shard-00000/shard.json")  # nothing of the first job was deleted
    assert not fs.exists(f"{url}/_lock.json")  # released at the end

    dead = {"owner": "crashed-host:1:abc", "expires": time.time() - 1}
    fs.pipe_file(f"{url}-2/_lock.json", json.dumps(dead).encode())
    build(f"{url}-2", make_samples(3, torch.float32), "float32")  # takes the expired lock over
    assert open_store(f"{url}-2").manifest["counts"]["samples"] == 3 and not fs.exists(f"{url}-2/_lock.json")
    live = {"owner": "busy-host:2:def", "expires": time.time() + 600}
    fs.pipe_file(f"{url}-3/_lock.json", json.dumps(live).encode())
    with pytest.raises(StoreConflictError, match="busy-host"):
        write_store(f"{url}-3", [], head=b"", target={}, tokenizer={}, capture={"layers": [-1], "dtype": "float32"},
                    source={})
