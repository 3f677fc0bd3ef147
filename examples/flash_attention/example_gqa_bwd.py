"""FlashAttention backward, grouped-query attention (GQA), BSHD layout, TileLang on Hopper (SM90).

A differentiable ``attention(q, k, v)`` for ``q [B, Sq, H, Dqk]``, ``k [B, Sk, Hkv, Dqk]``,
``v [B, Sk, Hkv, Dv]``: query head ``h`` reads kv head ``h // groups`` (``groups = H / Hkv``), and
``Dqk`` may differ from ``Dv`` (192/128 as in DeepSeek-style MLA training). The forward saves the
row log-sum-exp ``lse``; the backward recomputes the probabilities from it, FlashAttention-2 style.

What is particular to GQA is that a kv head's dK and dV are sums over the ``groups`` query
heads that read it. ``strategy`` picks where that sum is made:

- ``group`` (the default where it builds: Hopper, head dims 64/64 and 128/128): one thread block
  per (key block, kv head) walks the query blocks of every head of its group in turn, so the
  sum is made in its registers — no atomics, no partials. This is the hand-scheduled backward
  of example_mha_bwd_wgmma_pipelined.py (its ``flash_bwd`` takes ``groups``), imported from
  beside this file rather than copied: read that script for the schedule.
- ``atomic`` and ``split`` run this script's own kernels, on TileLang's automatic pipeline, one
  thread block per (key block, query head):
  1. ``flashattn_bwd_preprocess``: ``delta = rowsum(O · dO)`` per query row.
  2. ``flashattn_bwd``: keeps its key block's K and V in shared memory and its ``dk``/``dv`` in
     registers, streams the query blocks through (TMA loads, WGMMA), and adds each query
     block's ``dq`` into a float32 ``dQ`` with atomics. At the end, ``atomic``: every group
     member adds its ``dk``/``dv`` into a float32 dK/dV with one regional ``T.atomic_add`` (a
     whole tile, vectorized 4 floats at a time on SM90); ``split``: every member writes its own
     float32 partial (no atomics, ``groups`` times the memory).
  3. ``flashattn_bwd_postprocess`` (dQ back to fp16/bf16) and ``flashattn_bwd_postprocess_kv``
     (sum the float32 dK/dV partials — one for ``atomic`` — and only then cast).
  They also cover what ``group`` does not: head dims 192/128, and GPUs other than Hopper.

``group`` has ``groups`` times fewer thread blocks than the others, each ``groups`` times
longer; with a few thousand keys per sequence there are still many per SM. The README
("Backward") has the three measured side by side.

The float32 dQ accumulator has an annotated layout (``dq_layout``): a GEMM accumulator gives each
thread two neighbouring columns of an 8×8 tile, and the layout places what a warp holds for one
8×8 tile in 32 consecutive floats, so each per-element atomic instruction of a warp touches one
128-byte line (example_gqa_bwd_tma_reduce.py replaces these atomics by TMA bulk reductions).
Under this layout columns ``d`` and ``d + 1`` of a row lie 32 floats apart, so an atomic add
that vectorized them together would be wrong: the dQ atomics stay scalar, one per element at
its laid-out address (the ``atomic`` strategy's dK/dV, in a plain layout, are vectorized).

The forward is example_gqa_fwd_bshd.py's persistent warp-specialized kernel (imported, as the
backward above) on Hopper with equal head dims; this script's own ``flashattn_fwd``
(T.Pipelined) runs for 192/128 and off Hopper.

Causal masking is aligned bottom-right (as FlashAttention ≥ 2.1): query ``i`` sees key ``j`` when
``j <= i + Sk - Sq``. Rows that see no key give out 0, lse +inf and dq 0; an empty batch or
sequence launches nothing.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None, strategy=None, config=None)

    q: (batch, seqlen_q, nheads, headdim_qk), float16 or bfloat16, on a CUDA device.
    k: (batch, seqlen_k, nheads_k, headdim_qk); v: (batch, seqlen_k, nheads_k, headdim_v);
        nheads a multiple of nheads_k; (headdim_qk, headdim_v) one of ``HEAD_DIMS``
        (64/64, 128/128, 192/128).
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim_qk).
    strategy: "group", "atomic" or "split". How a group's dK/dV are summed (above); default
        ``default_strategy`` (group where it builds, else atomic).
    config: dict. Backward tile configuration for that strategy (group: block_M, block_N,
        num_stages, dq_stages and optionally head_splits; atomic, split: block_M, block_N,
        num_stages, threads); default ``default_config``, which for group also fits the tiles
        and head_splits to the grid (small grids: 64 keys a thread block at D64, a group's
        heads shared out over thread blocks).
    Returns out: (batch, seqlen_q, nheads, headdim_v), differentiable (``torch.autograd``).

In compiled code, ``attention`` calls the custom operator ``tl_attn::gqa_bwd_forward``
(``torch.library``), whose autograd formula calls ``tl_attn::gqa_bwd_backward``, so
``torch.compile(model, fullgraph=True)`` compiles a training step around it without a graph
break; ``strategy`` is settled before the call and travels as a string.
An eager call runs the same formula through ``EagerAttention`` (a plain
``torch.autograd.Function`` over the same functions), without the operators' dispatch.

Run:
    python examples/flash_attention/example_gqa_bwd.py --groups 4 --causal
    python examples/flash_attention/example_gqa_bwd.py --groups 4 --causal --strategy split
    python examples/flash_attention/example_gqa_bwd.py --compile-only --arch sm_90a  # no GPU
"""

import math
import numbers
import pathlib
import sys

