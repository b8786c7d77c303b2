"""The cost model's terms, pure: the costs type, the alpha-beta fit, a prediction's uncertainty.

- costs.py: SystemCosts (collective tables by collective, algorithm and world size; point-to-point
  alpha-beta; contention; overheads), the workload profiles DDPProfile and StageProfile, and the
  fits that make them;
- alpha_beta.py: size sweeps, nccl-tests' bus bandwidth and the non-negative alpha-beta fit;
- uncertainty.py: how far a prediction can be trusted (validated error, calibration steadiness).
"""
