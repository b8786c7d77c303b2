"""The schedule representation: actions and their kinds, the builders and registry, the comm pass, checks, analysis, pictures.

Everything here is a pure function of the pipeline's shape (no process group, no torch):

- :mod:`~commlab.pipeline.schedule.kinds`: action kinds and the one dependency rule;
- :mod:`~commlab.pipeline.schedule.actions`: :class:`Action`, placements, torch's CSV;
- :mod:`~commlab.pipeline.schedule.registry`, :mod:`~commlab.pipeline.schedule.zero_bubble`: the schedules;
- :mod:`~commlab.pipeline.schedule.clock`: the schedule's own tick clock and deadlock walk;
- :mod:`~commlab.pipeline.schedule.comm`: the comm pass (:func:`lower_comm`: SEND, RECV, WAIT);
- :mod:`~commlab.pipeline.schedule.liveness`: which activations are alive when;
- :mod:`~commlab.pipeline.schedule.checks`: what makes a schedule runnable;
- :mod:`~commlab.pipeline.schedule.tasks`, :mod:`~commlab.pipeline.schedule.simulate`: the lists on the simulator core;
- :mod:`~commlab.pipeline.schedule.render`: the step x rank grid and Gantt charts.
"""
