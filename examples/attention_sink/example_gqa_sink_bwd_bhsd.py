"""Attention with sinks and a sliding window, GQA, BHSD: differentiable, TileLang on Hopper (SM90).

``attention(q, k, v, sinks, window_size, causal)`` computes what
example_gqa_sink_fwd_bhsd.py computes — softmax attention in which each query head has one extra
logit ``sinks[h]`` that joins every row's denominator but has no value, under a sliding window
``(left, right)`` — and is differentiable in ``q``, ``k``, ``v`` and ``sinks``. Its forward pass
is that script's persistent, warp-specialized kernel (imported from beside this file), which also
returns the row log-sum-exp ``lse`` with the sink included. The backward recomputes the
probabilities from ``lse``, FlashAttention-2 style, in four kernels:

1. preprocess: ``delta = rowsum(O ∘ dO)`` per query row;
2. the backward proper: a thread block holds a block of keys (K and V in shared memory, their
   ``dk``, ``dv`` in registers) and walks only the query blocks whose window reaches them
   (blocks entirely outside are skipped, not masked), forming ``Pᵀ = exp(K Qᵀ·scale − lse)``
   and ``dSᵀ = Pᵀ ∘ (V dOᵀ − delta)``. ``strategy`` picks which kernel:
   - ``group`` (the default on Hopper): the hand-scheduled kernel of
     examples/flash_attention/example_mha_bwd_wgmma_pipelined.py (imported from there; its
     ``window`` and ``layout="bhsd"`` arguments exist for this script). One thread block per
     (key block, kv head, batch) walks the query blocks of every query head of its group, so
     the group's dK and dV add up in registers; a producer warp loads by TMA and adds dQ with
     bulk reduce-adds;
   - ``atomic``: this script's own kernel on TileLang's automatic pipeline (the plain schedule
     of examples/flash_attention/example_gqa_bwd.py), one thread block per (key block, query
     head, batch) with ``window_query_blocks``; dQ and the group's dK/dV are float32 atomic
     adds;
3. postprocess: dQ back to the input dtype (``atomic``: dK and dV too, a cast);
4. ``dsinks[h] = −Σ_rows p_sink · delta`` with ``p_sink = exp(sinks[h] − lse)``: one thread
   block per head (``flashattn_bwd_sinks``).

A narrow window (bounded on both sides, at most 256 keys wide at D = 64 and 128 at D = 128:
``dq_pass_pays``) takes the ``group`` path in two kernels instead of 1–3, FlashAttention-2's
other order for dQ:

- the dQ pass (``flashattn_bwd_dq``, TileLang's automatic pipeline): a thread block per block of
  64 queries of one head sums their ``delta``, then walks the few key blocks of their window
  and keeps ``dQ = Σ dS K`` in registers, recomputing ``S`` and ``dP`` (three GEMMs a step),
  so dQ leaves in the input dtype: no float32 accumulator to zero, add into and convert, which
  on a narrow window costs more than the GEMMs it saves;
- the hand-scheduled kernel with ``with_dq=False``: dK and dV only, four GEMMs a step; at
  D = 64 on tiles of 64 keys and 64 queries, two thread blocks an SM (``dkdv_config``).

Why the sink changes nothing in 1–3: with ``lse`` including the sink, ``p_j = exp(s_j − lse)`` is
already each key's probability, and ``dS_j = p_j (dP_j − Σ_k p_k dP_k)`` where the sum runs over
the keys only (the sink has no value, so its ``dP`` is 0): ``Σ_k p_k dP_k = dO · O = delta``, as
without a sink. The sink's own gradient is ``p_sink (0 − delta)``, summed over the rows it
joined. A row that sees no key has ``lse = +inf``: ``p = 0`` everywhere, no gradient.

The ``atomic`` kernel is the plain lesson; with a window bounded on the left (two edges to
mask) ptxas spills 80–136 bytes in it (D = 64 and 128, S = 4096), while a window open on the
left spills nothing. The ``group`` kernel spills nothing with either edge.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, sinks=None, window_size=(-1, -1), causal=False, softmax_scale=None,
              strategy=None, config=None)

    q: (batch, nheads, seqlen_q, headdim), float16 or bfloat16, on a CUDA device;
        headdim 64 or 128.
    k, v: (batch, nheads_k, seqlen_k, headdim); nheads a multiple of nheads_k.
    sinks: (nheads,), float32, on q's device, or None; may require grad.
    window_size: (left, right), ints >= -1 (-1: unbounded); causal=True sets right = 0.
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    strategy: "group" or "atomic": which backward kernel (above); default
        ``default_strategy`` (group on Hopper).
    config: dict. That strategy's backward tiles; default ``default_config``.
    Returns out: (batch, nheads, seqlen_q, headdim), differentiable (``torch.autograd``).

In compiled code, ``attention`` calls the custom operator ``tl_attn::gqa_sink_bwd_bhsd_forward``
(``torch.library``), whose autograd formula calls ``tl_attn::gqa_sink_bwd_bhsd_backward``, so
``torch.compile(model, fullgraph=True)`` compiles a training step around it without a graph
break.
An eager call runs the same formula through ``EagerAttention`` (a plain
``torch.autograd.Function`` over the same functions), without the operators' dispatch.
The dQ pass's kernels and the dsinks kernel are settled once a shape (``dq_pass_plan``,
``sink_grad_entry``) and launched through their compiled entry points (the forward script's
``entry``): on a narrow window the host's work per call is comparable to the kernels' time.

Run:
    python examples/attention_sink/example_gqa_sink_bwd_bhsd.py --causal --window 128 0
    python examples/attention_sink/example_gqa_sink_bwd_bhsd.py --strategy atomic --window 64 64
    python examples/attention_sink/example_gqa_sink_bwd_bhsd.py --compile-only --arch sm_90a
"""

import functools
import math
import pathlib
import sys

import einops
import tilelang
import tilelang.language as T
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import example_gqa_sink_fwd_bhsd as fwd  # noqa: E402  (the sibling forward script)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "flash_attention"))
import example_mha_bwd_wgmma_pipelined as fast_bwd  # noqa: E402  (the hand-scheduled backward)

