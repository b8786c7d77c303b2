"""A CPU world size this machine cannot host is refused before any process starts."""

import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.runtime.capacity import OVERSUBSCRIPTION, check_cpu_capacity
from commlab.runtime.metadata import cpu_count


def test_capacity_rule():
    check_cpu_capacity(4, 1, cores=2)  # 2 threads per core: allowed
    check_cpu_capacity(2, 2, cores=2)
    with pytest.raises(ValueError, match=r"5 ranks x 1 thread\(s\) = 5 threads on 2 CPU core\(s\).*At most 4 rank"):
        check_cpu_capacity(5, 1, cores=2)
    with pytest.raises(ValueError, match="At most 2 rank"):
        check_cpu_capacity(3, 2, cores=2)


def test_bench_ddp_refuses_before_spawning():
    too_many = cpu_count() * OVERSUBSCRIPTION + 1
    result = CliRunner().invoke(main, ["bench", "ddp", "--world-size", str(too_many)])
    assert result.exit_code == 2 and "which would measure the scheduler" in result.output, result.output
