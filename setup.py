"""beagle-pipeline: train Beagle speculative-decoding drafters from stored LLM features."""
import runpy

from setuptools import find_packages, setup

setup(
    name="beagle-pipeline",
    version="0.1.0",
    description="Extract target-LLM hidden states into a feature store, train a Beagle drafter, evaluate it.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # tomllib for --config TOML files
    packages=find_packages(include=["pipeline", "pipeline.*", "beagle", "beagle.*", "jobs", "jobs.*"]),
    # The floors are said once, in pipeline/dependency_floors.py, which every command entry point also checks.
    # torch is a runtime requirement as a range; the dev/CI path pins the CPU build (see Makefile).
    install_requires=runpy.run_path("pipeline/dependency_floors.py")["requirements"](),
    extras_require={
        # moto's S3 server (on 127.0.0.1) and s3fs test the object-store path end to end.
        # import-linter: tests/test_layers.py checks the one-way layers of .importlinter.
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "moto[server]>=5", "s3fs>=2024.2",
                "accelerate>=0.30", "import-linter>=2.1"],
        # Targets too big for one GPU: --device-map auto.
        "multi-gpu": ["accelerate>=0.30"],
        "demo": ["gguf>=0.10"],
    },
    entry_points={"console_scripts": ["beagle-pipeline=pipeline.cli:main"]},
)
