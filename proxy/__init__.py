"""clawrl proxy: the OpenAI-compatible front door, the database and the job queue, the admin
CLI. Imports only itself: never judge or trainer at import time (subcommands are loaded by
name), and never torch, transformers or megatron (tests/test_boundaries.py)."""
