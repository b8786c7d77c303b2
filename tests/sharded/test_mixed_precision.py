"""Mixed precision (commlab/sharded/precision.py) against torch's fully_shard with the same
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): an MLP (uneven rows, so padded
buffers; Gloo's collectives) and a GPT with tied embeddings (commlab's ring), 5 steps of SGD with
momentum at stages 1-3, world size 2 (tests/support/sharded_mp_cases.py).

Tolerance: none, losses and every rank's fp32 rows are compared for equality. Both sides cast
the same fp32 master rows to bf16, compute the same bf16 operations, cast the same bf16 gradients
to fp32, and sum two of them (order-free) with a power-of-two scaling, then run the same fp32 SGD
step: nothing is rounded differently. The check can fail at bf16 resolution: fully_shard with
bf16 reductions ends elsewhere (asserted), as would a bf16 master or a gather in fp32 cast later
only by luck.
"""

import pytest
import torch
from torch import nn

import commlab
from commlab.sharded import MixedPrecision, ShardedDataParallel
from commlab.sharded.copies import scaled_copy
from commlab.sharded.memory_model import mixed_precision_memory, zero_memory
from commlab.sharded.peak_model import optimizer_temporaries, sharded_peak
from commlab.sharded.precision import BucketDtypes, bucket_dtypes, cast_inputs, resolve
from tests.support import sharded_mp_cases as cases

BF16, FP32 = torch.bfloat16, torch.float32


def _policy(**kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(**kw)


@pytest.mark.parametrize("policy, words", [
    (lambda: _policy(param_dtype=BF16, output_dtype=FP32), "output_dtype"),
    (lambda: "bf16", "MixedPrecisionPolicy"),
    (lambda: MixedPrecision(param_dtype=torch.int8), "floating-point"),
    (lambda: MixedPrecision(reduce_dtype="float32"), "floating-point"),
    (lambda: MixedPrecision(param_dtype=BF16, cast_forward_inputs=1), "cast_forward_inputs"),
])
def test_bad_policies_are_refused_before_any_process_group(policy, words):
    import torch.distributed as dist

    assert not dist.is_initialized()  # the ValueError comes first, not the missing group's error
    with pytest.raises(ValueError, match=words):
        ShardedDataParallel(nn.Linear(2, 2), stage=3, mixed_precision=policy())


def test_policy_resolution_and_bucket_dtypes():
    assert resolve(None) is None
    assert resolve(_policy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)) == MixedPrecision(
        BF16, FP32, False)
    # The reduction defaults to the computation's dtype, as fully_shard's.
    assert bucket_dtypes(MixedPrecision(param_dtype=BF16), FP32) == BucketDtypes(FP32, BF16, BF16)
    assert bucket_dtypes(MixedPrecision(BF16, FP32), FP32).mixed
    assert not bucket_dtypes(MixedPrecision(FP32, FP32), FP32).mixed
    assert not bucket_dtypes(None, BF16).mixed


def test_cast_inputs_casts_floating_tensors_only():
    x, ids = torch.ones(2), torch.ones(2, dtype=torch.long)
    args, kwargs = cast_inputs(MixedPrecision(BF16), (x, ids, 3.0), {"mask": x})
    assert [a.dtype if isinstance(a, torch.Tensor) else a for a in args] == [BF16, torch.long, 3.0]
    assert kwargs["mask"].dtype == BF16
    assert cast_inputs(MixedPrecision(BF16, cast_forward_inputs=False), (x,), {})[0][0].dtype == FP32


def test_mixed_precision_memory_against_the_papers_k12():
    psi, n = 1e6, 4
    paper = {s: zero_memory(psi, n, s, "mixed").total for s in (1, 2, 3)}  # p = g = 2, K = 12
    # Adam (8 bytes of moments) beside a 4-byte master: the paper's K = 12.
    ours = {s: mixed_precision_memory(psi, n, s, 8, reduce_bytes=2) for s in (1, 2, 3)}
    assert ours[3].total == paper[3] == 16 * psi / n  # no 16-bit shard kept, the gradient shard in fp32
    assert ours[2].total == paper[2] + 2 * psi / n
    # Stage 1: the full bf16 gradient, plus its rows cast to fp32 for the optimizer.
    assert ours[1].gradients == 2 * psi + 4 * psi / n and ours[1].parameters == 2 * psi + 4 * psi / n
    # fp32 reductions: stage 1 keeps the full reduced gradient in fp32, and gives views of it.
    assert mixed_precision_memory(psi, n, 1, 8, reduce_bytes=4).gradients == 4 * psi
    # A reduction-only policy on fp32 parameters: the replica is the master, no second copy.
    assert mixed_precision_memory(psi, n, 2, 8, param_bytes=4, reduce_bytes=2).parameters == 4 * psi
    with pytest.raises(ValueError):
        mixed_precision_memory(psi, n, 0)


@pytest.fixture(scope="module")
def results():
    return commlab.launch(cases.run, world_size=2, backend="gloo", timeout=600)