LOG2E = 1.4426950408889634
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
DQ_PASS_CONFIGS = {**PASS_CONFIGS, tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
HEAD_DIMS = fwd.HEAD_DIMS
ARCHS = ("sm_90a",)  # --arch: the forward is Hopper-only
STRATEGIES = ("group", "atomic")


# ----------------------------------------------------------------------------- window blocks
def window_query_blocks(bx, block_M, block_N, seq_q, seq_kv, left, right):
    """For key block ``bx`` (keys ``bx·block_M …``): ``(q_start, n_q, first_whole, end_whole)``.

    Query blocks ``q_start … q_start + n_q − 1`` hold a query whose window reaches a key of the
    block (query ``i`` sees key ``j`` when ``i + offset − left <= j <= i + offset + right``, that
    is ``j − offset − right <= i <= j − offset + left``); the others are skipped (the ragged last
    key block may visit one more, fully masked). At least one, fully masked when no query sees
    the block (then dk = dv = 0). Query blocks
    ``first_whole <= k < end_whole`` see every key of the block (and lie inside Sq): no mask."""
    offset = seq_kv - seq_q
    first_key = bx * block_M
    n_q_blocks = T.ceildiv(seq_q, block_N)
    lo = 0
    if right >= 0:
        lo = T.max(0, first_key - offset - right)
    hi = seq_q
    if left >= 0:
        # One past the last query whose window reaches the block's last key, (bx + 1)·block_M − 1
        # (not clipped to Sk − 1: the ragged last key block may visit a query block more, fully
        # masked; clipped, the expression trips TileLang 0.1.15's ThreadSync pass on some
        # shapes, e.g. D=64, Sq = Sk = 1000, window (64, 64)).
        hi = T.max(0, T.min(seq_q, (bx + 1) * block_M - offset + left))
    q_start = T.min(lo // block_N, n_q_blocks - 1)
    n_q = T.max(1, T.ceildiv(hi, block_N) - q_start)
    first_whole = 0  # from here on, the block's last key is within each query's right edge
    if right >= 0:
        first_whole = T.ceildiv(T.max(0, (bx + 1) * block_M - 1 - offset - right), block_N)
    end_whole = seq_q // block_N  # before here, its first key is within each query's left edge
    if left >= 0:
        end_whole = T.min(end_whole, T.max(0, first_key - offset + left + 1) // block_N)
    return q_start, n_q, first_whole, end_whole


# ----------------------------------------------------------------------------- backward kernels
@T.macro
def sum_delta(Output, dO, bz, by, row0, delta):
    # delta[i] = Σ_d O ∘ dO of rows row0 + i of head by, batch bz, into a float32 fragment.
    block, dim = delta.shape[0], Output.shape[3]
    o = T.alloc_fragment([block, dim], Output.dtype)
    do = T.alloc_fragment([block, dim], dO.dtype)
    prod = T.alloc_fragment([block, dim], "float32")
    T.copy(Output[bz, by, row0 : row0 + block, :], o)
    T.copy(dO[bz, by, row0 : row0 + block, :], do)
    for i, j in T.Parallel(block, dim):
        prod[i, j] = T.cast(o[i, j], "float32") * T.cast(do[i, j], "float32")
    T.reduce_sum(prod, delta, dim=1)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_preprocess(batch, heads, seq_q, dim, dtype="float16", block=64):
    """delta[b, h, i] = Σ_d O[b, h, i, d] · dO[b, h, i, d], in float32."""
    accum_dtype = "float32"
    shape = [batch, heads, seq_q, dim]

    @T.prim_func
    def flash_bwd_prep(
        Output: T.Tensor(shape, dtype),
        dO: T.Tensor(shape, dtype),
        Delta: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            delta = T.alloc_fragment([block], accum_dtype)
            sum_delta(Output, dO, bz, by, bx * block, delta)
            T.copy(delta, Delta[bz, by, bx * block : (bx + 1) * block])

    return flash_bwd_prep


def padded_rows(seq_q):
    """Rows of the float32 dQ accumulator: Sq rounded up to the 8-row groups of ``dq_layout``."""
    return (seq_q + 7) // 8 * 8


def dq_layout(dQ):
    """Physical layout of the float32 dQ accumulator [B, H, S, D]: what a warp's accumulator
    holds for one 8×8 tile in 32 consecutive floats (row ``s % 8``, column pair ``d % 8 // 2``),
    so each per-element atomic instruction of a warp touches one 128-byte line (as in
    examples/flash_attention/example_gqa_bwd.py; columns d and d + 1 lie 32 floats apart, so
    the atomics stay scalar)."""
    return T.Layout(
        dQ.shape,
        lambda b, h, s, d: [b, h, s // 8, d // 8, d % 2, 4 * (s % 8) + (d % 8) // 2],
    )


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim,
    window_left,  # -1 or >= 0, as normalised by fwd.normalize_window (causal: right = 0)
    window_right,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=64,
    num_stages=2,
    threads=256,
):
    """Gradients into float32 accumulators: dQ (``dq_layout``), dK/dV (one per kv head, the
    group's query heads adding into it).

    Computed transposed, keys along M, so that dk and dv are plain GEMM accumulators:
    ``acc_s = K Qᵀ`` [block_M keys × block_N queries] becomes ``Pᵀ = exp(acc_s·scale − lse)``;
    ``acc_dp = V dOᵀ`` (= dPᵀ); ``dv += Pᵀ dO``; ``ds = Pᵀ ⊙ (acc_dp − delta)·scale`` (= dSᵀ);
    ``dk += ds Q``; ``dq = dsᵀ K``.
    """
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E
    offset = seq_kv - seq_q  # bottom-right alignment of the window
    q_shape = [batch, heads, seq_q, dim]
    kv_shape = [batch, heads_kv, seq_kv, dim]

    @T.macro
    def mask(k, bx, acc_s):
        # Probabilities outside the window (or past Sq, Sk) become 0.
        for i, j in T.Parallel(block_M, block_N):
            key = bx * block_M + i
            query = k * block_N + j
            visible = key < seq_kv and query < seq_q
            if window_right >= 0:
                visible = visible and key <= query + offset + window_right
            if window_left >= 0:
                visible = visible and key >= query + offset - window_left
            acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], 0)

    @T.prim_func
    def flash_bwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        Delta: T.Tensor([batch, heads, seq_q], accum_dtype),
        dQ: T.Tensor([batch, heads, padded_rows(seq_q), dim], accum_dtype),
        dK: T.Tensor(kv_shape, accum_dtype),
        dV: T.Tensor(kv_shape, accum_dtype),
    ):
        # The head is the fastest-varying grid dimension (blockIdx.x): a group's query heads,
        # which read the same K/V block and add into the same dK/dV, run side by side and share
        # it in L2. The names keep their meaning: bx the key block, by the head, bz the batch.
        with T.Kernel(heads, T.ceildiv(seq_kv, block_M), batch, threads=threads) as (by, bx, bz):
            K_shared = T.alloc_shared([block_M, dim], dtype)
            V_shared = T.alloc_shared([block_M, dim], dtype)
            Q_shared = T.alloc_shared([block_N, dim], dtype)
            dO_shared = T.alloc_shared([block_N, dim], dtype)
            lse_shared = T.alloc_shared([block_N], accum_dtype)
            delta_shared = T.alloc_shared([block_N], accum_dtype)
            ds_shared = T.alloc_shared([block_M, block_N], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_dp = T.alloc_fragment([block_M, block_N], accum_dtype)
            ds_cast = T.alloc_fragment([block_M, block_N], dtype)
            dq = T.alloc_fragment([block_N, dim], accum_dtype)
            dk = T.alloc_fragment([block_M, dim], accum_dtype)
            dv = T.alloc_fragment([block_M, dim], accum_dtype)
            dk_shared = T.alloc_shared([block_M, dim], accum_dtype)
            dv_shared = T.alloc_shared([block_M, dim], accum_dtype)

            T.annotate_layout({dQ: dq_layout(dQ)})

            T.copy(K[bz, by // groups, bx * block_M : (bx + 1) * block_M, :], K_shared)
            T.copy(V[bz, by // groups, bx * block_M : (bx + 1) * block_M, :], V_shared)
            T.clear(dk)
            T.clear(dv)

            q_start, n_q, first_whole, end_whole = window_query_blocks(
                bx, block_M, block_N, seq_q, seq_kv, window_left, window_right
            )
            key_tail = (bx + 1) * block_M > seq_kv

            # Never empty (n_q >= 1), so the consumers always wait for the K/V tiles' loads.
            for k in T.Pipelined(q_start, q_start + n_q, num_stages=num_stages):
                T.copy(Q[bz, by, k * block_N : (k + 1) * block_N, :], Q_shared)
                T.gemm(
                    K_shared,
                    Q_shared,
                    acc_s,
                    transpose_B=True,
                    clear_accum=True,
                    policy=T.GemmWarpPolicy.FullRow,
                )
                T.copy(lse[bz, by, k * block_N : (k + 1) * block_N], lse_shared)
                # lse = +inf (a row with no key) gives P = exp2(-inf) = 0 and so dq = 0.
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale - lse_shared[j] * LOG2E)
                if key_tail or k < first_whole or k >= end_whole:
                    mask(k, bx, acc_s)

                T.copy(dO[bz, by, k * block_N : (k + 1) * block_N, :], dO_shared)
                T.gemm(
                    V_shared,
                    dO_shared,
                    acc_dp,
                    transpose_B=True,
                    clear_accum=True,
                    policy=T.GemmWarpPolicy.FullRow,
                )
                T.copy(acc_s, acc_s_cast)
                T.gemm(acc_s_cast, dO_shared, dv, policy=T.GemmWarpPolicy.FullRow)

                T.copy(Delta[bz, by, k * block_N : (k + 1) * block_N], delta_shared)
                for i, j in T.Parallel(block_M, block_N):
                    ds_cast[i, j] = acc_s[i, j] * (acc_dp[i, j] - delta_shared[j]) * softmax_scale
                T.gemm(ds_cast, Q_shared, dk, policy=T.GemmWarpPolicy.FullRow)

                # dq needs dsᵀ as an operand: through shared memory.
                T.copy(ds_cast, ds_shared)
                T.gemm(ds_shared, K_shared, dq, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(block_N, dim):
                    T.atomic_add(dQ[bz, by, k * block_N + i, j], dq[i, j])

            # One regional atomic per tile: the group's query heads meet in the same dK/dV.
            T.copy(dv, dv_shared)
            T.copy(dk, dk_shared)
            T.atomic_add(dV[bz, by // groups, bx * block_M : (bx + 1) * block_M, :], dv_shared)
            T.atomic_add(dK[bz, by // groups, bx * block_M : (bx + 1) * block_M, :], dk_shared)

    return flash_bwd


@tilelang.jit(pass_configs=DQ_PASS_CONFIGS)
def flashattn_bwd_dq(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    seq_q_pad,
    dim,
    window_left,  # -1 or >= 0, as normalised by fwd.normalize_window (causal: right = 0)
    window_right,
    softmax_scale,
    dtype="float16",
    block_M=64,
    block_N=64,
    num_stages=1,
    threads=128,
):
    """The query-major dQ pass of a narrow window, and the prep of the key-major pass after it.

    One thread block per (block_M queries, query head, batch): it sums ``delta = Σ_d O ∘ dO``
    for its rows, writes it and ``lse2 = lse · log2 e`` (padded to ``seq_q_pad`` rows: delta 0,
    lse2 +inf, the layout the hand-scheduled kernel reads), then walks the key blocks of its
    rows' windows (``window_key_blocks``, as the forward does) forming ``P = exp2(Q Kᵀ·scale −
    lse2)``, ``dP = dO Vᵀ`` and ``dS = P ∘ (dP − delta)``, and keeps ``dQ = scale · Σ dS K`` in
    registers: every contribution to its dQ rows is its own, so dQ leaves in the input dtype,
    with no float32 accumulator to zero, add into and convert.
    """
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E
    offset = seq_kv - seq_q
    q_shape = [batch, heads, seq_q, dim]
    kv_shape = [batch, heads_kv, seq_kv, dim]

    @T.macro
    def stats(Output, dO, Delta, lse2, lse_in, delta_shared, lse_shared, bx, by, bz):
        # delta and lse2 of the block's rows, to shared memory for the loop and to global
        # memory for the key-major pass. Rows past Sq: delta 0, lse2 +inf (P = 0).
        delta = T.alloc_fragment([block_M], accum_dtype)
        sum_delta(Output, dO, bz, by, bx * block_M, delta)
        for i in T.Parallel(block_M):
            row = bx * block_M + i
            real = row < seq_q
            delta_shared[i] = T.if_then_else(real, delta[i], 0)
            lse_shared[i] = T.if_then_else(real, lse_in[i] * LOG2E, T.infinity(accum_dtype))
            if row < seq_q_pad:
                Delta[bz, by, row] = delta_shared[i]
                lse2[bz, by, row] = lse_shared[i]

    @T.macro
    def probabilities(kb, bx, masked, acc_s, lse_shared):
        # P = exp2(S·scale − lse2); outside the window (or past Sk) the exponent is −inf. A
        # select on the exponent, not on exp2's result, keeps the loop branch-free.
        if masked:
            for i, j in T.Parallel(block_M, block_N):
                key = kb * block_N + j
                row = bx * block_M + i
                visible = key < seq_kv
                if window_right >= 0:
                    visible = visible and key <= row + offset + window_right
                if window_left >= 0:
                    visible = visible and key >= row + offset - window_left
                logit = acc_s[i, j] * scale - lse_shared[i]
                acc_s[i, j] = T.exp2(T.if_then_else(visible, logit, -T.infinity(accum_dtype)))
        else:
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale - lse_shared[i])

    @T.prim_func
    def flash_bwd_dq(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        Output: T.Tensor(q_shape, dtype),
        dO: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        dQ: T.Tensor(q_shape, dtype),
        Delta: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
        lse2: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q_pad, block_M), heads, batch, threads=threads) as (
            bx,
            by,
            bz,
        ):
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            dO_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([block_N, dim], dtype)
            V_shared = T.alloc_shared([block_N, dim], dtype)
            lse_in = T.alloc_shared([block_M], accum_dtype)
            lse_shared = T.alloc_shared([block_M], accum_dtype)
            delta_shared = T.alloc_shared([block_M], accum_dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_dp = T.alloc_fragment([block_M, block_N], accum_dtype)
            ds_cast = T.alloc_fragment([block_M, block_N], dtype)
            dq = T.alloc_fragment([block_M, dim], accum_dtype)
            dq_cast = T.alloc_fragment([block_M, dim], dtype)

            T.copy(lse[bz, by, bx * block_M : (bx + 1) * block_M], lse_in)
            T.copy(Q[bz, by, bx * block_M : (bx + 1) * block_M, :], Q_shared)
            T.copy(dO[bz, by, bx * block_M : (bx + 1) * block_M, :], dO_shared)
            stats(Output, dO, Delta, lse2, lse_in, delta_shared, lse_shared, bx, by, bz)
            T.clear(dq)

            n_start, n_blocks = fwd.window_key_blocks(
                bx, block_M, block_N, seq_q, seq_kv, window_left, window_right
            )
            n_left, n_inner_end = fwd.window_mask_runs(
                bx, n_start, n_blocks, block_M, block_N, seq_q, seq_kv, window_left, window_right
            )
            for n in T.Pipelined(n_blocks, num_stages=num_stages):
                kb = n_start + n
                T.copy(K[bz, by // groups, kb * block_N : (kb + 1) * block_N, :], K_shared)
                T.copy(V[bz, by // groups, kb * block_N : (kb + 1) * block_N, :], V_shared)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, clear_accum=True)
                T.gemm(dO_shared, V_shared, acc_dp, transpose_B=True, clear_accum=True)
                probabilities(kb, bx, n < n_left or n >= n_inner_end, acc_s, lse_shared)
                for i, j in T.Parallel(block_M, block_N):  # dS, in place of dP
                    acc_dp[i, j] = acc_s[i, j] * (acc_dp[i, j] - delta_shared[i])
                T.copy(acc_dp, ds_cast)
                T.gemm(ds_cast, K_shared, dq)

            for i, j in T.Parallel(block_M, dim):
                dq_cast[i, j] = dq[i, j] * softmax_scale
            T.copy(dq_cast, dQ[bz, by, bx * block_M : (bx + 1) * block_M, :])

    return flash_bwd_dq


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_postprocess(batch, heads, seq_q, dim, dtype="float16", block=64):
    """dQ: float32 in ``dq_layout`` → fp16/bf16 in plain BHSD."""
    accum_dtype = "float32"

    @T.prim_func
    def flash_bwd_post(
        dQ: T.Tensor([batch, heads, padded_rows(seq_q), dim], accum_dtype),
        dQ_out: T.Tensor([batch, heads, seq_q, dim], dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            T.annotate_layout({dQ: dq_layout(dQ)})
            T.copy(
                dQ[bz, by, bx * block : (bx + 1) * block, :],
                dQ_out[bz, by, bx * block : (bx + 1) * block, :],
            )

    return flash_bwd_post


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_sinks(batch, heads, seq_q, delta_len, threads=128, rows_per_thread=8):
    """dsinks[h] = −Σ_{b, i} exp(sinks[h] − lse[b, h, i]) · delta[b, h, i] (float32 [H]): one
    thread block per head. ``delta`` may be padded past ``seq_q`` rows (``delta_len``, the
    hand-scheduled backward's whole query blocks); rows with lse = +inf (no key) add 0.

    Four PyTorch operations compute the same (``ref_sink_grad``); on a narrow window, where
    the backward's kernels take a fraction of a millisecond, those four took more host time
    than the three attention kernels' launches together, so the sum is one kernel."""
    accum_dtype = "float32"
    chunk = threads * rows_per_thread  # rows a thread block loads at once

    @T.prim_func
    def flash_bwd_sinks(
        Sinks: T.Tensor([heads], accum_dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        Delta: T.Tensor([batch, heads, delta_len], accum_dtype),
        dSinks: T.Tensor([heads], accum_dtype),
    ):
        with T.Kernel(heads, threads=threads) as by:
            terms = T.alloc_fragment([chunk], accum_dtype)
            total = T.alloc_fragment([1], accum_dtype)
            T.clear(terms)
            for bz in T.serial(batch):
                for c in T.serial(T.ceildiv(seq_q, chunk)):
                    for i in T.Parallel(chunk):
                        row = c * chunk + i
                        if row < seq_q:
                            p_sink = T.exp(Sinks[by] - lse[bz, by, row])
                            terms[i] += p_sink * Delta[bz, by, row]
            T.reduce_sum(terms, total, dim=0)
            dSinks[by] = -total[0]

    return flash_bwd_sinks


def default_strategy(dim, arch="sm_90a"):
    """``group`` (the hand-scheduled backward) on Hopper for head dims 64 and 128, else
    ``atomic``."""
    return "group" if arch.startswith("sm_90") and dim in fast_bwd.HEAD_DIMS else "atomic"


def default_config(dim, arch="sm_90a", strategy="atomic"):
    """Backward tiles. ``group``: example_mha_bwd_wgmma_pipelined.py's ``default_config``
    (at window (128, 0), D=64, H64/Hkv8, S 4096 and 8192, bf16 — H100, 2026-11-23 — its 128
    queries a step beat 64 by 5-7%; two dQ tiles measured level with one).
    ``atomic`` (block_M keys per thread block, block_N queries a step): the dense GQA
    backward's for Dqk + Dv <= 256 (examples/flash_attention/example_gqa_bwd.py, measured there:
    128×64 tiles, 2 stages, 256 threads). Not measured with windows."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch {arch}: the forward of this script is written for Hopper (sm_90a)")
    if strategy == "group":
        return fast_bwd.default_config(dim, arch)
    return dict(block_M=128, block_N=64, num_stages=2, threads=256)


# The dQ pass's tiles: 64 queries and 64 keys a step, one warpgroup, no pipeline stage ahead
# (measured on an H100, 2026-11-24, window (128, 0), D 64 and 128, bf16: 64 keys a step beat
# 128 by 12-26% on the whole backward; two stages do not build with a run-time block count).
DQ_PASS_CONFIG = dict(block_M=64, block_N=64, num_stages=1, threads=128)


def dq_pass_pays(left, right, dim):
    """Whether the ``group`` backward takes the dQ pass (``flashattn_bwd_dq`` and the
    hand-scheduled kernel without dQ): a window bounded on both sides, at most 256 keys wide
    at D = 64 (where ``dkdv_config`` gives the dK/dV kernel its small tiles) and 128 at D = 128.

    Measured on an H100 (2026-11-24, bf16, causal windows, H64/Hkv8 unless stated; the whole
    backward as CUDA-graph replays, against the fused ordered-store kernel). The dK/dV kernel
    on its dense default tiles: window (128, 0) D64 S4096 1.20×, S8192 1.13×, D128 S8192
    1.06×; (64, 64) S1000 D64 1.06×; (256, 0) D64 1.02×, D128 0.99×; (512, 0) D64 0.96×;
    (1024, 0) D128 B2 H32 0.92×. With ``dkdv_config``'s tiles at D64 S8192: (192, 0) 1.24×,
    (256, 0) 1.06× (B8 S2048 1.09×), (384, 0) 0.99×. The pass recomputes Sᵀ and dPᵀ (three
    GEMMs where the fused kernel has one), which a wide window's long walks pay for; a narrow
    one's short walks spend more on the float32 dQ accumulator's traffic."""
    return left >= 0 and right >= 0 and left + right <= (256 if dim == 64 else 128)


def dkdv_config(dim, cfg):
    """The hand-scheduled kernel's tiles beside the dQ pass, from its dense default ``cfg``: at
    D = 64, 64 keys a thread block, 64 queries a step and two thread blocks an SM. A key block
    of b keys meets the queries of a window w keys wide in about b + w rows, so a tile computes
    b·(b + w) scores for b·(w + 1) it needs: 67% of them at b = 64 and w = 128, 50% at b = 128.
    D = 128 keeps its default: one warpgroup of 64 keys runs out of registers there.

    Measured on an H100 (2026-11-24, bf16, H64/Hkv8, the whole backward as CUDA-graph replays,
    against 128 keys and 128 queries a step): window (128, 0) S4096 1.06×, S8192 1.08×; at
    (64, 64) S1000, whose small grid takes 64 keys and 128 queries a step, 1.63×. The same
    64 × 64 tiles one thread block an SM: 0.92–0.94×; 64 keys and 128 queries two an SM:
    1.01–1.02×."""
    if dim != 64:
        return cfg
    return {**cfg, "block_M": 64, "block_N": 64, "ctas_per_sm": 2}


def dq_pass_kernels(B, H, Hkv, Sq, Sk, D, left, right, softmax_scale, dtype, cfg):
    """The dQ pass's kernels, name → (factory, arguments, keyword arguments), in launch order:
    ``flashattn_bwd_dq`` (delta, lse2 and dQ), then the hand-scheduled kernel with ``cfg``
    (``dkdv_config`` of its default) and ``with_dq=False`` (dK, dV), and with ``head_splits``
    > 1 the sum of its float32 parts."""
    seq_q_pad = fast_bwd.padded_len(Sq, cfg["block_N"])
    dq_args = (B, H, Hkv, Sq, Sk, seq_q_pad, D, left, right, softmax_scale, dtype)
    kv_args = (B, H, Sq, Sk, D, False, softmax_scale, dtype)
    # (the dK/dV-only launch keeps its grid order: ``interleave`` is for the launches with dQ)
    kv_kw = {**cfg, "groups": H // Hkv, "window": (left, right), "layout": "bhsd", "interleave": 1}
    kernels = {
        "flash_bwd_dq": (flashattn_bwd_dq, dq_args, DQ_PASS_CONFIG),
        "flash_bwd_dkdv": (fast_bwd.flash_bwd, kv_args, {**kv_kw, "with_dq": False}),
    }
    splits = cfg.get("head_splits", 1)
    if splits > 1:
        post_args = (B, H, Sk, D, H // Hkv, splits, dtype)
        kernels["flash_bwd_post_kv"] = (fast_bwd.flash_bwd_post_kv, post_args, {"layout": "bhsd"})
    return kernels


@functools.lru_cache(maxsize=256)
def dq_pass_plan(B, H, Hkv, Sq, Sk, D, window, softmax_scale, dtype, config, device):
    """What every dQ-pass backward of one shape shares, settled on its first call: the tiles
    (``config``: the caller's as sorted (key, value) pairs, or None for ``dkdv_config``),
    delta's padded length and the ``entry`` of each kernel of ``dq_pass_kernels``, in launch
    order. Settling them on every call (the device's SM count, the tiles, three kernel
    lookups) took more host time than the launches."""
    if config:
        cfg = dict(config)
    else:  # the default, for this grid (as run_backward chooses it)
        cfg = dkdv_config(D, fast_bwd.grid_config(D, B, H, Hkv, Sk, False, window, device))
    seq_q_pad = fast_bwd.padded_len(Sq, cfg["block_N"])
    kernels = dq_pass_kernels(B, H, Hkv, Sq, Sk, D, *window, softmax_scale, dtype, cfg)
    entries = {name: fwd.entry(f(*args, **kw)) for name, (f, args, kw) in kernels.items()}
    return cfg, seq_q_pad, entries


def run_backward_dq_pass(dout, q, k, v, out, lse, softmax_scale, config, window):
    """The ``group`` backward of a narrow window (``dq_pass_pays``): ``dq, dk, dv`` and
    ``delta`` (float32 ``[B, H, Sq']``, Sq' padded to the hand-scheduled kernel's query blocks,
    rows past Sq 0), as ``run_backward`` returns them."""
    (B, H, Sq, D), (Hkv, Sk) = q.shape, k.shape[1:3]
    key = tuple(sorted(config.items())) if config else None
    cfg, seq_q_pad, entries = dq_pass_plan(
        B, H, Hkv, Sq, Sk, D, tuple(window), softmax_scale, fwd.dtype_name(q), key, q.device
    )
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    delta = torch.empty(B, H, seq_q_pad, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dk_out, dv_out = dk, dv
    if "flash_bwd_post_kv" in entries:  # each part's float32 dK, dV, summed after the kernel
        splits = cfg["head_splits"]
        dk_out = torch.empty(splits, *k.shape, dtype=torch.float32, device=q.device)
        dv_out = torch.empty(splits, *v.shape, dtype=torch.float32, device=q.device)
    launches = {
        "flash_bwd_dq": (q, k, v, out, dout, lse, dq, delta, lse2),
        "flash_bwd_dkdv": (q, k, v, dout, lse2, delta, dk_out, dv_out),
        "flash_bwd_post_kv": (dk_out, dv_out, dk, dv),
    }
    for name, launch in entries.items():
        launch(*launches[name])
    return dq, dk, dv, delta


# ----------------------------------------------------------------------------- torch-facing
def sink_grad(sinks, lse, delta):
    """dsinks (float32 [H]) by ``flashattn_bwd_sinks``, from the forward's ``lse [B, H, Sq]``
    and ``delta [B, H, Sq']`` (Sq' >= Sq: the rows past Sq are not read)."""
    B, H, Sq = lse.shape
    dsinks = torch.empty(H, dtype=torch.float32, device=lse.device)
    sink_grad_entry(B, H, Sq, delta.shape[2])(sinks, lse, delta, dsinks)
    return dsinks


@functools.lru_cache(maxsize=256)
def sink_grad_entry(B, H, Sq, delta_len):
    """``flashattn_bwd_sinks``'s ``entry`` for one shape, looked up once."""
    return fwd.entry(flashattn_bwd_sinks(B, H, Sq, delta_len))


def attention_forward(q, k, v, sinks, window_size, causal, softmax_scale):
    """example_gqa_sink_fwd_bhsd.py's persistent forward: ``out [B, H, Sq, D]`` and
    ``lse [B, H, Sq]`` (float32, natural log, the sink included). The sibling's plain function,
    not its ``attention``: that would check the input again and call its operator inside this
    script's, a second dispatch that adds nothing."""
    return fwd.attention_forward(q, k, v, sinks, window_size, causal, softmax_scale)


def attention_backward(
    dout, q, k, v, out, lse, sinks, window_size, causal, softmax_scale, config=None,
    strategy="atomic",
):  # fmt: skip
    """The backward kernels and ``sink_grad``: returns ``dq, dk, dv`` in the input dtype and
    ``dsinks`` (float32 [H], or None without sinks)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dtype = fwd.dtype_name(q)
    if q.numel() == 0 or k.numel() == 0:  # an empty sum: every gradient is 0
        dsinks = None if sinks is None else torch.zeros_like(sinks, dtype=torch.float32)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsinks
    left, right = fwd.normalize_window(window_size, causal, Sq, Sk)
    if strategy == "group" and dq_pass_pays(left, right, D):
        dq, dk, dv, delta = run_backward_dq_pass(
            dout, q, k, v, out, lse, softmax_scale, config, (left, right)
        )
        return dq, dk, dv, None if sinks is None else sink_grad(sinks, lse, delta)
    if strategy == "group":  # causal is in the window (right = 0)
        dq, dk, dv, delta = fast_bwd.run_backward(
            dout, q, k, v, out, lse, False, softmax_scale, config, (left, right), "bhsd"
        )
        return dq, dk, dv, None if sinks is None else sink_grad(sinks, lse, delta)
    cfg = config or default_config(D, fwd.device_arch(q.device))
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient

    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    flashattn_bwd_preprocess(B, H, Sq, D, dtype)(out, dout, delta)
    # dQ, dK and dV are sums of atomic adds: they start at zero.
    dq_acc = torch.zeros(B, H, padded_rows(Sq), D, dtype=torch.float32, device=q.device)
    dk_acc = torch.zeros(B, Hkv, Sk, D, dtype=torch.float32, device=q.device)
    dv_acc = torch.zeros(B, Hkv, Sk, D, dtype=torch.float32, device=q.device)
    kernel = flashattn_bwd(B, H, Hkv, Sq, Sk, D, left, right, softmax_scale, dtype, **cfg)
    kernel(q, k, v, dout, lse, delta, dq_acc, dk_acc, dv_acc)

    dq = torch.empty_like(q)
    flashattn_bwd_postprocess(B, H, Sq, D, dtype)(dq_acc, dq)
    dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype), dsinks


# torch.compile: the kernels as custom operators (docs/CONVENTIONS.md, "torch.compile"), as in
# examples/flash_attention/example_mha_bwd_bshd.py, with this family's two arguments: ``sinks``
# may be None (Tensor?) and the window travels as its two ints, as the caller gave them (the
# operators normalize it on the real lengths). A config (the backward tiles) travels as its
# values in CONFIG_KEYS order (an operator takes no dicts; None: the default). The forward
# operator runs example_gqa_sink_fwd_bhsd.py's plain attention_forward, never its operator.
# The strategy travels as a string, settled before the call (as in example_gqa_bwd.py); a
# config's keys depend on it.
CONFIG_KEYS = {
    "group": fast_bwd.CONFIG_KEYS,  # the hand-scheduled backward's
    "atomic": ("block_M", "block_N", "num_stages", "threads"),
}


@torch.library.custom_op("tl_attn::gqa_sink_bwd_bhsd_forward", mutates_args=())
def attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    window_size_left: int,
    window_size_right: int,
    causal: bool,
    softmax_scale: float,
    strategy: str,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = (window_size_left, window_size_right)
    return attention_forward(q, k, v, sinks, window, causal, softmax_scale)


@attention_forward_op.register_fake
def _(
    q, k, v, sinks, window_size_left, window_size_right, causal, softmax_scale, strategy, config
):  # fmt: skip
    B, H, Sq, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


# dsinks is None without sinks: a ``Tensor?`` output, which torch.library cannot infer from a
# type hint (an output's hint may not be Optional), so this operator spells out its schema.
@torch.library.custom_op(
    "tl_attn::gqa_sink_bwd_bhsd_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? sinks, "
    "SymInt window_size_left, SymInt window_size_right, bool causal, float softmax_scale, "
    "str strategy, SymInt[]? config) -> (Tensor, Tensor, Tensor, Tensor?)",
)
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    window_size_left: int,
    window_size_right: int,
    causal: bool,
    softmax_scale: float,
    strategy: str,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    cfg = dict(zip(CONFIG_KEYS[strategy], config, strict=True)) if config else None
    window = (window_size_left, window_size_right)
    return attention_backward(
        dout, q, k, v, out, lse, sinks, window, causal, softmax_scale, cfg, strategy
    )


@attention_backward_op.register_fake
def _(
    dout, q, k, v, out, lse, sinks, window_size_left, window_size_right, causal, softmax_scale,
    strategy, config,
):  # fmt: skip
    dsinks = None if sinks is None else q.new_empty(sinks.shape, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def setup_context(ctx, inputs, output):
    q, k, v, sinks, *settings = inputs  # the window's two ints, causal, scale, strategy, config
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)  # sinks may be None
    ctx.mark_non_differentiable(lse)  # a statistic for the backward; attention() returns out
    ctx.set_materialize_grads(False)  # backward never reads dlse: no zeros made for it
    ctx.settings = settings


def backward(ctx, dout, dlse):
    # dsinks is None when sinks is: the gradient autograd expects for a None input.
    dq, dk, dv, dsinks = attention_backward_op(dout, *ctx.saved_tensors, *ctx.settings)
    return dq, dk, dv, dsinks, None, None, None, None, None, None


attention_forward_op.register_autograd(backward, setup_context=setup_context)


class EagerAttention(torch.autograd.Function):
    """The formula above for eager calls, over the plain functions, without the operators'
    per-call dispatch (docs/CONVENTIONS.md, "Eager calls": why, and why ``forward`` takes
    ``ctx``)."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, sinks, left, right, causal, softmax_scale = inputs[:8]  # then strategy, config
        output = attention_forward(q, k, v, sinks, (left, right), causal, softmax_scale)
        setup_context(ctx, inputs, output)  # the operators' formula, as they run it
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not zeros
    def backward(ctx, dout, dlse):
        left, right, causal, softmax_scale, strategy, config = ctx.settings
        cfg = dict(zip(CONFIG_KEYS[strategy], config, strict=True)) if config else None
        dq, dk, dv, dsinks = attention_backward(
            dout, *ctx.saved_tensors, (left, right), causal, softmax_scale, cfg, strategy
        )
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def attention(
    q, k, v, sinks=None, window_size=(-1, -1), causal=False, softmax_scale=None, strategy=None,
    config=None,
):  # fmt: skip
    """Differentiable attention with sinks and a sliding window: ``q [B, H, Sq, D]``,
    ``k, v [B, Hkv, Sk, D]`` (fp16/bf16, CUDA), ``sinks [H]`` float32 or None → ``out
    [B, H, Sq, D]``; gradients for q, k, v and sinks. ``strategy`` ("group" or "atomic";
    default ``default_strategy``): which backward; ``config``: its tiles."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be None or one of {STRATEGIES}, got {strategy!r}")
    fwd._check_inputs(q, k, v, sinks, window_size, causal, softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if strategy is None:
        strategy = default_strategy(q.shape[-1], fwd.device_arch(q.device))
    window = [int(w) for w in window_size]  # (left, right): two int arguments of the operator
    q, k, v = (t.contiguous() for t in (q, k, v))
    sinks = sinks if sinks is None else sinks.contiguous()
    if strategy == "group":
        tiles = fast_bwd.config_values(config)
    else:
        tiles = [config[key] for key in CONFIG_KEYS[strategy]] if config else None
    # Compiled code (and fake tensors) call the operator; an eager call on real tensors runs the
    # same formula as a plain Function (EagerAttention), without the operator's dispatch.
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    apply = EagerAttention.apply if eager else attention_forward_op
    out, _ = apply(q, k, v, sinks, *window, causal, float(softmax_scale), strategy, tiles)
    return out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, sinks=None, window_size=(-1, -1), causal=False, softmax_scale=None):
    """Plain differentiable PyTorch in float32 (float64 stays float64; runs on CPU), same
    conventions as ``attention``: the sink as an extra logit column, dropped after the softmax."""
    acc = torch.promote_types(q.dtype, torch.float32)
    Sq, Sk = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    kf, vf = (einops.repeat(t.to(acc), "b h s d -> b (h g) s d", g=groups) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), kf) * scale
    visible = fwd.window_mask(Sq, Sk, window_size, causal, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.to(acc)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    # A row with nothing to weigh (no key, no sink) gives probabilities 0, not NaN.
    seen = torch.isfinite(scores).any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    return torch.einsum("bhqk,bhkd->bhqd", probs[..., :Sk], vf).to(q.dtype)


def ref_sink_grad(sinks, lse, delta):
    """What ``flashattn_bwd_sinks`` computes, in PyTorch: dsinks[h] = −Σ_{b, i}
    exp(sinks[h] − lse[b, h, i]) · delta[b, h, i] over the Sq rows of ``lse``."""
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    return -(p_sink * delta[:, :, : lse.shape[2]]).sum(dim=(0, 2))


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    # The forward script's flags (--window, --sinks, --groups, ...), without --tune: each
    # strategy has a single backward configuration.
    parser = fwd.build_parser(__doc__.splitlines()[0], tune=False)
    parser.add_argument(
        "--strategy", choices=STRATEGIES, help="which backward (default: group on Hopper)"
    )
    return parser


def compile_all(B, H, Hkv, Sq, Sk, D, window, dtype, arch="sm_90a", strategy="atomic"):
    """Build every kernel a training step runs (forward, preprocess, backward, postprocess,
    sinks) for ``arch`` without a GPU; returns {kernel name: CUDA source}."""
    harness = _harness()
    left, right = window
    scale = 1.0 / math.sqrt(D)
    fwd_cfg = fwd.default_config(D, window, arch, Sk)
    fwd_args = (B, H, Hkv, Sq, Sk, D, left, right, True, scale, dtype)
    kernels = {"flash_fwd": harness.compile_for(fwd.flashattn_fwd, arch, *fwd_args, **fwd_cfg)}
    cfg = default_config(D, arch, strategy)
    narrow = fwd.normalize_window(window, True, Sq, Sk)
    if strategy == "group" and dq_pass_pays(*narrow, D):
        built = dq_pass_kernels(B, H, Hkv, Sq, Sk, D, *narrow, scale, dtype, dkdv_config(D, cfg))
        for name, (factory, args, kwargs) in built.items():
            kernels[name] = harness.compile_for(factory, arch, *args, **kwargs)
    elif strategy == "group":
        built = fast_bwd.backward_kernels(
            Sq, Sk, D, False, scale, dtype, cfg, H // Hkv, (left, right), "bhsd"
        )
        for name, (factory, args, kwargs) in built.items():
            kernels[name] = harness.compile_for(factory, arch, B, H, *args, **kwargs)
    else:
        bwd_args = (B, H, Hkv, Sq, Sk, D, left, right, scale, dtype)
        kernels["flash_bwd_prep"] = harness.compile_for(
            flashattn_bwd_preprocess, arch, B, H, Sq, D, dtype
        )
        kernels["flash_bwd"] = harness.compile_for(flashattn_bwd, arch, *bwd_args, **cfg)
        kernels["flash_bwd_post"] = harness.compile_for(
            flashattn_bwd_postprocess, arch, B, H, Sq, D, dtype
        )
    # delta's rows: the group backward pads them to whole query blocks.
    delta_len = fast_bwd.padded_len(Sq, cfg["block_N"]) if strategy == "group" else Sq
    kernels["flash_bwd_sinks"] = harness.compile_for(flashattn_bwd_sinks, arch, B, H, Sq, delta_len)
    return {name: kernel.get_kernel_source() for name, kernel in kernels.items()}


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.groups < 1 or args.heads % args.groups != 0:
        parser.error(f"--groups ({args.groups}) must be positive and divide --heads ({args.heads})")
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Hkv = H // args.groups
    Sk = args.seq_len_k or Sq
    window = tuple(args.window)
    scale = 1.0 / math.sqrt(D)
    script = pathlib.Path(__file__).name
    what = (
        f"B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} window={window} causal={args.causal} "
        f"sinks={args.sinks} {args.dtype}"
    )

    if args.compile_only:
        norm = fwd.normalize_window(window, args.causal, Sq, Sk)
        strategy = args.strategy or default_strategy(D, args.arch)
        sources = compile_all(B, H, Hkv, Sq, Sk, D, norm, args.dtype, args.arch, strategy)
        print(f"{script}: built for {args.arch}, strategy {strategy} (window as built: {norm})")
        for name, src in sources.items():
            print(harness.describe_source(name, src))
        return

    harness.require_gpu(script, capability=(9, 0))
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype)
    sinks = torch.randn(H, device="cuda") * 2 if args.sinks else None
    dout = torch.randn_like(q)
    leaves = [t.requires_grad_() for t in (q, k, v) + ((sinks,) if args.sinks else ())]

    strategy = args.strategy or default_strategy(D, fwd.device_arch(q.device))
    if args.check:
        out = attention(q, k, v, sinks, window, args.causal, scale, strategy)
        grads = torch.autograd.grad(out, leaves, dout)
        print(f"check {what} strategy={strategy}")
        ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
        ref_sinks = ref_leaves[3] if args.sinks else None
        ref = ref_program(*ref_leaves[:3], ref_sinks, window, args.causal, scale)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
        harness.check_close("out", out, ref, rtol=1e-2)  # fp16/bf16 forward
        names = ["dq", "dk", "dv", "dsinks"][: len(leaves)]
        grads, ref_grads = (dict(zip(names, g, strict=True)) for g in (grads, ref_grads))
        harness.check_grads(grads, ref_grads)  # gradients: relative error under 2e-2

    if args.bench:  # both strategies side by side unless --strategy names one
        ours = {}
        for name in (args.strategy,) if args.strategy else STRATEGIES:
            out = attention(q, k, v, sinks, window, args.causal, scale, name)
            ours[f"tilelang {name}"] = lambda out=out: torch.autograd.grad(
                out, leaves, dout, retain_graph=True
            )
        flops = fwd.window_flops(B, H, Sq, Sk, D, window, args.causal) * 2.5
        harness.report(f"backward {what}", ours, {}, flops)


if __name__ == "__main__":
    main()
