"""Measuring the cost model's terms once on this machine, and caching them.

- run.py: one calibration launch, every calibration's (ranks with a rank's threads, the load
  around them, steadiness);
- driver.py: the calibration a grid or a tune asks for (terms fitted, cached);
- measure.py: the rank side of the DDP calibration; sharded.py: its reduce-scatter and all-gather
  tables; queueing.py: collectives started together with other work; devicetime.py: where a rank
  measures and how it times (CUDA events on a GPU);
- cache.py: the calibration cache (a JSON file), keyed by workload and machine;
- pipeline.py: a pipeline's costs from a run's own timelines, and how a timed step is taken.
"""
