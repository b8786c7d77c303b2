"""The pipeline planner: the fastest plan under a per-rank memory budget, predicted.

- plan.py: a plan (schedule x micro-batches x stages per rank x checkpointing), the candidates
  and the pick;
- layers.py: a model's per-layer profile; model.py: any model cut by name, and the stages a plan
  builds on a rank; stages.py: per-stage times;
- calibrate.py: the planner's once-per-model calibration; offgrid.py: each schedule's stretch and
  overhead from runs at a micro-batch count no plan uses.
"""
