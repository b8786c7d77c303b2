"""`commlab sweep`: grids of DDP and ZeRO runs, tidy results, paper-style figures and traces.

Modules: ``worker`` (one configuration on one rank), ``wrap`` (the wrapper a configuration names
and what its step measured), ``runner`` (configurations in fresh process groups, faults,
resume), ``progress``, ``figdata`` / ``figures`` (figure tables and drawing), ``trace`` (Chrome
trace JSON), ``torch_trace`` (a torch.profiler trace of one configuration), ``metadata``. The grid,
columns and store are commlab.runs.
"""
