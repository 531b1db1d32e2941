"""`export` (``jax.export`` of functions of graph nodes) and the `Exported` program it gives
(`program`: its call and serialization, usable without the model)."""
