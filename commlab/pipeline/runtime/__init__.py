"""The pipeline runtime: what runs a step on each rank (needs torch and a process group).

- :mod:`~commlab.pipeline.runtime.executor`: :class:`PipelineExecutor` runs a rank's lowered list;
- :mod:`~commlab.pipeline.runtime.stages`: :class:`RankStages`, the stage modules a rank holds;
- :mod:`~commlab.pipeline.runtime.traced`: any module cut into stages by tracing (torch.export);
- :mod:`~commlab.pipeline.runtime.chunks`: step()'s arguments as micro-batches, by chunk specs;
- :mod:`~commlab.pipeline.runtime.compute`: forward, backward, and the zero-bubble I / W;
- :mod:`~commlab.pipeline.runtime.transport`, :mod:`~commlab.pipeline.runtime.handshake`: messages, shapes;
- :mod:`~commlab.pipeline.runtime.values`: tensors and tuples across a boundary;
- :mod:`~commlab.pipeline.runtime.memory`: saved-tensor bytes and the per-rank ledger;
- :mod:`~commlab.pipeline.runtime.hybrid`: pipeline x data parallel.

Nothing is imported here: ``commlab.pipeline`` re-exports the public names, loading torch on first use.
"""
