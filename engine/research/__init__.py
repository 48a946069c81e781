"""Offline research code, apart from the serving runtime: the simulator (sim.py) and its
request streams (workloads.py), the optimal-schedule bound (optimal.py, which needs the
`bound` extra: OR-Tools), and the cost model's calibration (calibrate.py times this engine,
fit.py fits the linear model).

They use the engine's parts (the scheduler, its policies, the block pool, the cost model);
nothing in the runtime imports them back (tests/test_layers.py checks). EXPLAIN is the one
caller above the engine: it runs the simulator to estimate a query's time."""
