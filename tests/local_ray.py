"""A local Ray for a test module, shared by the extraction tests."""
import contextlib
import logging


@contextlib.contextmanager
def local_ray(num_cpus: int):
    """A Ray for one test module (start-up costs ~3 s and ~1 GiB); yields its GCS address.

    Reuses a Ray this process already started and leaves it running."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        if started:
            ray.shutdown()
