"""The one exception type the builder raises for bad input."""


class BuildError(Exception):
    """A problem the user can fix. The message is one line: what is wrong and what to do."""
