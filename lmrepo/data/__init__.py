"""Corpus -> token files (once, cached) -> fixed-length blocks -> per-rank batches."""
