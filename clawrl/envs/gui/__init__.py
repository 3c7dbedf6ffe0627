"""The GUI track: generated web applications with goals (templates, the task generator and its
split), served on 127.0.0.1 and driven in headless Chromium through tool calls, the episode.
Part of the envs room: imports the base and the envs' shared tool calls, never torch."""
