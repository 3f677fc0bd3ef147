"""FlashAttention forward + backward, GQA, variable-length (packed) batches, with dQ accumulated by
TMA bulk reductions (Hopper, SM90).

A differentiable ``attention_varlen`` with FlashAttention's varlen conventions: ``q [total_q, H,
D]``, ``k, v [total_k, Hkv, D]`` packed back to back, ``cu_seqlens_q/k`` int32 ``[B + 1]``,
``max_seqlen_q/k``; query head ``h`` reads kv head ``h // groups``. Query and key lengths may
differ per sequence; ``bert_padding.unpad_input`` / ``pad_input`` get a padded batch with an
attention mask into this form and back, and gradients flow through both.

The forward is example_gqa_fwd_varlen.py's persistent, hand-scheduled kernel, imported from
beside this file; it also writes the row log-sum-exp ``lse`` (``[H, total_q]``, FlashAttention's
layout) for the backward. The backward is example_mha_bwd_wgmma_pipelined.py's hand-scheduled
Hopper backward (FlashAttention-3's schedule; read that script first), imported from beside this
file and run in its packed mode (``layout="thd"``). Per thread block of 128 keys of one kv head: a
producer warpgroup whose warp 0 loads K and V once and each step's Q (with lse) and dO (with
delta) by TMA into a ring of buffers guarded by mbarriers, and whose warp 1 adds each step's
float32 dQ tile into a global accumulator with one TMA bulk reduce-add
(``cp.reduce.async.bulk``), off the consumers' path; two consumer warpgroups, 64 keys each, dK
and dV in registers, asynchronous WGMMA. The thread block walks the query blocks of every
query head of its kv head's group, so the group's dK and dV add up in registers and leave by
plain row stores in the input dtype: no atomics, no float32 dK/dV to convert afterwards. The
dense example_gqa_bwd_tma_reduce.py shows the simpler form of the reduce-add, issued by the
consumers themselves in a loop TileLang pipelines.

What packed sequences change:

- the grid is ``(ceil(max_seqlen_k / 128), Hkv, B)``, the sequences heaviest first (a long
  sequence launched last would run on alone at the end). A thread block reads its sequence's
  offsets and lengths from ``cu_seqlens``; one whose key block lies past its sequence's keys
  leaves at once. The causal range of query blocks is the sequence's own (aligned bottom-right:
  query ``i`` sees key ``j`` when ``j <= i + seq_len_k - seq_len_q``); a sequence without
  queries walks none and writes dK = dV = 0 for its keys.
- Q, dO, K and V arrive by TMA at the sequence's packed row offset, so a box that runs past the
  sequence's end reads the next sequence's rows (past the last token, zeros). Keys there are
  masked (P = 0), as a dense batch masks keys past Sk. Queries there need no mask, because of
  the layout below.
- padded per-sequence tiles: the backward's per-query tensors — ``lse`` in log2 units,
  ``delta = rowsum(O ∘ dO)`` and the float32 dQ accumulator — are cut into tiles of
  ``block_N`` query rows, and sequence ``b``'s tiles start at tile ``cu_seqlens_q[b] // block_N
  + b``, past every earlier sequence's, so a query block of a sequence is a whole tile of its
  own. The preprocess writes ``lse`` +inf and ``delta`` 0 into each sequence's padding rows:
  the next sequence's rows in a query box get P = 0 and dS = 0 there without a mask, and the
  dQ reduce-add adds their exact zeros into this sequence's own padding, never into another
  sequence. The postprocess writes each tile's rows inside its sequence back as ``dq``.

``total_q``, ``total_k`` and ``B`` are dynamic dimensions (``T.dynamic``) and the max lengths
kernel arguments, so a new batch does not recompile. Rows that see no key give out 0, lse +inf
and dq 0. q, k and v share one head dim, 64 or 128.

API (FlashAttention's ``flash_attn_varlen_func`` conventions; docs/CONVENTIONS.md):

    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=False, softmax_scale=None, config=None)

    q: (total_q, nheads, headdim), float16 or bfloat16, on a CUDA device; headdim 64 or 128.
    k, v: (total_k, nheads_k, headdim), same dtype and device; nheads a multiple of nheads_k.
    cu_seqlens_q, cu_seqlens_k: (batch + 1,), int32, on q's device. Cumulative sequence
        lengths, starting at 0.
    max_seqlen_q, max_seqlen_k: int. At least the longest query / key sequence.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    config: dict. Backward tile configuration (block_M, block_N, num_stages, dq_stages);
        default ``default_config``.
    Returns out: (total_q, nheads, headdim), differentiable (``torch.autograd``).

In compiled code, ``attention_varlen`` calls the custom operator
``tl_attn::gqa_bwd_tma_reduce_varlen_forward`` (``torch.library``), which also reads and checks
the ``cu_seqlens`` values, and whose autograd formula calls
``tl_attn::gqa_bwd_tma_reduce_varlen_backward``, so ``torch.compile(model, fullgraph=True)``
compiles a training step around it without a graph break.
An eager call runs the same formula through ``EagerAttention`` (a plain
``torch.autograd.Function`` over the same functions), without the operators' dispatch.

Run:
    python examples/flash_attention/example_gqa_bwd_tma_reduce_varlen.py --groups 4 --causal
    python examples/flash_attention/example_gqa_bwd_tma_reduce_varlen.py --tune
    python examples/flash_attention/example_gqa_bwd_tma_reduce_varlen.py --compile-only  # no GPU
"""

