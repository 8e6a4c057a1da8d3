"""A job's plan before any process group starts: the composed config checked against the rules
table, the layout and this machine, and turned into the final DeepSpeed dict (with the user's
JSON laid over it)."""
