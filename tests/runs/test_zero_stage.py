"""The ZeRO stage spec (commlab/runs/zero_stage.py): one parser, one message, read by every user of a stage."""

import math
import re

import pytest

from commlab.runs.config import zero_stage_of
from commlab.runs.options import stage_value
from commlab.runs.zero_stage import STAGES, ZeroStage, parse_stage

MESSAGE = "stage must be 0 (DDP: nothing sharded), 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters)"

# value -> (stage, ddp, optimizer state, gradients, parameters, wrapper), or None: refused
TABLE = [
    (0, (0, True, False, False, False, "DistributedDataParallel")),
    (1, (1, False, True, False, False, "ShardedDataParallel")),
    (2, (2, False, True, True, False, "ShardedDataParallel")),
    (3, (3, False, True, True, True, "ShardedDataParallel")),
    ("0", (0, True, False, False, False, "DistributedDataParallel")),
    (" 3 ", (3, False, True, True, True, "ShardedDataParallel")),
    (2.0, (2, False, True, True, False, "ShardedDataParallel")),  # accepted before there was one parser
    (4, None), (-1, None), (1.5, None), (True, None), (False, None), (None, None), ("", None), ("auto", None),
    ("1.0", None), ("three", None), (math.nan, None), ([1], None),
]


@pytest.mark.parametrize("value, expected", TABLE)
def test_the_parsing_table(value, expected):
    if expected is None:
        with pytest.raises(ValueError) as info:
            parse_stage(value)
        assert str(info.value) == f"{MESSAGE}, got {value!r}"
        return
    z = parse_stage(value)
    assert (z.stage, z.ddp, z.optimizer_state, z.gradients, z.parameters, z.wrapper) == expected
    assert type(z.stage) is int and z == ZeroStage(expected[0])


def test_every_stage_shards_what_the_one_below_does_and_one_thing_more():
    kinds = [(z.optimizer_state, z.gradients, z.parameters) for z in map(ZeroStage, STAGES)]
    assert [sum(k) for k in kinds] == [0, 1, 2, 3]
    assert all(all(b >= a for a, b in zip(low, high)) for low, high in zip(kinds, kinds[1:]))
    for bad in (4, True, "1"):
        with pytest.raises(ValueError, match="stage must be 0"):
            ZeroStage(bad)


def test_every_reader_uses_the_one_message():
    from commlab.costmodel.search.tune_sharded import parse_stages
    from commlab.runs.grid import build_grid, merge

    with pytest.raises(ValueError, match=rf"^--stage: {re.escape(MESSAGE)}, got '5'$"):
        stage_value("5", "stage")
    with pytest.raises(ValueError, match=rf"--stage: {re.escape(MESSAGE)}, got 'x'"):
        build_grid(merge({}, {"stage": "0,x"}))
    # the tuner's "auto" is its own choice beside the stages, named in its message
    assert parse_stages("auto") == parse_stages(" AUTO ") == STAGES and parse_stages("2") == parse_stages(2) == (2,)
    with pytest.raises(ValueError, match=rf"^{re.escape(MESSAGE)}, got '5'; or 'auto', every stage$"):
        parse_stages("5")


def test_a_record_without_a_stage_is_ddp():
    assert zero_stage_of({"config": "old"}).ddp and zero_stage_of({"stage": 3}).parameters
    with pytest.raises(ValueError, match="stage must be 0"):
        zero_stage_of({"stage": 7})


@pytest.mark.slow
def test_the_spec_and_the_run_vocabulary_stay_torch_free():
    import subprocess
    import sys

    code = ("import sys, commlab.runs.zero_stage, commlab.runs.grid, commlab.cli.tune_text; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
