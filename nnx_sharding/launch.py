"""``python -m nnx_sharding.launch``: see :mod:`nnx_sharding._cli.launch`."""

from ._cli.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
