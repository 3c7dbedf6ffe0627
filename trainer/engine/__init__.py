"""The embedded engine: a Hugging Face causal LM behind the subset of SGLang's HTTP API clawrl
uses (docs/engine-protocol.md). May import torch, transformers and trainer.engine only.

`clawrl engine --model DIR` (or `python -m trainer.engine --model DIR`). Modules:
scheduler (batching thread, KV cache, sampling), runtime (weights, pause, swap lock),
protocol (request bodies, errors), chat (/v1/chat/completions), server (routes, CLI).
"""