import functools
import math
import numbers
import pathlib
import sys

import einops
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import example_gqa_fwd_varlen as fwd  # noqa: E402  (the persistent varlen forward)
import example_mha_bwd_wgmma_pipelined as fast_bwd  # noqa: E402  (the hand-scheduled backward)

HEAD_DIMS = (64, 128)
ARCHS = ("sm_90a",)  # --arch: Hopper only (TMA loads and reduce-adds, WGMMA)


# ----------------------------------------------------------------------------- configurations
def default_config(dim, arch="sm_90a"):
    """Backward tiles: example_mha_bwd_wgmma_pipelined.py's (``block_M`` keys a thread block,
    two consumer warpgroups of 64; ``block_N`` queries a step, also the padded tiles' rows;
    ``num_stages`` Q/dO buffers; ``dq_stages`` dQ tiles in shared memory), for both head dims,
    causal or not."""
    return fast_bwd.default_config(dim, arch)


def tune_configs(dim):
    """The space ``--tune`` compares: the fast backward's."""
    return fast_bwd.tune_configs(dim)


# ----------------------------------------------------------------------------- torch-facing
def device_arch(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def dtype_name(t):
    return "float16" if t.dtype == torch.float16 else "bfloat16"


# cu_seqlens' values read to the host once per tensor, and the checks on them: the forward's.
_host_values = fwd._host_values
_check_values = fwd._check_values


def _check_inputs(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
):
    """ValueError naming the first bad argument, from metadata alone (types, shapes, dtypes,
    devices), which torch.compile traces without a graph break; what needs cu_seqlens' values,
    and the CUDA check, is ``_check_values``."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    real = isinstance(softmax_scale, numbers.Real)
    if softmax_scale is not None and not (real and 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [total_tokens, heads, dim], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    _, H, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        got = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"q, k, v must share a dtype, float16 or bfloat16; got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k, v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] != D:
        raise ValueError(f"k must be [total_k, heads_kv, {D}] to match q, got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv}): H % Hkv != 0")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    integer = numbers.Integral | torch.SymInt  # SymInt: a length torch.compile made dynamic
    sides = ("q", cu_seqlens_q, max_seqlen_q), ("k", cu_seqlens_k, max_seqlen_k)
    for side, cu, max_seqlen in sides:
        name = f"cu_seqlens_{side}"
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:  # length 1: B = 0, an empty batch
            raise ValueError(f"{name} must be 1-D of length batch + 1 >= 1, got {tuple(cu.shape)}")
        if not cu.is_contiguous():  # TileLang's host code reads it as a dense array
            raise ValueError(f"{name} must be contiguous, got stride {cu.stride()}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {cu.device}")
        if cu.shape != cu_seqlens_q.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                f"{cu_seqlens_q.shape[0]} and {cu.shape[0]}"
            )
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, integer):
            raise ValueError(f"max_seqlen_{side} must be an int, got {type(max_seqlen).__name__}")


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale):
    """out ``[total_q, H, D]`` and lse ``[H, total_q]`` (natural log): example_gqa_fwd_varlen.py's
    persistent forward, with its own tiles."""
    return fwd.attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale
    )


def attention_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlens, causal, softmax_scale,
    config=None,
):  # fmt: skip
    """example_mha_bwd_wgmma_pipelined.py's three backward kernels on the packed sequences
    (preprocess, the hand-scheduled backward, postprocess; the module docstring); returns dq,
    dk, dv in the inputs' dtype. The sibling's plain function, not an operator (one operator
    inside another's implementation would dispatch twice, for nothing). The grid takes the
    sequences heaviest first (``_device_sequence_order``)."""
    max_seqlen_q, max_seqlen_k = max_seqlens
    cfg = config or default_config(q.shape[-1], device_arch(q.device))
    order = _device_sequence_order(
        tuple(_host_values(cu_seqlens_q)), tuple(_host_values(cu_seqlens_k)), causal,
        cfg["block_M"], cfg["block_N"], q.device,
    )  # fmt: skip
    return fast_bwd.run_backward_varlen(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        softmax_scale, cfg, order,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _device_sequence_order(cu_seqlens_q, cu_seqlens_k, causal, block_M, block_N, device):
    """``fast_bwd.sequence_order`` as an int32 tensor on ``device``, kept for the next call with
    the same lengths (a model's layers share one batch's ``cu_seqlens``)."""
    order = fast_bwd.sequence_order(cu_seqlens_q, cu_seqlens_k, causal, block_M, block_N)
    return torch.tensor(order, dtype=torch.int32, device=device)


# torch.compile: the kernels as custom operators (docs/CONVENTIONS.md, "torch.compile"), as in
# example_mha_bwd_bshd.py, with example_gqa_fwd_varlen.py's cu_seqlens reads: the checks that
# read them run in the forward operator's real implementation, never in traced code. Its
# autograd formula saves q, k, v, out, lse and both cu_seqlens, and
# calls the backward operator, which gets the config (backward tiles) in CONFIG_KEYS order.
CONFIG_KEYS = fast_bwd.CONFIG_KEYS  # the hand-scheduled backward's


@torch.library.custom_op("tl_attn::gqa_bwd_tma_reduce_varlen_forward", mutates_args=())
def attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale
    )


@attention_forward_op.register_fake
def _(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, config
):
    total_q, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(H, total_q, dtype=torch.float32)


@torch.library.custom_op("tl_attn::gqa_bwd_tma_reduce_varlen_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    return attention_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, (max_seqlen_q, max_seqlen_k),
        causal, softmax_scale, cfg,
    )  # fmt: skip


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, *settings):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.mark_non_differentiable(lse)  # a statistic for the backward; attention() returns out
    ctx.set_materialize_grads(False)  # backward never reads dlse: no zeros made for it
    ctx.settings = settings  # max_seqlen_q, max_seqlen_k, causal, softmax_scale, config


def backward(ctx, dout, dlse):
    dq, dk, dv = attention_backward_op(dout, *ctx.saved_tensors, *ctx.settings)
    return dq, dk, dv, None, None, None, None, None, None, None


attention_forward_op.register_autograd(backward, setup_context=setup_context)


class EagerAttention(torch.autograd.Function):
    """The formula above for eager calls, over the plain functions, without the operators'
    per-call dispatch (docs/CONVENTIONS.md, "Eager calls": why, and why ``forward`` takes
    ``ctx``)."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = inputs[:7]
        causal, softmax_scale = inputs[7:9]  # then the backward's config
        _check_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        output = attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale
        )
        setup_context(ctx, inputs, output)  # the operators' formula, as they run it
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not zeros
    def backward(ctx, dout, dlse):
        max_seqlen_q, max_seqlen_k, causal, softmax_scale, config = ctx.settings
        cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
        dq, dk, dv = attention_backward(
            dout, *ctx.saved_tensors, (max_seqlen_q, max_seqlen_k), causal, softmax_scale, cfg
        )
        return dq, dk, dv, None, None, None, None, None, None, None


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=False,
    softmax_scale=None,
    config=None,
):
    """Differentiable varlen GQA attention (FlashAttention's ``flash_attn_varlen_func``
    conventions): ``q [total_q, H, D]``, ``k, v [total_k, Hkv, D]`` (fp16/bf16, CUDA),
    ``cu_seqlens_q/k`` int32 ``[B + 1]`` on the same device, ``max_seqlen_q/k`` Python ints →
    ``out [total_q, H, D]``. ``config`` overrides the backward tiles (see ``default_config``).
    The inputs are validated, which reads each ``cu_seqlens`` tensor back to the host once
    (see ``_host_values``), inside the operator.
    """
    _check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
    )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    tiles = [config[key] for key in CONFIG_KEYS] if config else None
    # Compiled code (and fake tensors) call the operator; an eager call on real tensors runs the
    # same formula as a plain Function (EagerAttention), without the operator's dispatch.
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    apply = EagerAttention.apply if eager else attention_forward_op
    out, _ = apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        float(softmax_scale), tiles,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- references
