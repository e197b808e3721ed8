"""The `nanwatch` logger: shown on stderr by default, silenced or redirected with the standard logging API."""

from __future__ import annotations

import logging
import sys

__all__ = ["get_logger"]

_LOGGER_NAME = "nanwatch"


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of each record, not the one seen when the logger was made.

    Test runners and notebooks swap `sys.stderr`; a handler bound to the old stream would write to a closed file.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr


def get_logger() -> logging.Logger:
    """Return the `nanwatch` logger, giving it a stderr handler the first time if the application set none.

    Like transformers, the library logger owns its handler and does not propagate, so reports are not printed twice
    when the application configures the root logger. Add a handler or set `propagate = True` to route them elsewhere.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:  # a level the user set stays theirs
            logger.setLevel(logging.INFO)
    return logger
