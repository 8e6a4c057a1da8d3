"""Hydra launcher that runs each multirun job as its own distributed job (see lmrepo_launcher.py)."""
