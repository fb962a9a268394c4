"""What a command that cannot go on tells the person: one line, and the exit status."""

from __future__ import annotations


class PluginError(Exception):
    """A failure the person can act on; ``str()`` is the whole line printed (after ``error: ``)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
