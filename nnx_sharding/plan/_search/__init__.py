"""Planning a step: the target and the `Step` its candidates share (`prepare`), the
layouts and their specs (`layouts`), tensor parallelism found from a jaxpr
(`tensor_parallel`), knob points (`knobs`), what need not be compiled (`pruning`), one
candidate compiled (`compile`), the compiles driven two at a time (`drive`), and the
entry points `plan` and `search` (`search`)."""
