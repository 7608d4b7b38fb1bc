"""lnstrain: distributed LLaMA pretraining with LayerNorm Scaling on PyTorch and DeepSpeed."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "lnstrain" / "__init__.py").read_text()).group(1)

EXTRAS = {
    # Reading .jsonl.zst corpora.
    "zstd": ["zstandard>=0.21"],
    # Reading Parquet corpora (FineWeb, SlimPajama, most of the Hub) and datasets' save_to_disk directories.
    "parquet": ["pyarrow>=14"],
    # PNG plots in depth-analysis and scaling-study reports.
    "plots": ["matplotlib>=3.7"],
    # Hugging Face export/import (safetensors shards), the transformers baseline benchmark, and
    # tools/analyze_depth.py --hf (accelerate: transformers' device_map for models larger than one device).
    "hf": ["safetensors>=0.4", "transformers>=4.40", "accelerate>=0.26"],
    # tools/evaluate.py and train.eval_tasks: EleutherAI's lm-evaluation-harness with its Hugging Face
    # model wrapper (accelerate, peft). Tested on lm_eval 0.4.13; TaskManager(include_defaults=...) needs 0.4.5.
    "eval": ["lm_eval[hf]>=0.4.5,<0.5"],
    # logging.wandb: Weights & Biases tracking. Tested on wandb 0.31.
    "wandb": ["wandb>=0.17,<1"],
    # transformers lets the tests check exported checkpoints against the real LlamaForCausalLM;
    # datasets writes the save_to_disk directory the Parquet/Arrow tests read (with pyarrow, not datasets);
    # lm_eval scores the shipped local task against transformers (tests/evaluation), wandb's offline run
    # files are read back by the tracking tests; scipy is the independent reference the size-trend fits
    # are checked against (lm_eval brings it too, but the tests must not depend on that).
    # Triton (Linux x86_64, where its wheels are): CPU builds of torch come without it, and with it the suite
    # builds every Triton kernel for sm_80/sm_90 and checks the machine code (tests/model/test_triton_compile.py)
    # and runs the kernels in Triton's CPU interpreter against torch (tests/model/test_triton_interpreter.py).
    # >=3.6,<3.8: the releases torch 2.11 (3.6) and 2.13 (3.7.1) pin in their CUDA builds, which it leaves alone.
    "test": ["pytest>=7.4", "zstandard>=0.21", "safetensors>=0.4", "matplotlib>=3.7", "transformers>=4.40",
             "accelerate>=0.26", "pyarrow>=14", "datasets>=2.14", "lm_eval[hf]>=0.4.5,<0.5", "wandb>=0.17,<1",
             "scipy>=1.10", "triton>=3.6,<3.8; platform_system == 'Linux' and platform_machine == 'x86_64'"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="lnstrain",
    version=VERSION,
    description="Megatron-style distributed pretraining of LLaMA-family models with LayerNorm Scaling",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["lnstrain", "lnstrain.*"]),
    install_requires=[
        "torch>=2.3",
        # lnstrain.deepspeed_adapter uses DeepSpeed internals, tested on 0.19 only
        "deepspeed>=0.19,<0.20",
        "sentencepiece>=0.1.99",
        "numpy>=1.24",
        "tensorboard>=2.12",
        "pyyaml>=6.0",
    ],
    extras_require=EXTRAS,
    license="Apache-2.0",
)
