"""clawrl beyond its three processes: base/ (what every process stands on), engine/ (the
embedded inference engine), cli/ (the `clawrl` command and `clawrl up`), and the workshop
around the product: world/, judgemodel/, envs/, eval/, bench/. Map: docs/architecture.md."""
