"""The embedded engine: a Hugging Face causal LM behind the subset of SGLang's HTTP API clawrl
uses (docs/engine-protocol.md); a peer of SGLang that the policy and the judge engine both
run. Imports torch, transformers, xgrammar and itself only.

`clawrl engine --model DIR` (or `python -m clawrl.engine --model DIR`). Modules:
scheduler (batching thread, KV cache, sampling), runtime (weights, pause, swap lock),
protocol (request bodies, errors), chat (/v1/chat/completions), server (routes, CLI),
grammar (structured outputs: grammar-constrained decoding), lora (adapters), prefix_cache
(KV of prompt prefixes seen before), pretrained (`clawrl models pull`: model directories
from pip packages).
"""
