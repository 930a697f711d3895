"""SwiftSpec package. The C++/CUDA kernels (csrc/) are compiled on first use where their toolchains
exist (swiftspec/ops/cpu.py, swiftspec/ops/cuda.py); without them the PyTorch ops are used."""
from setuptools import find_packages, setup

setup(
    name="swiftspec",
    version="0.1.0",
    description="Latency-first speculative decoding with concurrent draft and target groups",
    packages=find_packages(include=["swiftspec", "swiftspec.*"]),
    python_requires=">=3.10",
    # torch is not pinned here: install the build for your machine first (CPU: torch==2.13.0).
    install_requires=["torch>=2.5", "numpy", "safetensors", "tokenizers>=0.19", "transformers>=4.45", "gguf>=0.10",
                      "jinja2", "tqdm",
                      # the CPU twins (csrc/cpu) are JIT-built by torch.utils.cpp_extension on first use
                      "ninja", "pybind11"],
    extras_require={
        "test": ["pytest", "scipy", "matplotlib"],
        # llama-cpp-python builds llama.cpp from source (several minutes); only the peer benchmark needs it
        "bench": ["matplotlib", "llama-cpp-python"],
    },
    entry_points={"console_scripts": ["swiftspec=swiftspec.cli:main"]},
)
