"""Text to the batches each rank reads: corpora, the tokenizer, token files (made once, cached),
fixed-length blocks and the sample order."""