def _dense_reference(q, k, v, causal, scale):
    """One sequence, ``q [Sq, H, D]``, ``k, v [Sk, Hkv, D]`` → out, lse ``[H, Sq]``."""
    groups = q.shape[1] // k.shape[1]
    # Each kv head serves `groups` consecutive query heads.
    k, v = (einops.repeat(t, "s h d -> s (h g) d", g=groups) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        Sq, Sk = q.shape[0], k.shape[0]
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (Sk - Sq), float("-inf"))
    # A row that sees no key gives probabilities 0 (softmax would give NaN): out 0, grads 0,
    # lse +inf (FlashAttention's convention).
    seen = torch.isfinite(scores).any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    out = torch.einsum("hqk,khd->qhd", probs, v)
    lse = torch.logsumexp(scores, dim=-1).detach()
    return out, lse.masked_fill(~seen[..., 0], float("inf"))


def ref_program(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=False,
    softmax_scale=None,
    return_lse=False,
):
    """Plain PyTorch in float32 (float64 stays float64; runs on CPU), same signature and
    conventions as ``attention_varlen`` (plus ``return_lse``: lse ``[H, total_q]``),
    differentiable: one dense attention per sequence, so memory stays bounded by the longest
    sequence."""
    del max_seqlen_q, max_seqlen_k  # only the kernel's grid needs them
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=acc, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[b : b + 2], bounds_k[b : b + 2]
        if q1 == q0 or k1 == k0:
            continue  # no queries, or no keys: out 0, lse +inf
        out[q0:q1], lse[:, q0:q1] = _dense_reference(
            q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc), causal, scale
        )
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def ref_padded(q, k, v, query_mask, key_mask, causal=False, softmax_scale=None):
    """Dense attention on a padded batch under its masks, the way a padded model computes it:
    ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``, masks ``[B, S]`` marking each sequence's valid
    tokens as a prefix. Padded keys are masked out; padded query rows give 0. Float32, one
    batch entry at a time so memory stays bounded."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    rows = torch.arange(q.shape[1], device=q.device)[:, None]
    cols = torch.arange(k.shape[1], device=q.device)[None, :]
    groups = q.shape[2] // k.shape[2]
    outs = []
    for b in range(q.shape[0]):
        kb, vb = (einops.repeat(t[b].to(acc), "s h d -> s (h g) d", g=groups) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[b].to(acc), kb) * scale
        visible = key_mask[b].bool()[None, :].expand(q.shape[1], -1)
        if causal:  # bottom-right within this sequence's own lengths
            diagonal = key_mask[b].sum() - query_mask[b].sum()
            visible = visible & (cols <= rows + diagonal)
        scores = scores.masked_fill(~visible, float("-inf"))
        seen = visible.any(dim=-1, keepdim=True)  # rows that see no key give 0, not NaN
        probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
        outs.append(torch.einsum("hqk,khd->qhd", probs, vb))
    out = torch.stack(outs) * query_mask[:, :, None, None]
    return out.to(q.dtype)


def reference_grads_padded(q, k, v, query_mask, key_mask, dout, causal, softmax_scale):
    """out, dq, dk, dv (float32, padded layout) from autograd through ``ref_padded``, one batch
    entry at a time so the score matrices stay bounded."""
    results = []
    for b in range(q.shape[0]):
        leaves = [t[b : b + 1].detach().float().requires_grad_() for t in (q, k, v)]
        masks = query_mask[b : b + 1], key_mask[b : b + 1]
        out = ref_padded(*leaves, *masks, causal=causal, softmax_scale=softmax_scale)
        grads = torch.autograd.grad(out, leaves, dout[b : b + 1].float())
        results.append((out.detach(), *grads))
    return [torch.cat(parts) for parts in zip(*results, strict=True)]


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def _bert_padding():
    """bert_padding.py at the repository root: padded batch + mask <-> packed tokens."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    import bert_padding

    return bert_padding


