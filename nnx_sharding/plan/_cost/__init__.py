"""The cost model: the optimized HLO read (`hlo`), its kernels (`kernels`) with their
FLOPs (`flops`), which collectives hide under them (`overlap`), the step's time and
memory priced on an `Accelerator` (`model`), and an accelerator fitted to measured steps
(`calibrate`). Reads compiled programs; compiles nothing."""
