"""Training backends: `torch` (Hugging Face model) and `megatron` (megatron-core GPTModel, its
HF mapping, CPU compatibility layer and checkpoints). May import torch, megatron and trainer's
own config/loss/data modules; never the engine, world or eval."""
