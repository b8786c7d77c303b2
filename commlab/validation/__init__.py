"""The cost model against measurement, on work it was not fitted on (``commlab validate``).

- ddp.py: the DDP predictor and tune's pick on held-out models, forward and in reverse;
- sharded.py: the ZeRO predictor and memory model;
- planner.py: the pipeline planner's plans measured (``pipeline plan --validate``);
- torch_answer.py: tune's torch answer measured with torch's own DDP;
- compare.py: predicted against measured tables, and the drawing.

It imports both sides: the harness (commlab.sweep) and the model (commlab.costmodel).
"""
