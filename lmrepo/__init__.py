"""lmrepo: Hydra-configured GPT-2 / BERT training on DeepSpeed."""
