"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s bench`."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole test suite (8 simulated CPU devices)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", "nnx_sharding", "tests", "benchmarks", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Per-call overhead benchmark; writes JSON and a plot to benchmarks/results/."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/overhead.py", *session.posargs)
