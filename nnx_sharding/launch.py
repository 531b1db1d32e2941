"""``python -m nnx_sharding.launch``: see :mod:`nnx_sharding._launch`."""

from ._launch import main

if __name__ == "__main__":
    raise SystemExit(main())
