"""The cost model: calibrated terms, lowerings onto commlab.sim, prediction, tuning and planning.

    commlab calibrate / commlab predict SPEC / commlab tune        (commlab/cli/predict.py)
    commlab.tune("mlp", world_size=2)  or  commlab.tune(my_module)  (search/api.py)
    commlab pipeline plan ...                                       (commlab/cli/pipeline_plan.py)

One folder per role; imports run one way, down this list (a room never imports one above it):

- ``search/`` and ``planner/``: what a user asks (predict a grid, tune DDP or ZeRO, plan a pipeline);
- ``calibration/``: measuring the terms once on this machine, and caching them;
- ``lowering/``: a DDP, ZeRO or pipeline step as tasks on the simulator core (commlab/sim);
- ``hardware/``: named machines' presets, NCCL's tuner model and FLOP counts (what-if);
- ``terms/``: the one costs type, the alpha-beta fit and the uncertainty of a prediction (pure).

The cost model never imports the measurement harness (commlab.sweep, commlab.bench); both speak
the run vocabulary of commlab.runs. Model against measurement lives above both, in
commlab.validation.
"""
