"""clawrl trainer: the embedded engine, the tiny world model and the policy trainer (torch, megatron)."""
