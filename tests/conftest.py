"""Fixtures shared by the whole suite."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from nanwatch.core.log import get_logger


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--accelerator-path",
        action="store_true",
        help="measure CPU tensors the accelerator's way in every test (core/stats/paths.py): what a GPU run measures",
    )


@pytest.fixture(autouse=True)
def _accelerator_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """With --accelerator-path, every test runs nanwatch's accelerator path on its CPU tensors (tests/
    test_accelerator_path.py runs the suites that matter most that way in the ordinary run), except those about the
    CPU's own path (marked `cpu_path`)."""
    if not request.config.getoption("--accelerator-path") or request.node.get_closest_marker("cpu_path"):
        yield
        return
    from nanwatch.core.stats.paths import cpu_as_accelerator

    with cpu_as_accelerator():
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The quick tier (`pytest -m "not slow"`) leaves out what takes seconds, not milliseconds: every test that runs
    real processes (`multiprocess`) is slow, and so is each test marked `slow` where it is defined (a real framework's
    example run, torch.compile, a subprocess, the docs), which a `--durations=0` run showed above 2.5 s."""
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _nanwatch_logger_as_it_was() -> Iterator[None]:
    """Whatever a test (or a page of the docs it runs) does to the `nanwatch` logger is undone after it: a level left
    at CRITICAL once hid every report of the tests that ran after it."""
    logger = logging.getLogger("nanwatch")
    state = (logger.level, logger.disabled, logger.propagate, list(logger.handlers))
    yield
    logger.setLevel(state[0])
    logger.disabled, logger.propagate, logger.handlers[:] = state[1], state[2], state[3]


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


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: each test that asks for this starts from none.

    Test modules that need it everywhere say `pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")`.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
