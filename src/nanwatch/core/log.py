"""The `nanwatch` logger: shown on stderr by default, silenced or redirected with the standard logging API."""

from __future__ import annotations

import logging
import sys
import types
import warnings

from nanwatch.errors import NanwatchWarning

__all__ = ["get_logger", "warn"]

_LOGGER_NAME = "nanwatch"
# Set on a record that `warn` also issues as a warning, which Python prints on stderr already.
_SHOWN_AS_WARNING = "nanwatch_shown_as_warning"


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

    def filter(self, record: logging.LogRecord) -> bool:
        # A warning is printed on stderr by Python's warnings machinery: not a second time here.
        return not getattr(record, _SHOWN_AS_WARNING, False) and bool(super().filter(record))


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


def warn(message: str, *, stacklevel: int | None = None) -> None:
    """Say `message` once: as a `NanwatchWarning`, which Python prints on stderr (and test runners collect), and to
    the `nanwatch` logger's other destinations (a handler the application added, the root logger when it propagates):
    the logger's own stderr handler leaves it out, or stderr would show it twice.

    Args:
        stacklevel: as for `warnings.warn`, counted from the caller of this function. None: the first caller outside
            torch and nanwatch (the user's line, also for a warning from a hook that torch runs), so that Python's
            once-per-line filter tells the user's lines apart rather than nanwatch's.
    """
    if stacklevel is None:
        frame: types.FrameType | None = sys._getframe(1)
        stacklevel = 1
        while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("torch", "nanwatch"):
            frame, stacklevel = frame.f_back, stacklevel + 1
    get_logger().warning(message, extra={_SHOWN_AS_WARNING: True})
    warnings.warn(message, NanwatchWarning, stacklevel=stacklevel + 1)
