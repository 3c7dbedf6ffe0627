"""clawrl proxy: the OpenAI-compatible front door, the database and the job queue.

Nothing in this package imports torch, transformers or megatron (tests/test_boundaries.py).
"""
