"""Machines the cost model prices without running on them (what-if).

- presets.py (with hardware.yaml, each number with its source): named clusters and their terms;
- nccl.py: a collective over a group's placement (Group, collective_seconds, bus_bandwidth);
- nccl_tuner.py: NCCL's tuner, algorithms x protocols, one formula per concern;
- flops.py: compute from FLOP counts at a stated fraction of peak.
"""
