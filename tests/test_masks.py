"""Masks of both stages against the spec's pictures and rules."""
import pytest
import torch

from beagle.masks import depth, depth_positions, render, stage1_mask, stage2_mask


def test_stage1_k3_eps0_matches_the_spec_picture():
    expected = "\n".join([
        ".........", ".........", ".........",
        "xxx......", "xxx......", "xxx......",
        "xxxxxx...", "xxxxxx...", "xxxxxx...",
    ])
    assert render(stage1_mask(9, 3, 0)) == expected


def test_stage1_offset_shifts_the_windows():
    # k=3, eps=1: windows {0}, {1,2,3}, {4,5,6}; position 0 sees nothing, 1..3 see only 0.
    m = stage1_mask(7, 3, 1)
    assert render(m[:5]) == "\n".join([".......", "x......", "x......", "x......", "xxxx..."])


@pytest.mark.parametrize("length", [1, 5, 12])
def test_k1_is_strictly_causal(length):
    causal = torch.ones(length, length).tril(-1).bool()
    assert torch.equal(stage1_mask(length, 1, 0), causal)


def test_every_position_is_a_query_once_across_stage2_steps():
    k, L = 4, 11
    for eps in range(k):
        seen = torch.cat([depth_positions(L, k, eps, j) for j in range(1, k + 1)])
        assert sorted(seen.tolist()) == list(range(L))
        for j in range(1, k + 1):
            assert (depth(depth_positions(L, k, eps, j), k, eps) == j).all()


def test_stage2_mask_sees_true_context_and_earlier_predictions_of_its_window():
    k, eps, L = 3, 0, 9
    q = depth_positions(L, k, eps, 3)                       # 2, 5, 8
    pred = torch.cat([depth_positions(L, k, eps, 1), depth_positions(L, k, eps, 2)])  # 0,3,6,1,4,7
    m = stage2_mask(q, L, pred, k, eps)
    assert m.shape == (3, L + 6)
    # query 5: true keys 0..2, predicted keys 3 and 4 (its window's earlier depths).
    visible_true = m[1, :L].nonzero().flatten().tolist()
    visible_pred = pred[m[1, L:]].tolist()
    assert visible_true == [0, 1, 2] and sorted(visible_pred) == [3, 4]
    # At depth 1 there are no predicted keys and the mask equals stage 1's rows.
    q1 = depth_positions(L, k, eps, 1)
    m1 = stage2_mask(q1, L, pred[:0], k, eps)
    assert torch.equal(m1, stage1_mask(L, k, eps)[q1])


def test_bad_window_and_offset_are_rejected():
    with pytest.raises(ValueError, match="window_size"):
        stage1_mask(4, 0, 0)
    with pytest.raises(ValueError, match="offset=3"):
        stage1_mask(4, 3, 3)
