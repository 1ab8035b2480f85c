"""The vLLM environment the engine tests need, and what its absence means: a skip on a developer's machine
without `make serve-venv`, a failure under CI, where `make test` builds it first."""
from __future__ import annotations

import os

import pytest

from pipeline.jobkit.vllm_process import CHECKOUT_VENV


def require_vllm() -> None:
    """Skip (or, under CI, fail) the calling test when the checkout's `.venv-vllm` is missing."""
    if CHECKOUT_VENV.is_file():
        return
    message = f"{CHECKOUT_VENV} missing: run `make serve-venv` (vLLM CPU build in its own venv)"
    if os.environ.get("CI"):
        pytest.fail(message + "; `make test` builds it, so under CI its absence is a failure")
    pytest.skip(message)
