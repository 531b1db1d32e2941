"""The command-line tools of ``python -m nnx_sharding``: `common` (what the commands share:
one-line errors, option types, simulated CPU devices), `aot` (ahead-of-time reports),
`plan` (the planner's command), `launch` (multi-process runs on one machine, and
`initialize_distributed`), `quiet` (the plugins' start-up noise kept off stderr)."""