def build_parser():
    parser = _harness().base_parser(
        __doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS, seq_len=2048
    )
    parser.set_defaults(batch=8)
    parser.add_argument("--groups", type=int, default=4, help="query heads per kv head")
    parser.description += (
        ". Sequence lengths are drawn at random from 1..--seq_len (keys: 1..--seq_len_k, or the "
        "query lengths when it is not given); the batch holds a sequence of length 1 and one of "
        "the maximum."
    )
    return parser


def random_lengths(batch, max_len, generator):
    """Random lengths in 1..max_len, with 1 and max_len both present when batch >= 2."""
    lengths = torch.randint(1, max_len + 1, (batch,), generator=generator)
    if batch >= 2:
        lengths[0], lengths[-1] = 1, max_len
    return lengths


def padded_batch(batch, max_q, max_k, heads, heads_kv, dim, dtype, distinct_k, seed=0):
    """A padded batch with random lengths: q/k/v/dout ``[B, S, H, D]`` (normal values, zeros in
    the padding) and their masks ``[B, S]`` (valid tokens first)."""
    g = torch.Generator().manual_seed(seed)
    len_q = random_lengths(batch, max_q, g)
    len_k = random_lengths(batch, max_k, g) if distinct_k else len_q
    mask_q = torch.arange(max_q)[None, :] < len_q[:, None]
    mask_k = torch.arange(max_k)[None, :] < len_k[:, None]
    q = torch.randn(batch, max_q, heads, dim, generator=g) * mask_q[..., None, None]
    k = torch.randn(batch, max_k, heads_kv, dim, generator=g) * mask_k[..., None, None]
    v = torch.randn(batch, max_k, heads_kv, dim, generator=g) * mask_k[..., None, None]
    dout = torch.randn(batch, max_q, heads, dim, generator=g) * mask_q[..., None, None]
    return [t.to("cuda", dtype) for t in (q, k, v, dout)], mask_q.cuda(), mask_k.cuda()


