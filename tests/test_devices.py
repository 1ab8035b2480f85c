"""One device rule and one dtype table: clear one-line refusals instead of CUDA or KeyError tracebacks."""
import pytest
import torch

from beagle.devices import DTYPES, pick_device, torch_dtype


def test_device_choice_refuses_cuda_without_cuda():
    assert pick_device(None) == pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device gpu0: not a device name"):
        pick_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available; use --device cpu"):
            pick_device("cuda:1")


def test_dtype_table():
    assert torch_dtype("bfloat16") is torch.bfloat16 and set(DTYPES) == {"bfloat16", "float16", "float32"}
    with pytest.raises(ValueError, match=r"--dtype fp8: unknown dtype; use one of \['bfloat16'"):
        torch_dtype("fp8")
