"""The planner's compilers, found where jax does not look and loaded only on demand.

Installed as the packages jax knows (``libtpu``, ``jax-cuda12-pjrt`` and
``jax-cuda12-plugin``), the TPU and GPU compilers are loaded by every jax program of the
environment: on a machine without a GPU or TPU, ``import jax; jax.devices()`` then
prints their start-up errors, a screenful (docs/planning/compilers.md). So
``python -m nnx_sharding compilers --install`` puts them with pip in a folder of their
own (`compilers_dir`), which no program searches, and the planner loads them from there
when it first asks for compile-only devices: ``libtpu`` through ``TPU_LIBRARY_PATH``,
the variable jax reads when it loads the TPU library (`tpu_library_env`), and the CUDA
plugin by registering its library with jax (`register_cuda`). Compilers installed the
usual way (``jax[tpu]``, ``jax[cuda12]``) are found too.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from ... import _errors
from .tpu_log import LIBTPU_ARGS

__all__ = [
    "COMPILERS",
    "compilers_dir",
    "cuda_library",
    "package_folder",
    "register_cuda",
    "requirement",
    "tpu_library",
    "tpu_library_env",
]

COMPILERS = ("tpu", "gpu")
"""What ``compilers --install`` installs: the TPU compiler and the GPU compiler."""
DIR_ENV = "NNX_SHARDING_COMPILERS"
"""Overrides the folder the compilers are installed in and looked for (`compilers_dir`)."""


def compilers_dir() -> Path:
    """The folder of the compilers for the installed jax: ``$NNX_SHARDING_COMPILERS`` (else
    ``~/.cache/nnx_sharding/compilers``) / ``jax-VERSION``, one subfolder per compiler.

    A folder per jax version: each jax takes the compilers of its own release.
    """
    root = os.environ.get(DIR_ENV)
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(cache, "nnx_sharding", "compilers")
    return Path(root) / f"jax-{importlib.metadata.version('jax')}"


def package_folder(name: str) -> Path | None:
    """An installed package's folder, found without importing it (``import libtpu`` sets
    ``TPU_LIBRARY_PATH`` for the whole process)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def tpu_library() -> str | None:
    """The TPU compiler's library (``libtpu.so``), or None: ``$TPU_LIBRARY_PATH`` where it
    names a file, else the one `compilers_dir` holds, else an installed ``libtpu``."""
    candidates = [
        os.environ.get("TPU_LIBRARY_PATH") or "",
        compilers_dir() / "tpu" / "libtpu" / "libtpu.so",
    ]
    folder = package_folder("libtpu")
    if folder is not None:
        candidates.append(folder / "libtpu.so")
    return next((str(c) for c in candidates if c and os.path.isfile(c)), None)


def cuda_library() -> str | None:
    """The GPU compiler's library (jax's CUDA PJRT plugin), or None: the one
    `compilers_dir` holds, else that of an installed ``jax[cuda12]``."""
    candidates = [compilers_dir() / "gpu" / "jax_plugins" / "xla_cuda12" / "xla_cuda_plugin.so"]
    folder = package_folder("jax_plugins.xla_cuda12")
    if folder is not None:
        candidates.append(folder / "xla_cuda_plugin.so")
    return next((str(c) for c in candidates if c.is_file()), None)


@contextlib.contextmanager
def tpu_library_env(library: str) -> Iterator[None]:
    """Runs its block with ``TPU_LIBRARY_PATH`` set to ``library`` (jax loads the TPU
    library from there on a first TPU topology), ``ALLOW_MULTIPLE_LIBTPU_LOAD`` set
    unless the environment says otherwise (without it, processes planning in parallel
    fail on libtpu's lock file, ``/tmp/libtpu_lockfile``), and libtpu's log written as
    it goes (`tpu_log.LIBTPU_ARGS` added to ``LIBTPU_INIT_ARGS``: the plans read each
    program's memory from it); all as they were afterwards."""
    names = ("TPU_LIBRARY_PATH", "ALLOW_MULTIPLE_LIBTPU_LOAD", "LIBTPU_INIT_ARGS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["TPU_LIBRARY_PATH"] = library
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    given = os.environ.get("LIBTPU_INIT_ARGS", "")
    if "logbuflevel" not in given:
        os.environ["LIBTPU_INIT_ARGS"] = f"{given} {LIBTPU_ARGS}".strip()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def register_cuda(library: str) -> None:
    """Registers the CUDA PJRT plugin in ``library`` with jax for compile-only GPUs: jax
    gets its topologies, never a backend (one it starts later fails quietly without it).

    jax registers a plugin's backend only for the packages it finds at start-up, which is
    what keeps these compilers out of other programs. Later, ``register_backend_factory``
    (public, ``jax.extend.backend``) takes a plugin already loaded: loading it and making
    its topologies are ``jaxlib.xla_client``'s, the one undocumented API used here. Where a
    jax lacks them, this raises, and the planner compiles for simulated CPU devices with
    the reason in its note. No CUDA library or driver is needed to compile.
    """
    from functools import partial

    from jax.extend.backend import register_backend_factory

    try:
        from jaxlib import xla_client

        load, topology = (
            xla_client.load_pjrt_plugin_dynamically,
            xla_client.make_c_api_device_topology,
        )
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"this jaxlib ({importlib.metadata.version('jaxlib')}) cannot load the GPU "
            f"compiler: {e}"
        ) from e

    def no_backend() -> None:
        raise RuntimeError(
            "the planner's CUDA plugin only compiles (python -m nnx_sharding compilers); "
            "install jax[cuda12] to run on a GPU"
        )

    c_api = load("cuda", library)
    register_backend_factory(
        "cuda", no_backend, priority=500, fail_quietly=True,
        make_topology=partial(topology, c_api), c_api=c_api,
    )  # fmt: skip


def requirement(compiler: str) -> str:
    """The pip requirement of a compiler for the installed jax: libtpu as pinned by
    ``jax[tpu]``, the CUDA PJRT plugin of jaxlib's own version.

    >>> requirement("gpu") == "jax-cuda12-pjrt==" + importlib.metadata.version("jaxlib")
    True
    """
    if compiler == "gpu":
        return f"jax-cuda12-pjrt=={importlib.metadata.version('jaxlib')}"
    for line in importlib.metadata.requires("jax") or []:
        spec, _, marker = line.partition(";")
        if spec.strip().startswith("libtpu") and 'extra == "tpu"' in marker:
            return spec.strip().replace(" ", "")
    raise RuntimeError(_errors.compiler_no_libtpu(importlib.metadata.version("jax")))
