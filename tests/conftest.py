"""Fixtures shared by the whole suite."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from nanwatch.core.log import get_logger


@pytest.fixture
def nanwatch_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the `nanwatch` logger, which does not propagate to the root logger caplog listens on."""
    logger = get_logger()
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="nanwatch")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
