"""The `--engine` options `regenerate` and `extract` share: which engine runs the target, and how vLLM runs.

Both commands take the same vLLM settings (pipeline/jobkit/vllm_process.py `VllmConfig`), said once here;
each command says what `--engine` means for it.
"""
from __future__ import annotations

from typing import Any, Callable

import click

from pipeline.commands.options import default_option
from pipeline.jobkit.vllm_process import ENGINES, EXECUTORS, VllmConfig

VLLM_OPTION_NAMES = ("tensor_parallel_size", "pipeline_parallel_size", "vllm_executor", "vllm_python",
                     "gpu_memory_utilization")


def engine_options(config_class: type, *, engine_help: str) -> Callable:
    """--engine (its default from `config_class.engine`) and the vLLM options, on a click command."""
    options = [
        default_option(config_class, "engine", "--engine", type=click.Choice(ENGINES), help=engine_help),
        default_option(VllmConfig, "tensor_parallel_size", "--tensor-parallel-size", type=click.IntRange(min=1),
                       help="--engine vllm: GPUs one engine splits each layer over."),
        default_option(VllmConfig, "pipeline_parallel_size", "--pipeline-parallel-size", type=click.IntRange(min=1),
                       help="--engine vllm: stages one engine splits the layers into (may span nodes with Ray)."),
        click.option("--vllm-executor", "vllm_executor", type=click.Choice(EXECUTORS), default=None,
                     help="--engine vllm: vLLM's distributed executor. Default: ray when joining a cluster "
                          "(--address) with tp x pp > 1, else vLLM's choice."),
        click.option("--vllm-python", default=None, type=click.Path(),
                     help="--engine vllm: the interpreter of the vLLM environment. Default: $BEAGLE_VLLM_PYTHON, "
                          "else this one if it has vllm, else .venv-vllm/bin/python (make serve-venv)."),
        click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
                     help="--engine vllm: share of device memory vLLM may take. Default: vLLM's on a GPU, 0.3 on "
                          "a CPU."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def vllm_config(values: dict[str, Any]) -> VllmConfig:
    """The VllmConfig of a command's keyword arguments (the options `engine_options` added), removed from them."""
    given = {name: values.pop(name) for name in VLLM_OPTION_NAMES}
    return VllmConfig(python=given["vllm_python"], tensor_parallel_size=given["tensor_parallel_size"],
                      pipeline_parallel_size=given["pipeline_parallel_size"], executor=given["vllm_executor"],
                      gpu_memory_utilization=given["gpu_memory_utilization"])
