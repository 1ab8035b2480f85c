"""A local S3 endpoint for tests: moto's server on 127.0.0.1, its address and fake credentials in the
environment (which Ray's processes inherit, as they would a node's real credentials), one bucket made."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_s3_bucket(bucket: str = "beagle-test") -> Iterator[str]:
    """Yields "s3://<bucket>" served by moto on a free loopback port; restores the environment after."""
    import moto.server
    import s3fs

    port = _free_port()
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # fsspec caches filesystem instances by their arguments, not by the environment: an S3FileSystem made
    # for an earlier test's server (another port) would be handed out again. Clear the cache both ways.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield f"s3://{bucket}"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