def check(q_pad, k_pad, v_pad, dout_pad, mask_q, mask_k, causal, scale, config=None):
    """The user's path end to end: padded batch → ``unpad_input`` → kernels → ``pad_input``,
    gradients back through both, against autograd through ``ref_padded`` (fp16/bf16 tolerances:
    out 1e-2, gradients 2e-2, relative)."""
    harness, bp = _harness(), _bert_padding()
    B, Sq = q_pad.shape[:2]
    leaves = [t.detach().requires_grad_() for t in (q_pad, k_pad, v_pad)]
    q, indices_q, cu_seqlens_q, max_seqlen_q, _ = bp.unpad_input(leaves[0], mask_q)
    k, _, cu_seqlens_k, max_seqlen_k, _ = bp.unpad_input(leaves[1], mask_k)
    v = bp.unpad_input(leaves[2], mask_k)[0]
    out = attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, config
    )
    out_pad = bp.pad_input(out, indices_q, B, Sq)
    grads = torch.autograd.grad(out_pad, leaves, dout_pad)
    ref = reference_grads_padded(q_pad, k_pad, v_pad, mask_q, mask_k, dout_pad, causal, scale)
    harness.check_close("out", out_pad, ref[0], rtol=1e-2)  # fp16/bf16 forward
    harness.check_grads(dict(zip(("dq", "dk", "dv"), grads, strict=True)), dict(
        zip(("dq", "dk", "dv"), ref[1:], strict=True)
    ))  # fmt: skip


def benchmark(q_pad, k_pad, v_pad, dout_pad, mask_q, mask_k, causal, scale, configs):
    """Ours on the packed batch — forward+backward and backward alone, one row per entry of
    ``configs`` (name → backward config, None for ``default_config``) — beside SDPA FLASH (FA2)
    and cuDNN on the padded equivalent (all of it, padding included: what a padded model runs).
    TFLOP/s count the packed batch's useful FLOPs for every row, so they compare as times.
    Returns the rows of both reports: {"fwd+bwd": [...], "bwd": [...]}."""
    harness, bp = _harness(), _bert_padding()
    H, D = q_pad.shape[2:]
    q, _, cu_seqlens_q, max_seqlen_q, _ = bp.unpad_input(q_pad, mask_q)
    k, _, cu_seqlens_k, max_seqlen_k, _ = bp.unpad_input(k_pad, mask_k)
    v, dout = bp.unpad_input(v_pad, mask_k)[0], bp.unpad_input(dout_pad, mask_q)[0]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    varlen = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    fwd_bwd, bwd = {}, {}
    for name, cfg in configs.items():
        out = attention_varlen(*varlen, cfg)  # graph kept for backward alone
        fwd_bwd[name] = lambda c=cfg: torch.autograd.grad(
            attention_varlen(*varlen, c), (q, k, v), dout
        )
        bwd[name] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    peers_fwd_bwd, peers_bwd = harness.sdpa_backward_peers(
        q_pad, k_pad, v_pad, dout_pad, causal, scale
    )
    fwd = harness.varlen_flops(cu_seqlens_q, cu_seqlens_k, H, D, D, causal)
    bwd_flops = harness.varlen_flops(cu_seqlens_q, cu_seqlens_k, H, D, D, causal, backward=True)
    shape = (
        f"B{q_pad.shape[0]} H{H} Hkv{k_pad.shape[2]} max {q_pad.shape[1]}/{k_pad.shape[1]} "
        f"D{D} causal={causal} {str(q.dtype)[6:]} ({q.shape[0]} tokens)"
    )
    return {
        "fwd+bwd": harness.report(
            f"varlen forward+backward {shape}", fwd_bwd, peers_fwd_bwd, fwd + bwd_flops
        ),
        "bwd": harness.report(f"varlen backward {shape}", bwd, peers_bwd, bwd_flops),
    }


