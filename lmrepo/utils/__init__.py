"""Helpers every layer may use and that know nothing of training: the one-line user error, quieted
library notices, safe loading of files from elsewhere, the Hugging Face Hub, the CPU's facts,
the allocator and DeepSpeed's op cache."""
