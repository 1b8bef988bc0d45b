"""ConfigError: the one error type for a configuration that cannot run, raised before any model loads."""


class ConfigError(ValueError):
    """A configuration mistake; the message is one line naming the key, file or line at fault."""
