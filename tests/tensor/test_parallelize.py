"""commlab's tensor parallelism against the unpartitioned model and torch's ``parallelize_module``: one spawn.

At world size 2, on Gloo, the small LM of tests/support/tensor_models.py is trained 5 steps of SGD
with momentum in every configuration of ``VARIANTS`` (vocab-parallel embedding and head or not,
sequence parallelism or not, the head's logits split or gathered), by commlab with every
registered all-reduce algorithm and by torch with the same plan in its styles. Losses per step,
every gradient per step and the final parameters must be within 1e-5 of each tensor's largest
value (``max |a - b| / max |ref|``): the sums differ from the unpartitioned model's in order only,
a difference measured at about 1e-6. A key's bias, whose gradient is zero in exact arithmetic,
must stay under 1e-6 of the step's largest gradient. A second spawn runs TP 2 x commlab DDP 2 on 4
ranks against the unpartitioned model trained on both replicas' batches. The rank-side code is
tests/support/tensor_cases.py.
"""

import pytest

import commlab
from commlab import collectives
from tests.support import tensor_cases
from tests.support.tensor_models import VARIANTS

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def world2():
    return commlab.launch(tensor_cases.run_world2, world_size=2, backend="gloo", timeout=300)


def _assert_equal_to_reference(worst: dict, where) -> None:
    assert worst["names_equal"], where
    assert worst["loss"] <= TOLERANCE and worst["grad"] <= TOLERANCE, (where, worst)
    assert worst["param"] <= TOLERANCE and worst["zero_grad"] <= 1e-6, (where, worst)


@pytest.mark.slow
def test_losses_gradients_and_parameters_equal_the_unpartitioned_model_and_torch(world2):
    for rank, result in enumerate(world2):
        assert set(result["commlab"]) == set(result["torch"]) == set(VARIANTS)
        for variant in VARIANTS:
            _assert_equal_to_reference(result["commlab"][variant], (rank, "commlab", variant))
            _assert_equal_to_reference(result["torch"][variant], (rank, "torch", variant))


@pytest.mark.slow
def test_every_registered_all_reduce_algorithm_gives_the_same(world2):
    for rank, result in enumerate(world2):
        assert set(result["algorithms"]) == set(collectives.algorithm_names())
        for algorithm, variants in result["algorithms"].items():
            for variant, worst in variants.items():
                _assert_equal_to_reference(worst, (rank, algorithm, variant))


@pytest.mark.slow
def test_each_rank_holds_half_of_the_split_layers(world2):
    blocks = {f"layers.{i}.{name}" for i in range(2) for name in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2")}
    for result in world2:
        for variant, held in result["holdings"].items():
            vocab = VARIANTS[variant][0]
            assert set(held["layers"]) == blocks | ({"tok", "head"} if vocab else set()), variant
            assert held["weights"] == 0.5, variant
            assert 0.5 < held["all"] < 0.51, variant  # row layers' biases are whole on every rank


@pytest.mark.slow
def test_the_gpt_under_its_ready_plan_equals_itself_unsplit(world2):
    for rank, result in enumerate(world2):
        _assert_equal_to_reference(result["gpt"], (rank, "gpt"))


@pytest.mark.slow
def test_bad_input_is_a_value_error_on_every_rank_before_any_collective(world2):
    for result in world2:
        errors = result["errors"]
        assert errors["no_module"].startswith("ValueError: plan pattern 'layers.*.attention.q' names no module")
        assert errors["bad_kind"].startswith("ValueError: plan entry 'head': 'diagonal' is not a kind")
        assert "does not divide the attention heads around layers.0.attn.q (3)" in errors["heads"]
        assert "does not divide tok.num_embeddings (31)" in errors["vocab"]
        assert errors["algorithm"].startswith("ValueError: unknown all-reduce algorithm 'carrier-pigeon'")
        assert errors["odd_sequence"].startswith("ValueError: tensor-parallel size 2 does not divide the length")
        assert errors["group_after"] == [3.0, 3.0, 3.0]  # no rank was left inside a collective


@pytest.mark.slow
def test_tp2_times_commlab_ddp2_equals_the_unpartitioned_model_on_both_batches():
    # 4 ranks: tensor-parallel pairs {0, 1} and {2, 3}, commlab DDP over {0, 2} and {1, 3}; the
    # plain plan with native collectives, and vocab-parallel sequence parallelism on the ring.
    results = commlab.launch(tensor_cases.run_tp2_dp2, world_size=4, backend="gloo", timeout=300)
    for rank, result in enumerate(results):
        assert set(result) == {"plain", "sp_vocab"}
        for variant, worst in result.items():
            _assert_equal_to_reference(worst, (rank, variant))
