"""A calibration written by hand (no process calibrates) and the CLI runner for the cost model's
command tests: `predict`, `tune` and `calibrate`, plain and sharded."""

import time

from click.testing import CliRunner

from commlab.cli import main
from commlab.costmodel.calibration import cache as prof
from commlab.costmodel.calibration.driver import Workload, default_threads, parameter_sizes
from commlab.costmodel.terms.costs import fit_table

STEADY = {"steady": True, "spread": 0.05, "load_before": 0.2, "load_after": 1.1, "others_load": 0.2, "cpus": 2,
          "reasons": []}


def synthetic_entry(**over):
    nbytes, shapes = parameter_sizes(Workload("mlp", "depth=2,width=64", 32))
    n = len(nbytes)
    key = prof.make_key(backend="gloo", world_size=2, threads=default_threads(2), model="mlp",
                        model_args="depth=2,width=64", batch_per_rank=32)
    e = {"key": key, "created": time.time(),
         "params": {"nbytes": nbytes, "ready_order": list(reversed(range(n))),
                    "signature": prof.param_signature(nbytes, shapes), "rows": [s[0] for s in shapes]},
         "compute": {"forward_s": 0.002, "ready_s": [0.001 * (j + 1) for j in range(n)], "optimizer_s": 0.0005,
                     "nosync_s": 0.008, "writeback_s_per_byte": 1e-9, "bucket_fixed_s": 1e-4, "corun": 1.1},
         "contention": {"native": {"kc": 0.5, "km": 0.2}},
         # every registered algorithm (tune searches them all), the p2p ones slower than native
         "collectives": {a: fit_table([1 << 10, 1 << 16, 1 << 20], [f * 2e-4, f * 4e-4, f * 3e-3])
                         for a, f in (("native", 1.0), ("ring", 1.3), ("tree", 1.6), ("halving_doubling", 1.4))},
         "steadiness": STEADY}
    e.update(over)
    return e


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)
