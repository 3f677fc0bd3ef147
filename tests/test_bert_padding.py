"""Tests for bert_padding: padded <-> packed conversion and its gradients (CPU only)."""

import pytest
import torch

import bert_padding
from bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input

BATCH, SEQLEN = 5, 7


def _random_mask(kind: str, seed: int = 0) -> torch.Tensor:
    """A [BATCH, SEQLEN] bool mask of the given kind, seeded so failures reproduce."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "all_valid":
        return torch.ones(BATCH, SEQLEN, dtype=torch.bool)
    if kind == "scattered":
        # Holes anywhere, not only trailing padding: unpad must keep the original order.
        return torch.rand(BATCH, SEQLEN, generator=gen) < 0.6
    # Right-padded sequences of random length, with a length-1 and a length-0 row forced in.
    lengths = torch.randint(0, SEQLEN + 1, (BATCH,), generator=gen)
    if kind == "edge_lengths":
        lengths[1] = 1
        lengths[3] = 0
        lengths[4] = SEQLEN
    return torch.arange(SEQLEN).expand(BATCH, SEQLEN) < lengths.unsqueeze(1)


MASK_KINDS = ["all_valid", "scattered", "right_padded", "edge_lengths"]
TRAILING = [(), (3,), (2, 4)]  # hidden_states [B, S], [B, S, D], [B, S, H, D]
MASK_DTYPES = [torch.bool, torch.int32, torch.int64, torch.uint8]


def _hidden(trailing: tuple[int, ...], seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQLEN, *trailing, generator=gen, dtype=dtype)


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("trailing", TRAILING)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_round_trip_and_rows(kind, trailing, mask_dtype):
    mask = _random_mask(kind)
    x = _hidden(trailing)
    unpadded, indices, *_ = unpad_input(x, mask.to(mask_dtype))

    assert unpadded.shape == (int(mask.sum()), *trailing)
    torch.testing.assert_close(unpadded, x[mask], rtol=0, atol=0)
    assert indices.dtype == torch.int64
    torch.testing.assert_close(indices, torch.nonzero(mask.flatten()).flatten())

    padded = pad_input(unpadded, indices, BATCH, SEQLEN)
    expected = torch.where(mask.view(BATCH, SEQLEN, *([1] * len(trailing))), x, 0.0)
    assert padded.shape == x.shape
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_sequence_metadata(kind, mask_dtype):
    mask = _random_mask(kind)
    _, _, cu_seqlens, max_seqlen, seqused = unpad_input(_hidden((3,)), mask.to(mask_dtype))
    lengths = [int(row.sum()) for row in mask]

    assert cu_seqlens.dtype == torch.int32 and seqused.dtype == torch.int32
    assert cu_seqlens.shape == (BATCH + 1,) and seqused.shape == (BATCH,)
    expected_cu = [0]
    for n in lengths:
        expected_cu.append(expected_cu[-1] + n)
    assert cu_seqlens.tolist() == expected_cu
    assert seqused.tolist() == lengths
    assert isinstance(max_seqlen, int) and max_seqlen == max(lengths)


def test_known_layout():
    # The example from the module docstring, checked value by value.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    x = torch.arange(12.0).view(3, 4)
    unpadded, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert unpadded.tolist() == [0.0, 1.0, 2.0, 4.0, 8.0, 9.0, 10.0, 11.0]
    assert indices.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert cu_seqlens.tolist() == [0, 3, 4, 8]
    assert seqused.tolist() == [3, 1, 4]
    assert max_seqlen == 4


def test_int_mask_nonzero_values_count_as_valid():
    mask = torch.tensor([[2, 0, -1]])
    unpadded, indices, *_ = unpad_input(torch.tensor([[1.0, 2.0, 3.0]]), mask)
    assert indices.tolist() == [0, 2]
    assert unpadded.tolist() == [1.0, 3.0]


def test_all_padding_and_empty_batch():
    x = _hidden((3,))
    unpadded, indices, cu_seqlens, max_seqlen, seqused = unpad_input(
        x, torch.zeros(BATCH, SEQLEN, dtype=torch.bool)
    )
    assert unpadded.shape == (0, 3) and indices.shape == (0,)
    assert cu_seqlens.tolist() == [0] * (BATCH + 1) and max_seqlen == 0
    assert seqused.tolist() == [0] * BATCH
    torch.testing.assert_close(pad_input(unpadded, indices, BATCH, SEQLEN), torch.zeros_like(x))

    unpadded, indices, cu_seqlens, max_seqlen, seqused = unpad_input(
        torch.randn(0, SEQLEN, 3), torch.zeros(0, SEQLEN, dtype=torch.bool)
    )
    assert unpadded.shape == (0, 3)
    assert cu_seqlens.tolist() == [0] and max_seqlen == 0 and seqused.shape == (0,)
    assert pad_input(unpadded, indices, 0, SEQLEN).shape == (0, SEQLEN, 3)


def test_non_contiguous_hidden_states():
    mask = _random_mask("edge_lengths")
    x = torch.randn(SEQLEN, BATCH, 2, 4).transpose(0, 1)  # [B, S, H, D], not contiguous
    unpadded, indices, *_ = unpad_input(x, mask)
    torch.testing.assert_close(unpadded, x[mask], rtol=0, atol=0)


@pytest.mark.parametrize("trailing", TRAILING)
@pytest.mark.parametrize("kind", ["scattered", "edge_lengths"])
def test_unpad_pad_gradients_match_boolean_indexing(kind, trailing):
    mask = _random_mask(kind)
    x = _hidden(trailing).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    gen = torch.Generator().manual_seed(2)

    unpadded, *_ = unpad_input(x, mask)
    upstream = torch.randn(unpadded.shape, generator=gen)
    (unpadded * upstream).sum().backward()
    (x_ref[mask] * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    # Padded positions receive exactly zero gradient.
    assert not x.grad[~mask].any()

    values = torch.randn(int(mask.sum()), *trailing, generator=gen, requires_grad=True)
    values_ref = values.detach().clone().requires_grad_()
    indices = unpad_input(x.detach(), mask)[1]
    upstream = torch.randn(BATCH, SEQLEN, *trailing, generator=gen)
    (pad_input(values, indices, BATCH, SEQLEN) * upstream).sum().backward()
    ref = torch.zeros(BATCH, SEQLEN, *trailing)
    ref[mask] = values_ref
    (ref * upstream).sum().backward()
    torch.testing.assert_close(values.grad, values_ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("trailing", TRAILING)
def test_gradcheck_primitives(trailing):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, *trailing, generator=gen, dtype=torch.float64, requires_grad=True)
    # Includes a repeated row: its gradient must be the sum of both uses.
    gather_idx = torch.tensor([4, 0, 4, 2])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, gather_idx), (x,))
    assert torch.autograd.gradgradcheck(lambda t: index_first_axis(t, gather_idx), (x,))

    values = torch.randn(3, *trailing, generator=gen, dtype=torch.float64, requires_grad=True)
    put_idx = torch.tensor([5, 1, 3])
    assert torch.autograd.gradcheck(lambda v: index_put_first_axis(v, put_idx, 6), (values,))
    assert torch.autograd.gradgradcheck(lambda v: index_put_first_axis(v, put_idx, 6), (values,))


def test_gradcheck_unpad_pad_float64():
    mask = _random_mask("edge_lengths")
    x = torch.randn(BATCH, SEQLEN, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (x,))
    indices = unpad_input(x.detach(), mask)[1]
    values = torch.randn(len(indices), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: pad_input(v, indices, BATCH, SEQLEN), (values,))


def test_primitives_values():
    x = torch.arange(12.0).view(4, 3)
    idx = torch.tensor([3, 1], dtype=torch.int32)  # int32 indices are accepted
    torch.testing.assert_close(index_first_axis(x, idx), x[[3, 1]])

    out = index_put_first_axis(torch.ones(2, 3), idx, 5)
    expected = torch.zeros(5, 3)
    expected[[3, 1]] = 1.0
    torch.testing.assert_close(out, expected)

    x.requires_grad_()
    index_first_axis(x, torch.tensor([2, 2, 0])).sum().backward()
    assert x.grad[:, 0].tolist() == [1.0, 0.0, 2.0, 0.0]

    # Bound classmethods compare equal (not identical) when they wrap the same Function.
    assert bert_padding.index_first_axis == bert_padding.IndexFirstAxis.apply
    assert bert_padding.index_put_first_axis == bert_padding.IndexPutFirstAxis.apply


@pytest.mark.parametrize(
    ("hidden_shape", "mask", "match"),
    [
        ((2, 3, 4), torch.ones(2, 4, dtype=torch.bool), "attention_mask shape"),
        ((2, 3, 4), torch.ones(3, 3, dtype=torch.bool), "attention_mask shape"),
        ((2, 3), torch.ones(6, dtype=torch.bool), "attention_mask must be a 2-D"),
        ((2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool), "attention_mask must be a 2-D"),
        ((6,), torch.ones(2, 3, dtype=torch.bool), "hidden_states"),
        ((2, 3, 4), torch.ones(2, 3), "attention_mask must be bool or integer"),
    ],
)
def test_unpad_input_rejects_bad_inputs(hidden_shape, mask, match):
    with pytest.raises(ValueError, match=match):
        unpad_input(torch.zeros(hidden_shape), mask)


def test_indices_validation():
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="indices must be 1-D"):
        index_first_axis(x, torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="indices must have an integer dtype"):
        index_first_axis(x, torch.zeros(2))
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        index_first_axis(torch.tensor(1.0), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="indices must be 1-D"):
        index_put_first_axis(x, torch.zeros(4, 1, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="values must have one row per index"):
        index_put_first_axis(x, torch.tensor([0, 1]), 8)
    with pytest.raises(ValueError, match="first_axis_dim"):
        index_put_first_axis(x, torch.arange(4), -1)
    with pytest.raises(ValueError, match="first_axis_dim"):
        index_put_first_axis(x, torch.arange(4), 8.0)


def test_pad_input_validation():
    values = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="indices must be 1-D"):
        pad_input(values, torch.zeros(3, 1, dtype=torch.int64), 2, 2)
    with pytest.raises(ValueError, match="hidden_unpadded must have one row per index"):
        pad_input(values, torch.tensor([0, 1]), 2, 2)
    with pytest.raises(ValueError, match="batch"):
        pad_input(values, torch.arange(3), -1, 2)
    with pytest.raises(ValueError, match="seqlen"):
        pad_input(values, torch.arange(3), 2, 2.5)
