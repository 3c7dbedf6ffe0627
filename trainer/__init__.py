"""clawrl trainer: the policy trainer (config, data, the fair share of a version, loss, the
train loop, checkpoints, export, publish, versions, personal adapters, backends/). Imports the
base and the engine's chat rendering (clawrl/engine/chat.py) only; a model directory's
recipe.json says how it trains, so it never imports the tiny world, the eval or a benchmark."""
