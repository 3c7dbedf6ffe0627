"""clawrl proxy: the OpenAI-compatible front door: the chat hot path, sessions, the turn log
writer and its journal, per-user keys and fair share, the admin API and the console
(console/). Imports the base (clawrl/base/) and itself only; never torch
(tests/test_boundaries.py)."""
