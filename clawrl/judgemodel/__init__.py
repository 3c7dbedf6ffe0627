"""The judge model: a frozen SmolLM2-135M + LoRA judge (synthetic set, build, merge, evaluate).
Imports the judge's prompts and parsers (it is trained on exactly what judge workers render),
the engine (to serve it) and the tiny world (its facts); never the proxy or the trainer."""
