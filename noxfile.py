"""Developer sessions: `nox -s lint`, `nox -s typecheck`, `nox -s tests`."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of torch; a bare `torch` requirement would resolve to a multi-GB CUDA build.
TORCH = "torch==2.13.0"


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    # The layers (pyproject.toml [tool.importlinter]): import-linter imports nanwatch, so it needs the package.
    session.install("-e", ".", "--no-deps")
    session.run("lint-imports", "--no-cache")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[all,dev]")
    session.run("mypy", "src")


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[all,dev]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)
