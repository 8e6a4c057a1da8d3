"""The one exception type for user mistakes: train.py prints its message as one line and exits 2."""


class ConfigError(Exception):
    """A configuration or input the user must change; the message names what to change."""


class TrainingError(Exception):
    """A run that cannot go on (a non-finite loss, ...); the message says what to change."""
