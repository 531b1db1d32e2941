"""What the planner compiles for and prices on: the accelerators and their presets
(`accelerators`), compile-only devices and their order (`devices`), the compilers found
and loaded where jax does not look (`compilers`), and their log lines kept off the
terminal (`stderr`). Knows nothing of the plans."""
