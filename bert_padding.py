"""Convert between padded batches and the packed ("unpadded") layout of varlen attention.

Variable-length (varlen) FlashAttention kernels do not take a padded ``[batch, seqlen, ...]``
tensor plus an attention mask. They take every valid token of every sequence packed back to
back along one leading axis, with no padding in between::

    padded  [B, S, ...]   mask [B, S]                packed  [total, ...]
    seq 0:  a0 a1 a2 .    1 1 1 0                    a0 a1 a2 b0 c0 c1 c2 c3
    seq 1:  b0 .  .  .    1 0 0 0        ------>     cu_seqlens = [0, 3, 4, 8]
    seq 2:  c0 c1 c2 c3   1 1 1 1                    seqused    = [3, 1, 4]

``total`` is the number of valid tokens in the batch. Sequence ``i`` occupies rows
``cu_seqlens[i]:cu_seqlens[i + 1]`` of the packed tensor, so ``cu_seqlens`` (int32, length
``B + 1``, starting at 0) is the prefix sum of the per-sequence lengths ``seqused``. The kernels
also want ``max_seqlen`` (a Python int) to size their launch grid.

``unpad_input`` goes from padded to packed and ``pad_input`` goes back, filling padded positions
with zeros. Both are built on two autograd-aware row primitives, ``index_first_axis`` (gather
rows) and ``index_put_first_axis`` (scatter rows into zeros), which are each other's backward, so
gradients flow through the round trip on CPU and CUDA alike.
"""

import math
import operator

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = [
    "IndexFirstAxis",
    "IndexPutFirstAxis",
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
]


def _check_indices(indices: torch.Tensor) -> None:
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"indices must have an integer dtype, got {indices.dtype}")


def _check_size(name: str, value) -> int:
    # operator.index accepts ints and int-likes (numpy ints, 0-d integer tensors) but not floats.
    try:
        size = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if isinstance(value, bool) or size < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return size


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    # gather/scatter need an explicit index per element; viewing x as [N, prod(rest)] lets one
    # expanded row index cover every trailing dim. math.prod (not reshape(N, -1)) keeps this
    # well defined when N == 0 or x is 1-D.
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _row_index(indices: torch.Tensor, width: int) -> torch.Tensor:
    # expand() broadcasts the row ids across columns without materialising a [k, width] copy.
    return indices.to(torch.int64).unsqueeze(1).expand(-1, width)


class IndexFirstAxis(torch.autograd.Function):
    """``x[indices]`` along dim 0, with a backward that scatters into zeros of ``x``'s shape."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1:
            raise ValueError("x must have at least one dimension to index along")
        _check_indices(indices)
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        rows = _as_rows(x)
        out = torch.gather(rows, 0, _row_index(indices, rows.shape[1]))
        return out.reshape(indices.shape[0], *x.shape[1:])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        rows = _as_rows(grad_output)
        grad_x = rows.new_zeros(ctx.first_axis_dim, rows.shape[1])
        # scatter_add rather than scatter: a row picked twice must receive both gradients.
        grad_x.scatter_add_(0, _row_index(indices, rows.shape[1]), rows)
        return grad_x.reshape(ctx.first_axis_dim, *grad_output.shape[1:]), None


class IndexPutFirstAxis(torch.autograd.Function):
    """Zeros of shape ``[first_axis_dim, ...]`` with rows ``indices`` set to ``values``.

    ``indices`` should be unique: with repeats, which value lands in a row is unspecified.
    """

    @staticmethod
    def forward(
        ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int
    ) -> torch.Tensor:
        _check_indices(indices)
        if values.dim() < 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"values must have one row per index: values shape {tuple(values.shape)}, "
                f"indices shape {tuple(indices.shape)}"
            )
        first_axis_dim = _check_size("first_axis_dim", first_axis_dim)
        ctx.save_for_backward(indices)
        rows = _as_rows(values)
        out = rows.new_zeros(first_axis_dim, rows.shape[1])
        out.scatter_(0, _row_index(indices, rows.shape[1]), rows)
        return out.reshape(first_axis_dim, *values.shape[1:])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        rows = _as_rows(grad_output)
        grad_values = torch.gather(rows, 0, _row_index(indices, rows.shape[1]))
        return grad_values.reshape(indices.shape[0], *grad_output.shape[1:]), None, None


index_first_axis = IndexFirstAxis.apply
index_put_first_axis = IndexPutFirstAxis.apply


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the valid tokens of a padded batch.

    Args:
        hidden_states: ``[B, S, ...]``.
        attention_mask: ``[B, S]``, bool or integer; nonzero marks a valid token. Valid tokens
            need not be contiguous or left-aligned: they are packed in their original order.

    Returns:
        ``(hidden_unpadded, indices, cu_seqlens, max_seqlen_in_batch, seqused)``:
        ``hidden_unpadded`` ``[total, ...]``; ``indices`` int64 ``[total]``, the positions of the
        valid tokens in the flattened ``[B * S]`` batch (what ``pad_input`` needs);
        ``cu_seqlens`` int32 ``[B + 1]``; ``max_seqlen_in_batch`` a Python int; ``seqused``
        int32 ``[B]``, the number of valid tokens per sequence.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise ValueError(f"attention_mask must be a 2-D [batch, seqlen] tensor, got shape {shape}")
    if hidden_states.dim() < 2 or hidden_states.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must match the first two dims "
            f"of hidden_states, got hidden_states shape {tuple(hidden_states.shape)}"
        )
    # Floating masks are refused because additive masks (0 for keep, -inf for drop) are common
    # and reading them as "nonzero = valid" would silently invert them.
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(f"attention_mask must be bool or integer, got {attention_mask.dtype}")

    valid = attention_mask != 0
    seqused = valid.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(rearrange(valid, "b s -> (b s)")).flatten()
    # The kernels index with int32 offsets; the leading 0 makes sequence i the slice
    # cu_seqlens[i]:cu_seqlens[i + 1].
    cu_seqlens = F.pad(torch.cumsum(seqused, dim=0, dtype=torch.int32), (1, 0))
    # .item() syncs with the device, but the kernels need max_seqlen on the host anyway.
    max_seqlen_in_batch = int(seqused.max().item()) if seqused.numel() > 0 else 0
    hidden_unpadded = index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices)
    return hidden_unpadded, indices, cu_seqlens, max_seqlen_in_batch, seqused


def pad_input(
    hidden_unpadded: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """Inverse of ``unpad_input``: scatter ``[total, ...]`` rows back to ``[batch, seqlen, ...]``.

    ``indices`` are positions in the flattened ``[batch * seqlen]`` batch, as returned by
    ``unpad_input``; every other position is zero.
    """
    _check_indices(indices)
    if hidden_unpadded.dim() < 1 or hidden_unpadded.shape[0] != indices.shape[0]:
        raise ValueError(
            f"hidden_unpadded must have one row per index: hidden_unpadded shape "
            f"{tuple(hidden_unpadded.shape)}, indices shape {tuple(indices.shape)}"
        )
    batch = _check_size("batch", batch)
    seqlen = _check_size("seqlen", seqlen)
    padded = index_put_first_axis(hidden_unpadded, indices, batch * seqlen)
    return rearrange(padded, "(b s) ... -> b s ...", b=batch, s=seqlen)
