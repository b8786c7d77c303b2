"""Activation memory against Korthikanti et al.'s formulas and worked numbers (MLSys 2023, sections 4 and 5)."""

import pytest

from commlab.costmodel.lowering.activations import in_flight, per_layer, per_rank
from commlab.costmodel.lowering.transformer import GPT

GPT3 = GPT(layers=96, hidden=12288, heads=96)  # Table 3's 175B
MTNLG = GPT(layers=105, hidden=20480, heads=128)  # Table 3's 530B


def sbh(gpt, b=1):
    return gpt.seq * b * gpt.hidden


def test_the_attention_core_term_is_80_for_gpt3_and_64_for_mt_nlg():
    # Section 5: 5 a s / h is 80 for GPT-3 and 64 for MT-NLG, against the 34 of the rest
    assert per_layer(GPT3, 1) / sbh(GPT3) - 34 == pytest.approx(80)
    assert per_layer(MTNLG, 1) / sbh(MTNLG) - 34 == pytest.approx(64)


def test_selective_recomputation_saves_70_and_65_percent():
    # Section 5: selective recomputation cuts activation memory by 70% (GPT-3) and 65% (MT-NLG)
    for gpt, saved in ((GPT3, 0.70), (MTNLG, 0.65)):
        kept = per_layer(gpt, 1, 8, True, "selective") / per_layer(gpt, 1, 8, True, "none")
        assert 1 - kept == pytest.approx(saved, abs=0.005)


def test_table_2_rows():
    t, b = 8, 2
    core = 5 * GPT3.heads * GPT3.seq / GPT3.hidden
    assert per_layer(GPT3, b, t) == pytest.approx(sbh(GPT3, b) * (10 + 24 / t + core / t))
    assert per_layer(GPT3, b, t, True) == pytest.approx(sbh(GPT3, b) / t * (34 + core))
    assert per_layer(GPT3, b, t, False, "selective") == pytest.approx(sbh(GPT3, b) * (10 + 24 / t))
    assert per_layer(GPT3, b, t, True, "selective") == pytest.approx(34 * sbh(GPT3, b) / t)
    assert per_layer(GPT3, b, t, False, "full") == pytest.approx(2 * sbh(GPT3, b))
    # sequence parallelism splits what tensor parallelism alone left whole: the 10 s b h of norms and dropouts
    assert per_layer(GPT3, b, t, True) < per_layer(GPT3, b, t) < per_layer(GPT3, b, 1)


def test_a_pipeline_rank_holds_the_whole_models_layers_and_more_interleaved():
    assert in_flight(8) == 1 and in_flight(8, 3) == pytest.approx(1 + 7 / 24)
    assert per_rank(GPT3, 1, 8, 8, True, "selective") == pytest.approx(96 * 34 * sbh(GPT3) / 8)
    assert per_rank(GPT3, 1, 8, 8, True, "selective", 3) > per_rank(GPT3, 1, 8, 8, True, "selective")


def test_bad_input():
    with pytest.raises(ValueError, match="divide the 96 attention heads"):
        per_layer(GPT3, 1, 7)
    with pytest.raises(ValueError, match="recompute"):
        per_layer(GPT3, 1, 8, recompute="some")
    with pytest.raises(ValueError, match="do not split"):
        per_rank(MTNLG, 1, 8, 8)
