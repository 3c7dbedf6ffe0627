"""Free ports for the stacks clawrl starts on one machine: `clawrl eval`'s and the
benchmarks' stacks, and the tests' servers."""

from __future__ import annotations

import random
import socket

HOST = "127.0.0.1"

# Ports are handed out below Linux's ephemeral range (32768-60999). A port from bind(0) is an
# ephemeral one, and between this check and the server's own bind any outgoing connection on
# the machine may take it (CI saw a proxy fail "address already in use" that way).
_PORTS = range(20000, 32000)
_given: set[int] = set()
_rng = random.SystemRandom()  # never a seeded sequence another process would repeat


def free_port() -> int:
    """A port on HOST that binds now, outside the ephemeral range, not handed out before."""
    for _ in range(500):
        port = _rng.choice(_PORTS)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} on {HOST}")
