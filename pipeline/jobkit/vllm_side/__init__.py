"""Code that runs inside the vLLM environment, never imported by this project: the worker process that
`regenerate --engine vllm` and `extract --engine vllm` start under the vLLM venv's interpreter, and the KV
connector vLLM loads (by module name) to hand out hidden states. Its modules import only the standard
library, torch, safetensors and vLLM; the folder goes on the worker's PYTHONPATH alone, so nothing else of
this project shadows a module of the vLLM environment."""
