"""What a user asks of the DDP and ZeRO model: predict a grid, tune a wrapper.

- grid_costs.py: which calibrations a sweep grid needs, and its priced configurations;
- predict.py: a grid's prediction records, written as a sweep writes its results;
- tune.py / tune_sharded.py: the searches behind ``commlab tune`` (DDP; stage x bucket x
  prefetch x reshard under a memory limit);
- api.py: ``commlab.tune``; module_store.py: an nn.Module instance made nameable for spawned ranks.
"""