@pytest.mark.slow
def test_bf16_params_fp32_reductions_equal_fully_shard(results):
    for rank, result in enumerate(results):
        for model in ("mlp", "gpt"):
            ref = result[model]["fully_shard"]
            # The oracle is sensitive to the reduction's dtype: equality below means something.
            assert result[model]["reduce_dtype_shows"], (rank, model)
            assert ref["optimizer_dtypes"] == ref["grad_dtypes"] == {"torch.float32"}
            for stage, r in result[model]["stages"].items():
                where = (rank, model, stage)
                assert r["losses"] == ref["losses"], where
                assert all(r["exact"].values()), (where, r["largest_difference"])
                # The optimizer holds fp32 DTensors (the master), with fp32 gradients and state.
                assert r["dtensors"], where
                assert r["optimizer_dtypes"] == r["grad_dtypes"] == r["momentum_dtypes"] == {"torch.float32"}, where
                # Compute in bf16: the gathered parameters and the model's output.
                assert r["compute_dtypes"] == r["out_dtypes"] == ref["out_dtypes"] == {"torch.bfloat16"}, where
                # 2 bytes an element gathered, 4 reduced.
                reduction = "all_reduce" if stage == 1 else "reduce_scatter"
                assert r["wire_bytes"] == {"all_gather": [2.0], reduction: [4.0]}, (where, r["wire_bytes"])
                assert r["state_dict_is_master"], where
                # load_state_dict writes the fp32 masters, and the compute copies are their bf16 casts.
                assert r["load"] == {"rows": True, "output": True}, (where, r["load"])
        # An fp32 model with bf16 reductions only: fully_shard's results, stages 1-2 without a
        # second fp32 copy (stage 3 keeps its shards as always).
        for stage, r in result["reduction_only"].items():
            assert r["exact"] and r["losses"], (rank, stage)
            assert r["own_master"] == (stage == 3), (rank, stage)
        # Micro-batches under no_sync() sum their gradients in fp32, as fully_shard's do.
        assert result["accumulation"] == {1: 0.0, 2: 0.0, 3: 0.0}, (rank, result["accumulation"])
        # What memory(opt) reads from the live tensors is the mixed-precision memory model's.
        for key, m in result["memory"].items():
            assert m["measured"] == m["model"], (rank, key, m)


def test_the_peak_model_counts_each_transient_in_its_dtype():
    sizes, n = [64, 64, 128], 2  # padded bucket sizes; the largest parameter has 128 elements
    fp32 = sharded_peak(sizes, 128, n, 3, 1, optimizer="fused")
    mixed = sharded_peak(sizes, 128, n, 3, 1, param_bytes=2, reduce_bytes=2, optimizer="fused")
    # Stage 3 backward: two gathered buckets, the one ahead again in Gloo's staging (compute dtype), two
    # gradient buckets (reduction dtype), one autograd gradient (compute dtype).
    assert fp32.backward == (128 + 64 + 128) * 4 + (128 + 64) * 4 + 128 * 4
    assert mixed.backward == fp32.backward // 2
    assert fp32.after_step == mixed.after_step == 0 and fp32.step == 0
    # Stage 2 after the step: 2 gathers in flight, each its buffer, Gloo's copy and an input shard.
    assert sharded_peak(sizes, 128, n, 2, 1, param_bytes=2).after_step == (2 * 192 + 96) * 2
    # Adam's temporaries over the master shards, by implementation.
    shards = [32, 32, 64]
    assert optimizer_temporaries(shards, 4, "for_loop") == 3 * 64 * 4
    assert optimizer_temporaries(shards, 4, "foreach") == 128 * 4
    assert optimizer_temporaries(shards, 4, "fused") == 0
    assert sharded_peak(sizes, 128, n, 1, optimizer="foreach").step == 128 * 4
    with pytest.raises(ValueError, match="implementation"):
        optimizer_temporaries(shards, 4, "adam")
    # Held bytes: commlab's mixed-precision model (tested above), the peak on top.
    assert mixed.held == mixed_precision_memory(256, n, 3, reduce_bytes=2, param_bytes=2).total
    assert mixed.peak == mixed.held + mixed.backward


@pytest.mark.slow
def test_measured_peak_follows_the_peak_model_within_10_percent(results):
    """The measured peak of each stage (median of three steps, each rank) against the peak model
    for that configuration (commlab/sharded/peak_model.py): bf16 parameters, fp32 or bf16
    reductions, torch's default Adam on CPU tensors (the single-tensor loop)."""
    for rank, result in enumerate(results):
        medians = {}
        for (reduce, stage), m in result["peak"].items():
            size = 4 if reduce == "torch.float32" else 2
            model = sharded_peak(m["padded"], m["largest_param"], len(results), stage, 1, param_bytes=2,
                                 reduce_bytes=size, optimizer="for_loop").peak
            medians[(reduce, stage)] = measured = sorted(m["peaks"])[len(m["peaks"]) // 2]
            assert abs(measured - model) <= 0.10 * model, (rank, reduce, stage, m["peaks"], model)
        # Sharding shows: each stage below the one before, whatever the reduction's dtype.
        for reduce in ("torch.float32", "torch.bfloat16"):
            assert medians[(reduce, 1)] > medians[(reduce, 2)] > medians[(reduce, 3)], medians


def test_a_scaled_copy_into_a_wider_dtype_multiplies_in_that_dtype():
    """1/3 applied to bf16 gradients in bf16 loses 8 bits the fp32 reduction would keep."""
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = torch.empty(1000)
    scaled_copy(out, grad, 1 / 3)
    assert torch.equal(out, grad.float() * (1 / 3))
    rounded = torch.mul(grad, 1 / 3).float()
    assert not torch.equal(out, rounded)  # the 16-bit product differs: the case is real
    same = torch.empty(1000, dtype=torch.bfloat16)
    scaled_copy(same, grad, 0.5)
    assert torch.equal(same, grad * 0.5)
