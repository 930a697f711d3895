"""SwiftSpec package. The C++/CUDA kernel sources (csrc/) ship inside the package (``swiftspec/_csrc``,
copied at build time) and are compiled on first use where their toolchains exist
(swiftspec/ops/cpu.py, swiftspec/ops/cuda.py), for the CPU they run on (run-time ISA dispatch);
without a toolchain the PyTorch ops are used. Editable installs read csrc/ in place."""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    """Copy csrc/ into the built package as swiftspec/_csrc, so a wheel or a non-editable
    ``pip install .`` can still build the kernels."""

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "swiftspec" / "_csrc"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(ROOT / "csrc", dst, ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))


setup(
    name="swiftspec",
    version="0.1.0",
    description="Latency-first speculative decoding with concurrent draft and target groups",
    packages=find_packages(include=["swiftspec", "swiftspec.*"]),
    package_data={"swiftspec": ["data/eval_prompts/*.jsonl", "data/eval_prompts/LICENSE.EAGLE",
                                "data/eval_prompts/README.md", "data/model_configs/*.json",
                                "data/traces/*.json"]},
    cmdclass={"build_py": BuildPyWithSources},
    python_requires=">=3.10",
    # torch is not pinned here: install the build for your machine first (CPU: torch==2.13.0).
    install_requires=["torch>=2.5", "numpy", "safetensors", "tokenizers>=0.19", "transformers>=4.45", "gguf>=0.10",
                      "jinja2", "tqdm",
                      # swiftspec serve
                      "fastapi", "uvicorn[standard]", "prometheus-client",  # [standard]: uvloop + httptools
                      # the CPU twins (csrc/cpu) are JIT-built by torch.utils.cpp_extension on first use
                      "ninja", "pybind11"],
    extras_require={
        # llama-cpp-python builds llama.cpp from source (about 4 minutes on 2 cores): the llama.cpp
        # peer of the benchmark, and its test; scripts/setup_env.sh sets its CMAKE_ARGS
        "test": ["pytest", "scipy", "matplotlib", "openai", "httpx", "llama-cpp-python", "import-linter"],
        "bench": ["matplotlib", "llama-cpp-python"],
    },
    entry_points={"console_scripts": ["swiftspec=swiftspec.entrypoints.cli:main"]},
)
