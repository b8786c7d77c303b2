"""Hand-made step costs for the DDP lowering: two 1 MiB parameters, every time chosen so a
timeline can be worked out by hand (the lowering tests and the column test share them)."""

from commlab.costmodel.lowering.ddp import StepCosts

MIB = 1 << 20


def costs(**over) -> StepCosts:
    # Two 1 MiB parameters; parameter 1's gradient is ready first (backward order).
    base = dict(forward_s=0.2, ready_s=(0.1, 0.3), ready_order=(1, 0), param_nbytes=(MIB, MIB), optimizer_s=0.03,
                nosync_s=0.4, writeback_s_per_byte=0.02 / MIB, bucket_fixed_s=0.01, corun=1.0, kc=0.0, km=0.0,
                allreduce=lambda nbytes: 0.05 * nbytes / MIB)
    return StepCosts(**{**base, **over})
