"""Developer sessions: `nox -s tests`, `lint`, `typecheck`, `docs`, `bench`, `bench_checkpoint`,
`fuzz`, `long_runs`.

`nox` alone runs tests, lint and typecheck. `nox -s tests` runs the suite once per
flax version of `FLAX_VERSIONS`; pick one with e.g. `nox -s "tests(flax='newest')"`.
"""

import os

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.default_venv_backend = "venv"

LINTED = ("nnx_sharding", "tests", "benchmarks", "noxfile.py")
FLAX_VERSIONS = {
    # The oldest flax release the whole suite passes with (jax >= 0.10): 0.12.0 does not
    # import; 0.12.1's own nnx.jit passes jax.jit a keyword jax 0.10 dropped; 0.12.2-0.12.3
    # lack the `out_sharding` metadata; before 0.12.6, nnx.eval_shape under a mesh gives
    # no shardings and `sharding_names` is not deprecated.
    "0.12.6": "flax==0.12.6",
    "newest": "flax",
}


@nox.session
@nox.parametrize("flax", list(FLAX_VERSIONS))
def tests(session: nox.Session, flax: str) -> None:
    """Run the whole test suite (8 simulated CPU devices) against one flax version."""
    session.install("-e", ".[test]")
    # Installed on its own: pins the oldest release pyproject.toml allows, or upgrades.
    session.install("--upgrade", FLAX_VERSIONS[flax])
    session.run("python", "-m", "nnx_sharding", "compilers", "--install")  # tests/plan uses them
    session.run("python", "-c", "import flax; print('flax', flax.__version__)")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The fast path's stateful fuzz (tests/test_fuzz.py) with many more examples than the
    suite runs (500, the same ones on every run): 20000 fresh draws, or
    NNX_SHARDING_FUZZ_EXAMPLES. About 2 hours on one core (measured: the fast path's 20000
    in 90 minutes, the staged 6666 in 18, the full path's 2000 in 8). Pin what it finds
    as explicit steps in tests/test_fuzz.py (`run_steps`)."""
    session.install("-e", ".[test]")
    examples = os.environ.get("NNX_SHARDING_FUZZ_EXAMPLES", "20000")
    env = {"NNX_SHARDING_FUZZ_EXAMPLES": examples}
    session.run("pytest", "tests/test_fuzz.py", *session.posargs, env=env)


@nox.session
def long_runs(session: nox.Session) -> None:
    """The published offloaded, long-context and Ironwood runs of
    docs/planning/predictions.md ("Host offload and long context"), planned as they ran
    and checked: each fits and is predicted within 25 % of its published step
    (docs/scripts/long_runs.py --check). About 10 minutes on two cores: too slow for the
    suite."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "nnx_sharding", "compilers", "--install")
    session.run("python", "docs/scripts/long_runs.py", "all", "--check", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", *LINTED)
    session.run("ruff", "format", "--check", *LINTED)


@nox.session
def typecheck(session: nox.Session) -> None:
    """pyright over the package ([tool.pyright] in pyproject.toml), then the completeness
    of the public API's types (`pyright --verifytypes`)."""
    # editable_mode=compat installs a plain path entry, which pyright can follow; the bench
    # extra (matplotlib) for `Plans.plot`'s imports.
    session.install(
        "-e", ".[bench]", "--config-settings", "editable_mode=compat", "pyright[nodejs]"
    )
    failed = []
    for command in (
        ("pyright", *session.posargs),
        ("pyright", "--verifytypes", "nnx_sharding", "--ignoreexternal"),
    ):
        try:
            session.run(*command)
        except CommandFailed:
            failed.append(" ".join(command))
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site (mkdocs-material, mkdocstrings) with --strict."""
    session.install("-e", ".[docs]")
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, not a build warning.
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Per-call overhead benchmark; writes JSON, a plot and Markdown tables to
    benchmarks/results/ (benchmarks/overhead_report.py puts them into the docs)."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/overhead.py", *session.posargs)


@nox.session
def bench_checkpoint(session: nox.Session) -> None:
    """Sharded checkpoint restore against orbax's own (1 GiB, 8 CPU devices); writes JSON to
    benchmarks/results/. Needs a few GiB of free memory."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/checkpoint.py", *session.posargs)
