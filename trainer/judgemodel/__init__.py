"""The judge model: a frozen SmolLM2-135M + LoRA judge (synthetic set, build, merge, evaluate).
May import trainer.world, trainer.pretrained, trainer.engine (to serve it) and judge.prompts/prm/hints; never proxy runtime."""
