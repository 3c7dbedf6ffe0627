"""The shared base every clawrl process stands on: the schema of record, settings, the job
queue, the engine client, errors, the state file, signals and logging. Imports no other
clawrl package (tests/test_boundaries.py), and never torch."""