import einops
import tilelang
import tilelang.language as T
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# Sibling scripts: the persistent forward, and the hand-scheduled backward ("group").
import example_gqa_fwd_bshd as fast_fwd  # noqa: E402
import example_mha_bwd_wgmma_pipelined as fast_bwd  # noqa: E402

LOG2E = 1.4426950408889634
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
HEAD_DIMS = ((64, 64), (128, 128), (192, 128))  # (Dqk, Dv) pairs this script builds
ARCHS = ("sm_90a", "sm_80", "sm_89", "sm_100a")  # --arch; off Hopper, the generic tiles build
STRATEGIES = ("group", "atomic", "split")
GROUP_DIMS = ((64, 64), (128, 128))  # the head dims the hand-scheduled ("group") backward builds


# ----------------------------------------------------------------------------- forward kernel
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim_qk,
    dim_v,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=128,
    num_stages=1,
    threads=256,
):
    """The GQA online-softmax forward (T.Pipelined), with separate Q/K and V head dims."""
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    offset = seq_kv - seq_q  # bottom-right causal alignment
    neg_inf = -T.infinity(accum_dtype)

    # The steps of one key block and the epilogue, named. T.macro is inlined: the generated
    # CUDA is the same as with the steps written out in the loop.
    @T.macro
    def scores(Q_shared, K_shared, acc_s):
        # S = Q Kᵀ of one key block.
        T.gemm(
            Q_shared,
            K_shared,
            acc_s,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )

    @T.macro
    def mask(k, first_masked, bx, acc_s):
        if k >= first_masked:
            for i, j in T.Parallel(block_M, block_N):
                key = k * block_N + j
                visible = key < seq_kv
                if causal:
                    visible = visible and key <= bx * block_M + i + offset
                acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], neg_inf)

    @T.macro
    def softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum):
        # Online softmax: new row max, and the factor that rescales what came before.
        T.copy(scores_max, scores_max_prev)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            # max stays -inf while a row has seen no key; 0 keeps exp2 away from NaN
            scores_max[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i])
            scores_scale[i] = T.exp2(scores_max_prev[i] * scale - scores_max[i] * scale)
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale - scores_max[i] * scale)
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def rescale(acc_o, scores_scale):
        for i, j in T.Parallel(block_M, dim_v):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def pv(acc_s_cast, V_shared, acc_o):
        # O += P V of one key block.
        T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz):
        # Rows with no visible key (logsum = 0): O = 0 and lse = +inf.
        for i, j in T.Parallel(block_M, dim_v):
            acc_o[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
        T.copy(acc_o, O_shared)
        T.copy(O_shared, Output[bz, bx * block_M : (bx + 1) * block_M, by, :])
        for i in T.Parallel(block_M):
            if bx * block_M + i < seq_q:
                lse[bz, by, bx * block_M + i] = T.if_then_else(
                    logsum[i] > 0,
                    (T.log2(logsum[i]) + scores_max[i] * scale) / LOG2E,
                    T.infinity(accum_dtype),
                )

    @T.prim_func
    def flash_fwd(
        Q: T.Tensor([batch, seq_q, heads, dim_qk], dtype),
        K: T.Tensor([batch, seq_kv, heads_kv, dim_qk], dtype),
        V: T.Tensor([batch, seq_kv, heads_kv, dim_v], dtype),
        Output: T.Tensor([batch, seq_q, heads, dim_v], dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([block_M, dim_qk], dtype)
            K_shared = T.alloc_shared([block_N, dim_qk], dtype)
            V_shared = T.alloc_shared([block_N, dim_v], dtype)
            O_shared = T.alloc_shared([block_M, dim_v], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim_v], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)

            T.copy(Q[bz, bx * block_M : (bx + 1) * block_M, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, neg_inf)

            # Only the ragged tail block and, when causal, the diagonal blocks need a mask.
            n_blocks = T.ceildiv(seq_kv, block_N)
            first_masked = seq_kv // block_N
            if causal:
                last_key = (bx + 1) * block_M + offset  # one past the last key this block sees
                # At least one (fully masked) block even when no row here sees a key (Sq > Sk):
                # the loop is where the consumers wait for the Q tile's TMA load, and a load
                # still in flight at exit could land on O_shared.
                n_blocks = T.max(1, T.min(n_blocks, T.ceildiv(last_key, block_N)))
                first_masked = T.min(first_masked, T.max(0, (bx * block_M + offset) // block_N))

            for k in T.Pipelined(n_blocks, num_stages=num_stages):
                T.copy(K[bz, k * block_N : (k + 1) * block_N, by // groups, :], K_shared)
                scores(Q_shared, K_shared, acc_s)
                mask(k, first_masked, bx, acc_s)
                softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                T.copy(acc_s, acc_s_cast)
                rescale(acc_o, scores_scale)

                T.copy(V[bz, k * block_N : (k + 1) * block_N, by // groups, :], V_shared)
                pv(acc_s_cast, V_shared, acc_o)

            epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz)

    return flash_fwd


# ----------------------------------------------------------------------------- backward kernels
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_preprocess(batch, heads, seq_q, dim_v, dtype="float16", block=64):
    """delta[b, h, i] = Σ_d O[b, i, h, d] · dO[b, i, h, d], in float32."""
    accum_dtype = "float32"
    shape = [batch, seq_q, heads, dim_v]

    @T.prim_func
    def flash_bwd_prep(
        Output: T.Tensor(shape, dtype),
        dO: T.Tensor(shape, dtype),
        Delta: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            o = T.alloc_fragment([block, dim_v], dtype)
            do = T.alloc_fragment([block, dim_v], dtype)
            acc = T.alloc_fragment([block, dim_v], accum_dtype)
            delta = T.alloc_fragment([block], accum_dtype)
            T.copy(Output[bz, bx * block : (bx + 1) * block, by, :], o)
            T.copy(dO[bz, bx * block : (bx + 1) * block, by, :], do)
            for i, j in T.Parallel(block, dim_v):
                acc[i, j] = T.cast(o[i, j], accum_dtype) * T.cast(do[i, j], accum_dtype)
            T.reduce_sum(acc, delta, dim=1)
            T.copy(delta, Delta[bz, by, bx * block : (bx + 1) * block])

    return flash_bwd_prep


def padded_rows(seq_q):
    """Rows of the float32 dQ accumulator: Sq rounded up to the 8-row groups of ``dq_layout``."""
    return (seq_q + 7) // 8 * 8


def dq_layout(dQ):
    """Physical layout of the float32 dQ accumulator [B, S, H, D].

    A GEMM accumulator (mma.sync or WGMMA) holds, per warp and 8×8 tile, row ``l % 8`` =
    lane // 4 and the column pair ``2·(lane % 4) + {0, 1}``. Splitting the column parity off
    (``d % 2``) and putting ``4·(l % 8) + (d % 8) // 2`` last makes a warp's 32 atomics for one
    parity land on 32 consecutive floats. Columns d and d+1 are therefore 32 floats apart: an
    atomic add that vectorized them together would be wrong (see the module docstring).
    """
    return T.Layout(
        dQ.shape,
        lambda b, s, h, d: [b, s // 8, h, d // 8, d % 2, 4 * (s % 8) + (d % 8) // 2],
    )


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim_qk,
    dim_v,
    causal,
    softmax_scale,
    dtype="float16",
    strategy="atomic",
    block_M=128,
    block_N=32,
    num_stages=2,
    threads=256,
):
    """Gradients into float32 accumulators: dQ (``dq_layout``) and dK/dV (``split``: one slice
    per group member, ``atomic``: one slice shared by the group).

    Everything is computed transposed, keys along M, so that dk and dv are plain GEMM
    accumulators: ``acc_s = K Qᵀ`` [block_M keys × block_N queries] becomes the probabilities
    ``Pᵀ = exp(acc_s·scale − lse)``; ``acc_dp = V dOᵀ`` (= dPᵀ); ``dv += Pᵀ dO``;
    ``ds = Pᵀ ⊙ (acc_dp − delta)·scale`` (= dSᵀ); ``dk += ds Q``; ``dq = dsᵀ K``.
    """
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E
    offset = seq_kv - seq_q  # bottom-right causal alignment
    splits = groups if strategy == "split" else 1
    q_shape = [batch, seq_q, heads, dim_qk]
    # dq_layout moves whole groups of 8 rows: the accumulator is padded to a multiple of 8 rows
    # (unpadded, the last group of a ragged Sq would be written past the end of the tensor).
    dq_shape = [batch, padded_rows(seq_q), heads, dim_qk]

    # The steps of one query block and the epilogue, named. T.macro is inlined: the generated
    # CUDA is the same as with the steps written out in the loop.
    @T.macro
    def scores(K_shared, Q_shared, acc_s):
        # Sᵀ = K Qᵀ of one query block.
        T.gemm(
            K_shared,
            Q_shared,
            acc_s,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )

    @T.macro
    def probabilities(k, bx, key_tail, first_unmasked, lse_shared, acc_s):
        # Pᵀ = exp2(Sᵀ·scale − lse·log2 e); lse = +inf (a row with no key) gives 0 and so dq = 0.
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale - lse_shared[j] * LOG2E)
        if key_tail or k < first_unmasked or (k + 1) * block_N > seq_q:
            for i, j in T.Parallel(block_M, block_N):
                key = bx * block_M + i
                query = k * block_N + j
                visible = key < seq_kv and query < seq_q
                if causal:
                    visible = visible and key <= query + offset
                acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], 0)

    @T.macro
    def dp(V_shared, dO_shared, acc_dp):
        # dPᵀ = V dOᵀ.
        T.gemm(
            V_shared,
            dO_shared,
            acc_dp,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )

    @T.macro
    def dv_update(acc_s, acc_s_cast, dO_shared, dv):
        # dV += Pᵀ dO, Pᵀ straight from registers.
        T.copy(acc_s, acc_s_cast)
        T.gemm(acc_s_cast, dO_shared, dv, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def ds(acc_s, acc_dp, delta_shared, ds_cast):
        # dSᵀ = Pᵀ ∘ (dPᵀ − delta), times the softmax scale that dQ and dK both carry.
        for i, j in T.Parallel(block_M, block_N):
            ds_cast[i, j] = acc_s[i, j] * (acc_dp[i, j] - delta_shared[j]) * softmax_scale

    @T.macro
    def dk_update(ds_cast, Q_shared, dk):
        # dK += dSᵀ Q.
        T.gemm(ds_cast, Q_shared, dk, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def dq_accumulate(k, by, bz, ds_cast, ds_shared, K_shared, dq, dQ):
        # dQ (this key block's share) = dS K: dSᵀ goes through shared memory to be read
        # transposed, then scalar atomic adds, one per element at its ``dq_layout`` address.
        T.copy(ds_cast, ds_shared)
        T.gemm(ds_shared, K_shared, dq, transpose_A=True, clear_accum=True)
        for i, j in T.Parallel(block_N, dim_qk):
            T.atomic_add(dQ[bz, k * block_N + i, by, j], dq[i, j])

    @T.macro
    def epilogue(dv, dk, dv_shared, dk_shared, dV, dK, bx, by, bz):
        T.copy(dv, dv_shared)
        T.copy(dk, dk_shared)
        if strategy == "atomic":
            # One regional atomic per tile: the group's query heads meet in the same dK/dV.
            T.atomic_add(dV[0, bz, bx * block_M : (bx + 1) * block_M, by // groups, :], dv_shared)
            T.atomic_add(dK[0, bz, bx * block_M : (bx + 1) * block_M, by // groups, :], dk_shared)
        else:
            # Each group member owns slice `by % groups`: plain stores.
            T.copy(
                dv_shared, dV[by % groups, bz, bx * block_M : (bx + 1) * block_M, by // groups, :]
            )
            T.copy(
                dk_shared, dK[by % groups, bz, bx * block_M : (bx + 1) * block_M, by // groups, :]
            )

    @T.prim_func
    def flash_bwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor([batch, seq_kv, heads_kv, dim_qk], dtype),
        V: T.Tensor([batch, seq_kv, heads_kv, dim_v], dtype),
        dO: T.Tensor([batch, seq_q, heads, dim_v], dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        Delta: T.Tensor([batch, heads, seq_q], accum_dtype),
        dQ: T.Tensor(dq_shape, accum_dtype),
        dK: T.Tensor([splits, batch, seq_kv, heads_kv, dim_qk], accum_dtype),
        dV: T.Tensor([splits, batch, seq_kv, heads_kv, dim_v], accum_dtype),
    ):
        # The head is the fastest-varying grid dimension (blockIdx.x): a group's query heads,
        # which read the same K/V block and add into the same dK/dV, run side by side and share
        # it in L2. The names keep their meaning: bx the key block, by the head, bz the batch.
        with T.Kernel(heads, T.ceildiv(seq_kv, block_M), batch, threads=threads) as (by, bx, bz):
            K_shared = T.alloc_shared([block_M, dim_qk], dtype)
            V_shared = T.alloc_shared([block_M, dim_v], dtype)
            Q_shared = T.alloc_shared([block_N, dim_qk], dtype)
            dO_shared = T.alloc_shared([block_N, dim_v], dtype)
            lse_shared = T.alloc_shared([block_N], accum_dtype)
            delta_shared = T.alloc_shared([block_N], accum_dtype)
            ds_shared = T.alloc_shared([block_M, block_N], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_dp = T.alloc_fragment([block_M, block_N], accum_dtype)
            ds_cast = T.alloc_fragment([block_M, block_N], dtype)
            dq = T.alloc_fragment([block_N, dim_qk], accum_dtype)
            dk = T.alloc_fragment([block_M, dim_qk], accum_dtype)
            dv = T.alloc_fragment([block_M, dim_v], accum_dtype)
            dk_shared = T.alloc_shared([block_M, dim_qk], accum_dtype)
            dv_shared = T.alloc_shared([block_M, dim_v], accum_dtype)

            T.annotate_layout({dQ: dq_layout(dQ)})

            T.copy(K[bz, bx * block_M : (bx + 1) * block_M, by // groups, :], K_shared)
            T.copy(V[bz, bx * block_M : (bx + 1) * block_M, by // groups, :], V_shared)
            T.clear(dk)
            T.clear(dv)

            # Query blocks that see at least one of this block's keys; a query block needs a
            # mask when it crosses Sq, when this key block crosses Sk, or (causal) when some of
            # its queries precede some of the keys (query i sees key j iff i >= j - offset).
            q_start = 0
            if causal:
                q_start = T.max(0, bx * block_M - offset) // block_N
            q_end = T.ceildiv(seq_q, block_N)
            # From this query block on, every query sees every key of the block.
            first_unmasked = q_start
            if causal:
                first_unmasked = T.ceildiv(T.max(0, (bx + 1) * block_M - 1 - offset), block_N)
            key_tail = (bx + 1) * block_M > seq_kv

            # Never empty (the last query sees every key), so the consumers always wait for
            # the K/V tiles' TMA loads inside the loop.
            for k in T.Pipelined(q_start, q_end, num_stages=num_stages):
                T.copy(Q[bz, k * block_N : (k + 1) * block_N, by, :], Q_shared)
                scores(K_shared, Q_shared, acc_s)
                T.copy(lse[bz, by, k * block_N : (k + 1) * block_N], lse_shared)
                probabilities(k, bx, key_tail, first_unmasked, lse_shared, acc_s)
                T.copy(dO[bz, k * block_N : (k + 1) * block_N, by, :], dO_shared)
                dp(V_shared, dO_shared, acc_dp)
                dv_update(acc_s, acc_s_cast, dO_shared, dv)
                T.copy(Delta[bz, by, k * block_N : (k + 1) * block_N], delta_shared)
                ds(acc_s, acc_dp, delta_shared, ds_cast)
                dk_update(ds_cast, Q_shared, dk)
                dq_accumulate(k, by, bz, ds_cast, ds_shared, K_shared, dq, dQ)

            epilogue(dv, dk, dv_shared, dk_shared, dV, dK, bx, by, bz)

    return flash_bwd


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_postprocess(batch, heads, seq_q, dim_qk, dtype="float16", block=64):
    """dQ: float32 in ``dq_layout`` → fp16/bf16 in plain BSHD."""
    accum_dtype = "float32"
    shape = [batch, seq_q, heads, dim_qk]

    @T.prim_func
    def flash_bwd_post(
        dQ: T.Tensor([batch, padded_rows(seq_q), heads, dim_qk], accum_dtype),
        dQ_out: T.Tensor(shape, dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            T.annotate_layout({dQ: dq_layout(dQ)})
            T.copy(
                dQ[bz, bx * block : (bx + 1) * block, by, :],
                dQ_out[bz, bx * block : (bx + 1) * block, by, :],
            )

    return flash_bwd_post


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_postprocess_kv(batch, heads_kv, seq_kv, dim, splits, dtype="float16", block=64):
    """dK or dV: sum ``splits`` float32 partials in float32, then cast once."""
    accum_dtype = "float32"

    @T.prim_func
    def flash_bwd_post_kv(
        dX: T.Tensor([splits, batch, seq_kv, heads_kv, dim], accum_dtype),
        dX_out: T.Tensor([batch, seq_kv, heads_kv, dim], dtype),
    ):
        with T.Kernel(T.ceildiv(seq_kv, block), heads_kv, batch, threads=128) as (bx, by, bz):
            part = T.alloc_fragment([block, dim], accum_dtype)
            acc = T.alloc_fragment([block, dim], accum_dtype)
            T.clear(acc)
            for s in T.serial(splits):
                T.copy(dX[s, bz, bx * block : (bx + 1) * block, by, :], part)
                for i, j in T.Parallel(block, dim):
                    acc[i, j] += part[i, j]
            T.copy(acc, dX_out[bz, bx * block : (bx + 1) * block, by, :])

    return flash_bwd_post_kv


# ----------------------------------------------------------------------------- configurations
def forward_config(dim_qk, arch="sm_90a"):
    """Forward tiles (the forward is not this script's subject: see example_gqa_fwd_bshd.py)."""
    if not arch.startswith("sm_90"):
        return dict(block_M=64, block_N=64, num_stages=1, threads=128)
    if dim_qk <= 64:
        return dict(block_M=128, block_N=128, num_stages=2, threads=256)
    if dim_qk <= 128:
        return dict(block_M=128, block_N=128, num_stages=1, threads=256)
    return dict(block_M=128, block_N=64, num_stages=1, threads=256)


def default_strategy(dim_qk, dim_v, arch="sm_90a"):
    """``group`` (the hand-scheduled backward) where it builds — Hopper, head dims 64/64 and
    128/128 —, else ``atomic``."""
    return "group" if arch.startswith("sm_90") and (dim_qk, dim_v) in GROUP_DIMS else "atomic"


def default_config(dim_qk, dim_v, arch="sm_90a", strategy="atomic"):
    """Backward tiles. ``group``: example_mha_bwd_wgmma_pipelined.py's ``default_config``.
    ``atomic`` and ``split``: block_M keys per thread block, block_N queries per step.

    Hopper: 256 threads are two consumer warpgroups (TileLang adds a producer warpgroup for the
    TMA loads), each holding 64 keys' dk and dv in registers — 128 keys × (Dqk + Dv) float32
    accumulators is what bounds the tile. Measured on an H100 (2026-11-22, B4 H32 Hkv8 S4096
    D128 fp16, atomic strategy, backward alone): 128×64 tiles at 2 stages 393 TFLOP/s, 128×32
    311-330, 64×32 / 128 threads 240, 64×64 / 128 threads 180 (FA2: 299). With Dqk=192 the
    accumulators leave no registers for 64 queries a step: 128×32 (not measured against others).
    The same tiles with or without ``causal``.
    """
    if strategy == "group":
        return fast_bwd.default_config(dim_qk, arch)
    if not arch.startswith("sm_90"):
        return dict(block_M=64, block_N=32, num_stages=1, threads=128)
    if dim_qk + dim_v <= 256:
        return dict(block_M=128, block_N=64, num_stages=2, threads=256)
    return dict(block_M=128, block_N=32, num_stages=2, threads=256)


def tune_configs(dim_qk, dim_v, strategy="atomic"):
    """The space ``--tune`` compares for ``strategy``."""
    if strategy == "group":
        return fast_bwd.tune_configs(dim_qk)
    configs = [
        dict(block_M=128, block_N=32, num_stages=2, threads=256),
        dict(block_M=128, block_N=32, num_stages=1, threads=256),
        dict(block_M=64, block_N=32, num_stages=2, threads=128),
        dict(block_M=64, block_N=64, num_stages=2, threads=128),
    ]
    if dim_qk + dim_v <= 256:
        configs.append(dict(block_M=128, block_N=64, num_stages=2, threads=256))
    return configs


# ----------------------------------------------------------------------------- torch-facing
def device_arch(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def dtype_name(t):
    return "float16" if t.dtype == torch.float16 else "bfloat16"


def _check_inputs(q, k, v, causal, softmax_scale, strategy):
    """ValueError naming the first bad argument; the device last, so any other needs no GPU."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be None or one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    real = isinstance(softmax_scale, numbers.Real)
    if softmax_scale is not None and not (real and 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seqlen, heads, dim], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    B, _, H, Dqk = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        got = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"q, k, v must share a dtype, float16 or bfloat16; got {got}")
    if k.shape[0] != B or k.shape[3] != Dqk:
        got = tuple(k.shape)
        raise ValueError(f"k must be [{B}, seqlen_k, heads_kv, {Dqk}] to match q, got {got}")
    if v.shape[:3] != k.shape[:3]:
        got = tuple(v.shape)
        raise ValueError(f"v must be {list(k.shape[:3])} + [dim_v] to match k, got {got}")
    Hkv, Dv = k.shape[2], v.shape[3]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv}): H % Hkv != 0")
    if (Dqk, Dv) not in HEAD_DIMS:
        raise ValueError(
            f"head dims (q.shape[-1], v.shape[-1]) must be one of {HEAD_DIMS}, got {(Dqk, Dv)}"
        )
    if strategy == "group" and (Dqk, Dv) not in GROUP_DIMS:
        raise ValueError(f"strategy 'group' builds head dims {GROUP_DIMS}, got {(Dqk, Dv)}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


def attention_forward(q, k, v, causal, softmax_scale):
    """Forward alone: ``out [B, Sq, H, Dv]`` and ``lse [B, H, Sq]`` (float32, natural log). On
    Hopper with equal head dims, example_gqa_fwd_bshd.py's persistent forward; else this
    script's kernel."""
    B, Sq, H, Dqk = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Dqk == Dv and device_arch(q.device).startswith("sm_90"):
        # The sibling's plain function, not its attention(): that would check again and call
        # its operator inside this script's, a second dispatch that adds nothing.
        return fast_fwd.attention_forward(q, k, v, causal, softmax_scale)
    out = torch.empty(B, Sq, H, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to launch
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        fwd_cfg = forward_config(Dqk, device_arch(q.device))
        kernel = flashattn_fwd(
            B, H, Hkv, Sq, Sk, Dqk, Dv, causal, softmax_scale, dtype_name(q), **fwd_cfg
        )
        kernel(q, k, v, out, lse)
    return out, lse


def attention_backward(
    dout, q, k, v, out, lse, causal, softmax_scale, config=None, strategy="atomic"
):
    """The three backward steps; returns dq, dk, dv in the inputs' dtype."""
    if strategy == "group":
        return fast_bwd.attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, config)
    B, Sq, H, Dqk = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if q.numel() == 0 or k.numel() == 0:  # an empty sum: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtype = dtype_name(q)
    cfg = config or default_config(Dqk, Dv, device_arch(q.device), strategy)
    splits = H // Hkv if strategy == "split" else 1
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient

    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    flashattn_bwd_preprocess(B, H, Sq, Dv, dtype)(out, dout, delta)

    # dQ and the atomic dK/dV are sums of atomic adds: they start at zero. Split partials are
    # each written exactly once, so they need no clearing.
    alloc_kv = torch.zeros if strategy == "atomic" else torch.empty
    dq_acc = torch.zeros(B, padded_rows(Sq), H, Dqk, dtype=torch.float32, device=q.device)
    dk_acc = alloc_kv(splits, B, Sk, Hkv, Dqk, dtype=torch.float32, device=q.device)
    dv_acc = alloc_kv(splits, B, Sk, Hkv, Dv, dtype=torch.float32, device=q.device)
    kernel = flashattn_bwd(
        B, H, Hkv, Sq, Sk, Dqk, Dv, causal, softmax_scale, dtype, strategy, **cfg
    )
    kernel(q, k, v, dout, lse, delta, dq_acc, dk_acc, dv_acc)

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flashattn_bwd_postprocess(B, H, Sq, Dqk, dtype)(dq_acc, dq)
    flashattn_bwd_postprocess_kv(B, Hkv, Sk, Dqk, splits, dtype)(dk_acc, dk)
    flashattn_bwd_postprocess_kv(B, Hkv, Sk, Dv, splits, dtype)(dv_acc, dv)
    return dq, dk, dv


# torch.compile: the kernels as custom operators (docs/CONVENTIONS.md, "torch.compile"), as in
# example_mha_bwd_bshd.py. The strategy is an operator argument (a string), settled before the
# call: default_strategy needs only the device's arch, which traced code can read. A config's
# keys depend on the strategy, so CONFIG_KEYS holds one order per strategy; "group" runs
# example_mha_bwd_wgmma_pipelined.py's plain attention_backward inside this script's operator.
CONFIG_KEYS = {
    "group": fast_bwd.CONFIG_KEYS,  # block_M, block_N, num_stages, dq_stages, head_splits, …
    "atomic": ("block_M", "block_N", "num_stages", "threads"),
    "split": ("block_M", "block_N", "num_stages", "threads"),
}


@torch.library.custom_op("tl_attn::gqa_bwd_forward", mutates_args=())
def attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    strategy: str,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, softmax_scale)


@attention_forward_op.register_fake
def _(q, k, v, causal, softmax_scale, strategy, config):
    B, Sq, H, _ = q.shape
    out = q.new_empty(B, Sq, H, v.shape[3])  # Dv, which may differ from Dqk
    return out, q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("tl_attn::gqa_bwd_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    strategy: str,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS[strategy], config, strict=True)) if config else None
    return attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, cfg, strategy)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, strategy, config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, strategy, config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # a statistic for the backward; attention() returns out
    ctx.set_materialize_grads(False)  # backward never reads dlse: no zeros made for it
    ctx.settings = (causal, softmax_scale, strategy, config)


def backward(ctx, dout, dlse):
    dq, dk, dv = attention_backward_op(dout, *ctx.saved_tensors, *ctx.settings)
    return dq, dk, dv, None, None, None, None


attention_forward_op.register_autograd(backward, setup_context=setup_context)


class EagerAttention(torch.autograd.Function):
    """The formula above for eager calls, over the plain functions, without the operators'
    per-call dispatch (docs/CONVENTIONS.md, "Eager calls": why, and why ``forward`` takes
    ``ctx``)."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, causal, softmax_scale = inputs[:5]  # then the backward's strategy, config
        output = attention_forward(q, k, v, causal, softmax_scale)
        setup_context(ctx, inputs, output)  # the operators' formula, as they run it
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not zeros
    def backward(ctx, dout, dlse):
        causal, softmax_scale, strategy, config = ctx.settings
        cfg = dict(zip(CONFIG_KEYS[strategy], config, strict=True)) if config else None
        dq, dk, dv = attention_backward(
            dout, *ctx.saved_tensors, causal, softmax_scale, cfg, strategy
        )
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, causal=False, softmax_scale=None, strategy=None, config=None):
    """Differentiable GQA attention: ``q [B, Sq, H, Dqk]``, ``k [B, Sk, Hkv, Dqk]``,
    ``v [B, Sk, Hkv, Dv]`` (fp16/bf16, CUDA) → ``out [B, Sq, H, Dv]``.

    ``strategy`` ("group", "atomic" or "split"; default ``default_strategy``) picks how the
    backward combines a group's dK/dV; ``config`` overrides that strategy's backward tiles (see
    ``default_config``).
    """
    _check_inputs(q, k, v, causal, softmax_scale, strategy)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if strategy is None:
        strategy = default_strategy(q.shape[-1], v.shape[-1], device_arch(q.device))
    q, k, v = (t.contiguous() for t in (q, k, v))
    if strategy == "group":
        tiles = fast_bwd.config_values(config)
    else:
        tiles = [config[key] for key in CONFIG_KEYS[strategy]] if config else None
    # Compiled code (and fake tensors) call the operator; an eager call on real tensors runs the
    # same formula as a plain Function (EagerAttention), without the operator's dispatch.
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    apply = EagerAttention.apply if eager else attention_forward_op
    out, _ = apply(q, k, v, causal, float(softmax_scale), strategy, tiles)
    return out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, causal=False, softmax_scale=None):
    """Plain differentiable PyTorch in float32 (float64 stays float64; runs on CPU), same
    conventions as ``attention``."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[2] // k.shape[2]
    kf, vf = (einops.repeat(t.to(acc), "b s h d -> b s (h g) d", g=groups) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kf) * scale
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (Sk - Sq), float("-inf"))
    # A row that sees no key gives probabilities 0 (softmax would give NaN): out 0, grads 0.
    seen = torch.isfinite(scores).any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    return torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)


def reference_grads(q, k, v, dout, causal, softmax_scale):
    """out, dq, dk, dv from autograd through ``ref_program`` in float32, one batch entry at a
    time so the Sq×Sk matrices stay bounded at benchmark sizes."""
    results = []
    for b in range(q.shape[0]):
        leaves = [t[b : b + 1].detach().float().requires_grad_() for t in (q, k, v)]
        out = ref_program(*leaves, causal=causal, softmax_scale=softmax_scale)
        grads = torch.autograd.grad(out, leaves, dout[b : b + 1].float())
        results.append((out.detach(), *grads))
    return [torch.cat(parts) for parts in zip(*results, strict=True)]


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    dims = tuple(sorted({dqk for dqk, _ in HEAD_DIMS}))
    parser = _harness().base_parser(__doc__.splitlines()[0], archs=ARCHS, dims=dims)
    parser.add_argument("--groups", type=int, default=4, help="query heads per kv head")
    dims_v = tuple(sorted({dv for _, dv in HEAD_DIMS}))
    parser.add_argument("--dim_v", type=int, choices=dims_v, help="V head dim (default: --dim)")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="how a group's dK/dV combine (default: group where it builds, else atomic)",
    )
    return parser


def make_inputs(batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, dtype, device="cuda", seed=0):
    """Normal random q, k, v (requiring grad) and an upstream gradient dout."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    q = randn(batch, seq_q, heads, dim_qk)
    k = randn(batch, seq_k, heads_kv, dim_qk)
    v = randn(batch, seq_k, heads_kv, dim_v)
    dout = randn(batch, seq_q, heads, dim_v)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def check(
    batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, causal, dtype, strategy, config=None
):
    """Out and dq, dk, dv against autograd through ``ref_program`` (fp16/bf16 tolerances: out
    1e-2, gradients 2e-2, relative)."""
    harness = _harness()
    q, k, v, dout = make_inputs(batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, dtype)
    scale = 1.0 / math.sqrt(dim_qk)
    out = attention(q, k, v, causal, scale, strategy, config)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dout, causal, scale)
    harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
    harness.check_grads({"dq": dq, "dk": dk, "dv": dv}, {"dq": ref_dq, "dk": ref_dk, "dv": ref_dv})


def benchmark(batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, causal, dtype, configs):
    """Forward+backward and backward alone: ours, one row per entry of ``configs`` (a name →
    (strategy, backward config or None)), beside SDPA FLASH (FA2) and cuDNN on the same inputs.
    Returns the rows of both reports: {"fwd+bwd": [...], "bwd": [...]}."""
    harness = _harness()
    q, k, v, dout = make_inputs(batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, dtype)
    scale = 1.0 / math.sqrt(dim_qk)
    fwd_bwd, bwd = {}, {}
    for name, (strategy, cfg) in configs.items():
        out = attention(q, k, v, causal, scale, strategy, cfg)  # graph kept for backward alone
        fwd_bwd[name] = lambda s=strategy, c=cfg: torch.autograd.grad(
            attention(q, k, v, causal, scale, s, c), (q, k, v), dout
        )
        bwd[name] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    peers_fwd_bwd, peers_bwd = harness.sdpa_backward_peers(q, k, v, dout, causal, scale)
    fwd = harness.attention_flops(batch, heads, seq_q, seq_k, dim_qk, dim_v, causal)
    bwd_flops = harness.attention_flops(batch, heads, seq_q, seq_k, dim_qk, dim_v, causal, True)
    shape = (
        f"B{batch} H{heads} Hkv{heads_kv} Sq{seq_q} Sk{seq_k} D{dim_qk}/{dim_v} "
        f"causal={causal} {dtype}"
    )
    return {
        "fwd+bwd": harness.report(
            f"forward+backward {shape}", fwd_bwd, peers_fwd_bwd, fwd + bwd_flops
        ),
        "bwd": harness.report(f"backward {shape}", bwd, peers_bwd, bwd_flops),
    }


def compile_all(
    batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, causal, dtype, strategy, arch, config=None
):
    """Build every kernel a forward + backward runs, for ``arch`` without a GPU; returns
    name → CUDA source."""
    harness = _harness()
    scale = 1.0 / math.sqrt(dim_qk)
    cfg = config or default_config(dim_qk, dim_v, arch, strategy)
    if strategy == "group":  # the sibling scripts' kernels
        fwd_cfg = fast_fwd.default_config(dim_qk, causal, arch, seq_k)
        attn = (heads_kv, seq_q, seq_k, dim_qk, causal, scale, dtype)
        groups = heads // heads_kv
        kernels = {
            "flash_fwd": (fast_fwd.flashattn_fwd, attn, fwd_cfg),
            **fast_bwd.backward_kernels(seq_q, seq_k, dim_qk, causal, scale, dtype, cfg, groups),
        }
        return {
            name: harness.compile_for(fn, arch, batch, heads, *args, **kw).get_kernel_source()
            for name, (fn, args, kw) in kernels.items()
        }
    splits = heads // heads_kv if strategy == "split" else 1
    attn = (batch, heads, heads_kv, seq_q, seq_k, dim_qk, dim_v, causal, scale, dtype)
    kv = (batch, heads_kv, seq_k)
    kernels = {
        "flashattn_fwd": (flashattn_fwd, attn, forward_config(dim_qk, arch)),
        "flashattn_bwd_preprocess": (
            flashattn_bwd_preprocess,
            (batch, heads, seq_q, dim_v, dtype),
            {},
        ),
        f"flashattn_bwd[{strategy}]": (flashattn_bwd, (*attn, strategy), cfg),
        "flashattn_bwd_postprocess": (
            flashattn_bwd_postprocess,
            (batch, heads, seq_q, dim_qk, dtype),
            {},
        ),
        "flashattn_bwd_postprocess_kv[dK]": (
            flashattn_bwd_postprocess_kv,
            (*kv, dim_qk, splits, dtype),
            {},
        ),
        "flashattn_bwd_postprocess_kv[dV]": (
            flashattn_bwd_postprocess_kv,
            (*kv, dim_v, splits, dtype),
            {},
        ),
    }
    return {
        name: harness.compile_for(fn, arch, *args, **kw).get_kernel_source()
        for name, (fn, args, kw) in kernels.items()
    }


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.groups < 1 or args.heads % args.groups != 0:
        parser.error(f"--groups ({args.groups}) must be positive and divide --heads ({args.heads})")
    Dqk, Dv = args.dim, args.dim_v or args.dim
    if (Dqk, Dv) not in HEAD_DIMS:
        parser.error(f"--dim/--dim_v ({Dqk}, {Dv}) must be one of {HEAD_DIMS}")
    if args.strategy == "group" and (Dqk, Dv) not in GROUP_DIMS:
        parser.error(f"--strategy group builds head dims {GROUP_DIMS}, got {(Dqk, Dv)}")
    if args.compile_only and args.strategy == "group" and not args.arch.startswith("sm_90"):
        parser.error(f"--strategy group is Hopper's hand-scheduled kernel, not {args.arch}")
    shape = (
        args.batch, args.heads, args.heads // args.groups, args.seq_len,
        args.seq_len_k or args.seq_len, Dqk, Dv, args.causal,
    )  # fmt: skip
    script = pathlib.Path(__file__).name

    if args.compile_only:
        strategy = args.strategy or default_strategy(Dqk, Dv, args.arch)
        sources = compile_all(*shape, args.dtype, strategy, args.arch)
        cfg = default_config(Dqk, Dv, args.arch, strategy)
        print(f"{script}: built for {args.arch}, strategy {strategy}, backward tiles {cfg}")
        for name, src in sources.items():
            print(harness.describe_source(name, src))
        return

    harness.require_gpu(script)
    dtype = harness.DTYPES[args.dtype]
    strategy = args.strategy or default_strategy(Dqk, Dv, device_arch(torch.device("cuda")))
    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest backward is checked.
        space = tune_configs(Dqk, Dv, strategy)
        named = {_config_name(strategy, c): (strategy, c) for c in space}
        config = named[harness.fastest(benchmark(*shape, dtype, named)["bwd"])][1]
        print(f"tuned: {config}")
    if args.check:
        B, H, Hkv, Sq, Sk = shape[:5]
        print(
            f"check B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{Dqk}/{Dv} causal={args.causal} "
            f"{args.dtype} strategy={strategy}"
        )
        check(*shape, dtype, strategy, config)
    if args.bench and not args.tune:
        benchmark(*shape, dtype, {f"tilelang[{strategy}]": (strategy, config)})


def _config_name(strategy, cfg):
    if strategy == "group":
        return "group {block_M}x{block_N} st{num_stages} dq{dq_stages}".format(**cfg)
    return "{} {block_M}x{block_N} st{num_stages} t{threads}".format(strategy, **cfg)


if __name__ == "__main__":
    main()
