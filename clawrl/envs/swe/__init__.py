"""The SWE track: generated small Python projects with one seeded bug each (templates, bug
kinds, the task generator and its splits), the tools an agent fixes them with, the episode.
Part of the envs room: imports the base and the terminal track's sandbox, never torch."""
