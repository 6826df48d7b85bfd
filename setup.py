"""mindqwen: MindSpore-native training and deployment of Qwen-family language models."""
import re

from setuptools import find_packages, setup

with open("mindqwen/__init__.py", encoding="utf-8") as f:  # the one place the version is written
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

setup(
    name="mindqwen",
    version=VERSION,
    description="MindSpore-native training, LoRA and deployment of Qwen2 / Qwen2.5 / Qwen3 models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # recipes/ ships inside the package as mindqwen.recipes (found with importlib.resources)
    packages=find_packages(include=["mindqwen", "mindqwen.*"]) + ["mindqwen.recipes"],
    package_dir={"mindqwen.recipes": "recipes"},
    package_data={"mindqwen.recipes": ["*.md", "*/*.yaml"],  # the doctor's golden models (~0.9 MB):
                  "mindqwen.doctor": ["goldens/*/*.json", "goldens/*/*.npz", "goldens/*/*.safetensors",
                                      "goldens/*/lora_adapter/*"]},
    install_requires=[
        "mindspore==2.10.0",
        "numpy<2",  # MindSpore 2.10 is built against NumPy 1.x (bf16 interop breaks under 2.x)
        "safetensors",
        "pyyaml",
        "tiktoken",
        "sentencepiece",
        "tqdm",
        "decorator",  # MindSpore's AKG kernel builder (CPU graph-kernel fusion, on by default) imports it
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "nbclient", "nbformat", "ipykernel", "tokenizers",
                 "fastapi>=0.110", "uvicorn>=0.29", "openai>=1.0",  # the server, driven by the official client
                 "lm-eval==0.4.13", "pyarrow<25"],  # the eval extra's, pinned: tests compare with its goldens
        "plot": ["matplotlib"],
        "multimodal": ["pillow"],  # image files (MindSpore installs it too, but mindqwen imports it directly)
        "serve": ["fastapi>=0.110", "uvicorn>=0.29"],  # mindqwen serve
        # mindqwen eval --tasks (lm-evaluation-harness, without torch); pyarrow 25+ needs NumPy 2
        "eval": ["lm-eval>=0.4.13,<0.5", "pyarrow<25"],
    },
    entry_points={"console_scripts": ["mindqwen = mindqwen.cli:main"]},
)
