"""A running job's life: the training loop, its checkpoints and run directory, stop requests, the
watchdog and NVMe swap space."""
