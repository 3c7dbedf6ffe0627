"""Environments that drive the proxy as an agent would: the protocol (reset / step / outcome),
the episode pool behind `clawrl env`, the sandboxed shell, the terminal and tool-call tracks.
A client of the proxy: imports the base, proxy's admin (to make its users) and the tiny world
(the tool-call track's facts); never torch or the trainer."""
