"""The one error type a checkpoint load raises: a one-line message naming the file or tensor."""

from titanloop.config_errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded (corrupt, truncated, another model shape); the run dir is untouched."""
