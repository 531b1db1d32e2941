"""Test set-up: 8 simulated CPU devices, configured before any backend starts."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# Run by the launcher in processes of its own (test_multihost.py), never imported here:
# importing it initializes jax.distributed.
collect_ignore = ["multihost_worker.py"]
