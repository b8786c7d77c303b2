"""`commlab sweep`: grids of DDP runs, tidy results, paper-style figures and traces.

Modules: ``spec`` (options -> grid of configurations), ``worker`` (one configuration on one
rank), ``runner`` (configurations in fresh process groups, faults, resume), ``store`` (atomic
records -> CSVs), ``stats`` (summaries), ``figdata`` / ``figures`` (figure tables and drawing),
``trace`` (Chrome trace JSON), ``cli`` (the click commands).
"""
