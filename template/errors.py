"""The one exception type that the command line reports as a single line instead of a traceback."""


class ConfigError(Exception):
    """A mistake in the user's configuration or input; the message names the bad value and the fix."""
