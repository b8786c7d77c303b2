"""Measuring the cost model's terms once on this machine, and caching them.

- driver.py: the calibration a grid or a tune asks for (ranks spawned, terms fitted, cached);
- measure.py: the rank side of the DDP calibration; sharded.py: its reduce-scatter and all-gather
  tables; queueing.py: collectives started together with other work; devicetime.py: where a rank
  measures and how it times (CUDA events on a GPU);
- cache.py: the calibration cache (a JSON file), keyed by workload and machine;
- pipeline.py: a pipeline's costs from a run's own timelines.
"""