def compile_all(heads, heads_kv, dim, causal, dtype, arch, config=None):
    """Build every kernel a forward + backward runs, for ``arch`` without a GPU; returns
    name → CUDA source. (total_q, total_k and the batch are dynamic: no shape needed.)"""
    harness = _harness()
    scale = 1.0 / math.sqrt(dim)
    cfg = config or default_config(dim, arch)
    attn = (heads, heads_kv, dim, causal, scale, dtype)
    fwd_cfg = fwd.default_config(dim, arch, causal)
    sources = {
        "flashattn_fwd_varlen": harness.compile_for(
            fwd.flashattn_fwd_varlen, arch, *attn, **fwd_cfg
        ).get_kernel_source(),
        # the forward's merge of the tiles walked in parts, when a batch has them
        "flashattn_fwd_varlen_combine": harness.compile_for(
            fwd.flashattn_fwd_varlen_combine, arch, heads, dim, dtype, fwd_cfg["block_M"]
        ).get_kernel_source(),
    }
    # The backward's kernels in their packed mode: no batch, no lengths (dynamic).
    backward = fast_bwd.backward_kernels(
        None, None, dim, causal, scale, dtype, cfg, heads // heads_kv, layout="thd"
    )  # fmt: skip
    for name, (fn, args, kw) in backward.items():
        sources[name] = harness.compile_for(fn, arch, None, heads, *args, **kw).get_kernel_source()
    return sources


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.groups < 1 or args.heads % args.groups != 0:
        parser.error(f"--groups ({args.groups}) must be positive and divide --heads ({args.heads})")
    B, H, D = args.batch, args.heads, args.dim
    Hkv = H // args.groups
    Sq = args.seq_len
    Sk = args.seq_len_k or Sq
    scale = 1.0 / math.sqrt(D)
    script = pathlib.Path(__file__).name

    if args.compile_only:
        sources = compile_all(H, Hkv, D, args.causal, args.dtype, args.arch)
        cfg = default_config(D, args.arch)
        print(f"{script}: built for {args.arch}, backward tiles {cfg} (total/batch dynamic)")
        for name, src in sources.items():
            print(harness.describe_source(name, src))
        return

    harness.require_gpu(script, capability=(9, 0))
    dtype = harness.DTYPES[args.dtype]
    tensors, mask_q, mask_k = padded_batch(
        B, Sq, Sk, H, Hkv, D, dtype, distinct_k=args.seq_len_k is not None
    )
    print(
        f"B{B} H{H} Hkv{Hkv} D{D} causal={args.causal} {args.dtype}: query lengths "
        f"{mask_q.sum(-1).tolist()}, key lengths {mask_k.sum(-1).tolist()}"
    )
    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest backward is checked.
        named = {_config_name(c): c for c in tune_configs(D)}
        rows = benchmark(*tensors, mask_q, mask_k, args.causal, scale, named)
        config = named[harness.fastest(rows["bwd"])]
        print(f"tuned: {config}")
    if args.check:
        check(*tensors, mask_q, mask_k, args.causal, scale, config)
    if args.bench and not args.tune:
        benchmark(
            *tensors, mask_q, mask_k, args.causal, scale, {"tilelang varlen[tma-reduce]": config}
        )


def _config_name(cfg):
    return "varlen {block_M}x{block_N}/{num_stages}st/{dq_stages}dq".format(**cfg)


if __name__ == "__main__":
    main()
