"""Differential parity suite: every case runs under ``flax.nnx`` and under ``nnx_sharding``.

See `_harness` for how a scenario is run twice and its observations compared.
"""
