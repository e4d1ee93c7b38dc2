"""Pure-Python scheduling and KV-cache accounting. Never imports torch: the simulator runs it in virtual time."""
