"""The cost model: calibration, one costs type, lowerings onto commlab.sim, prediction and tuning.

    commlab calibrate / commlab predict SPEC / commlab tune        (commlab/cli/predict.py)
    commlab.tune("mlp", world_size=2)  or  commlab.tune(my_module)  (commlab/costmodel/api.py)

Modules (one job each):

- costs.py: the one costs type, :class:`~commlab.costmodel.costs.SystemCosts` (collective tables by
  collective, algorithm and world size; point-to-point alpha-beta; contention; overheads), the
  workload profiles DDPProfile and StageProfile, and the fits that make them;
- buckets.py: a sequence of DDP buckets as all-reduce tasks (:func:`bucket_tasks`), which every
  lowering with data-parallel buckets composes;
- lower.py: one DDP optimizer step lowered onto the simulator core, and its sweep columns;
  sharded.py: the same for sharded data parallelism (ZeRO stages 1-3), with its peak bytes per
  rank and bytes sent; sharded_tuning.py: the stage x bucket x prefetch x reshard search under a
  memory limit behind ``commlab tune --stage``;
- pipeline.py: a pipeline schedule's step lowered onto the core (and, in pipeline x data
  parallel, each stage's buckets after its last backward); pipeline_calibrate.py: its costs from
  a run's own timelines; plan.py, plan_profile.py, plan_model.py, plan_stages.py, plan_calibrate.py,
  plan_offgrid.py, plan_check.py: the planner, its per-layer and per-stage profiles, its
  plan-time costs (per schedule from the model's runs off the plans' grid), and its predictions
  checked against measurement;
- calibrate.py, measure.py, profile.py: measuring the terms once (the rank side in measure.py,
  the reduce-scatter and all-gather tables in measure_sharded.py) and caching them as a profile
  keyed by workload and machine;
- predict.py: a sweep's records, predicted from profiles;
- hardware.py: named machines' presets (what-if), with nccl.py (an all-reduce priced as NCCL's
  tuner prices it: ring or tree) and flops.py (compute from FLOPs at a stated fraction of peak);
- devicetime.py: where a calibration rank measures (its device) and how it times (CUDA events on a GPU);
- tuning.py: the exhaustive search behind ``commlab tune`` (a torch answer and a commlab answer);
- uncertainty.py: how far a prediction can be trusted (the validated error, the calibration's
  steadiness from its repeated micro-benchmarks and the load average); session.py: plan <-> profiles glue;
- compare.py, validate.py: predicted against measured, and the held-out validation;
  torchcheck.py: tune's torch answer measured with torch's own DDP against a grid of bucket sizes;
- api.py: ``commlab.tune``; instance.py: an nn.Module instance made nameable for spawned ranks.

The commands live in commlab/cli/predict.py.
"""
