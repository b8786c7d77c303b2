"""A CPU world size this machine cannot host is refused before any process starts."""

import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.runtime.capacity import OVERSUBSCRIPTION, RANK_BASE_BYTES, available_memory, check_cpu_capacity, check_memory_capacity
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


def test_memory_rule():
    check_memory_capacity(4, 0, available=4 * RANK_BASE_BYTES)
    with pytest.raises(ValueError, match=r"5 ranks x at least 128 MiB.*out-of-memory killer. At most 4 rank"):
        check_memory_capacity(5, 0, available=4 * RANK_BASE_BYTES)
    with pytest.raises(ValueError, match="At most 1 rank"):
        check_memory_capacity(2, RANK_BASE_BYTES, available=3 * RANK_BASE_BYTES)
    assert available_memory() > 0


@pytest.mark.parametrize("args, message", [
    (["--world-size", "1000"], "which would measure the scheduler"),
    (["--world-size", "2", "-e", "64G"], "out-of-memory killer"),
])
def test_bench_collectives_refuses_before_spawning_unless_forced(args, message, monkeypatch):
    from commlab.bench import collectives_bench

    runs = []
    monkeypatch.setattr(collectives_bench, "run", lambda **kw: runs.append(kw))  # no spawn in this test
    result = CliRunner().invoke(main, ["bench", "collectives", *args])
    assert result.exit_code == 2 and message in result.output and "--oversubscribe" in result.output, result.output
    assert not runs
    forced = CliRunner().invoke(main, ["bench", "collectives", *args, "--oversubscribe"])
    assert forced.exit_code == 0 and len(runs) == 1, forced.output
