"""`jit_partial` and `nnx.cached_partial` over `jit`: graph-node arguments split once.

`jit_partial` holds the wrapper; `split` the partial arguments split when it is made;
`trace` the program jax traces and the output rebuilt from it; `cached_partial` flax's
``nnx.cached_partial`` around our `jit`, flattened once into a `jit_partial`.
"""
