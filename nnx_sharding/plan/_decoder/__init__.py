"""The built-in decoder-only transformer, a client of the planner: the published
models' configs (`configs`), the model and its loss (`model`), its attention per target
(`attention`), its activations' logical sharding (`activation_sharding`), the remat
policies (`remat`) and the training steps and builder the planner searches
(`training`)."""
