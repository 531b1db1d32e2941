"""The command-line tools of ``python -m nnx_sharding``: `common` (what the commands share:
one-line errors, option types, simulated CPU devices), `aot` (ahead-of-time reports),
`plan` (the planner's command), `compilers` (where the planner's compilers are, and
their install), `launch` (multi-process runs on one machine, and `initialize_distributed`)."""
