"""Training backends: `torch` (Hugging Face model) and `megatron` (megatron-core GPTModel)."""
