"""Machines the cost model prices without running on them (what-if).

- presets.py (with hardware.yaml, each number with its source): named clusters and their terms;
- nccl.py: an all-reduce priced as NCCL's tuner prices it (ring or tree);
- flops.py: compute from FLOP counts at a stated fraction of peak.
"""
