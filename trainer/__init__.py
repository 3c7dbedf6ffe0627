"""clawrl trainer: the policy trainer (config, data, loss, train loop, checkpoints, export,
publish, versions, backends/). Rooms: engine/ (serving), world/ (the tiny world), eval/
(`clawrl eval`). The trainer proper imports proxy.db/proxy.jobs and backends/, never eval/."""
