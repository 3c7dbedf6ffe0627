"""clawrl judge: workers that turn each turn's next state into a reward, a hint and teacher
logprobs. May import proxy (db, jobs, settings, engine client); never trainer, torch or
transformers."""
