"""Environments that drive the proxy as an agent would: the protocol (reset / step / outcome),
the episode pool behind `clawrl env`, the sandboxed shell and the terminal track. A client of
the proxy: may import proxy/ and itself, never torch or the rest of trainer/; nothing imports it."""
