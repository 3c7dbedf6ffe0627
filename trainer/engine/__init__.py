"""The embedded engine: a Hugging Face causal LM behind the subset of SGLang's HTTP API clawrl uses.

`clawrl engine --model DIR` (or `python -m trainer.engine --model DIR`). Modules:
scheduler (batching thread, KV cache, sampling), runtime (weights, pause, swap lock),
protocol (request bodies, errors), chat (/v1/chat/completions), server (routes, CLI).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    """`clawrl engine ...`; imports torch and the server only when run."""
    from trainer.engine.server import main as serve

    return serve(argv)
