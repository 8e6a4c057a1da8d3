"""What a run reports about itself: the step metrics and their FLOPs, the loggers (W&B, JSONL),
figures from a run's metrics, and the counts of host syncs and saved activations."""
