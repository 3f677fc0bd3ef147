"""FlashAttention forward and backward, multi-head, BSHD layout, in TileLang for Hopper (SM90).

``attention(q, k, v)`` is differentiable: ``q [B, Sq, H, D]``, ``k, v [B, Sk, H, D]``. Its forward
is the FlashAttention forward that also saves the log-sum-exp ``lse`` of every score row (natural
log, float32 ``[B, H, Sq]``; ``+inf`` for a row that sees no key). Its backward recomputes the
probabilities from ``lse`` instead of storing the Sq×Sk matrix, in three kernels:

1. preprocess: ``delta = rowsum(O ∘ dO)`` per query row (the softmax-gradient correction term);
2. the backward proper, one thread block per (key block, head, batch). It keeps its K and V block
   in shared memory and walks over the query blocks that can see it; per query block it forms
   ``Pᵀ = exp(K Qᵀ·scale − lse)`` and ``dPᵀ = V dOᵀ``, then ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)·scale``, and
   accumulates ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` in registers — written once at the end — while
   ``dQ += dS K`` (one query block's partial sum from one key block) is added into a float32
   global buffer with atomic adds, since every key block contributes to every query block;
3. postprocess: dQ float32 → the input dtype.

Working transposed (keys as rows) is what lets dK and dV stay in registers for the whole loop:
with multi-head attention every key block has exactly one owner, so no reduction over heads is
needed for dK and dV (the GQA backward scripts show that case).

This is the plain lesson: the algorithm in its shortest form, with TileLang's automatic pipeline
choosing the schedule. example_mha_bwd_wgmma_pipelined.py computes the same thing with
FlashAttention-3's schedule written out by hand (warp roles, mbarriers, asynchronous WGMMA
chains, dQ by TMA reduce-add) and runs faster: README, "Backward", and
``benchmarks/results/bwd.md``.

What it shows on Hopper: TMA loads of the Q/dO/lse/delta tiles in a producer warpgroup, WGMMA for
the five GEMMs (the two that take ``Pᵀ`` and ``dSᵀ`` straight from registers use the register-A
form), and vectorised float32 atomics for dQ.

Causal masking is aligned bottom-right (as FlashAttention ≥ 2.1): query ``i`` sees key ``j`` when
``j <= i + Sk - Sq``. A query row that sees no key gets ``O = 0`` and ``dQ = 0``. Masks run only on
boundary blocks: the ragged tail of Sq or Sk and, when causal, the query blocks that cross the
diagonal; the loop starts at the first query block that sees any key of the block.

Head dims 64 and 128 (dK and dV for 128 keys × 128 dims already fill most of the registers of two
warpgroups; 256 would need a different split); fp16 and bf16; any Sq, Sk (an empty
sequence launches nothing).

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None, config=None)

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device; headdim 64 or 128.
    k, v: (batch, seqlen_k, nheads, headdim), same dtype and device.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    config: dict. Backward tile configuration (block_M, block_N, num_stages, threads);
        default ``default_config``.
    Returns out: (batch, seqlen_q, nheads, headdim), differentiable
        (``torch.autograd``): its backward runs the kernels above.

In compiled code, ``attention`` calls the custom operator ``tl_attn::mha_bwd_bshd_forward``
(``torch.library``), whose autograd formula calls ``tl_attn::mha_bwd_bshd_backward``, so
``torch.compile(model, fullgraph=True)`` compiles a training step around it without a graph
break.
An eager call runs the same formula through ``EagerAttention`` (a plain
``torch.autograd.Function`` over the same functions), without the operators' dispatch.

Run:
    python examples/flash_attention/example_mha_bwd_bshd.py --causal --dtype bfloat16
    python examples/flash_attention/example_mha_bwd_bshd.py --tune    # compare tile configs
    python examples/flash_attention/example_mha_bwd_bshd.py --compile-only --arch sm_90a  # no GPU
"""

import math
import numbers
import pathlib
import sys

import tilelang
import tilelang.language as T
import torch

LOG2E = 1.4426950408889634
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_90a",)  # --arch: Hopper only (at D=128 the sm_80 tiles do not build)


# ----------------------------------------------------------------------------- forward kernel
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd(
    batch,
    heads,
    seq_q,
    seq_kv,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=128,
    num_stages=1,
    threads=256,
):
    """The online-softmax forward (T.Pipelined), saving ``lse`` for the backward."""
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    offset = seq_kv - seq_q  # bottom-right causal alignment
    neg_inf = -T.infinity(accum_dtype)
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads, dim]

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
            # max = -inf (no visible key yet) becomes 0 so exp2 gives 0, not NaN
            scores_max[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i])
            scores_scale[i] = T.exp2(scores_max_prev[i] * scale - scores_max[i] * scale)
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale - scores_max[i] * scale)
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def rescale(acc_o, scores_scale):
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def pv(acc_s_cast, V_shared, acc_o):
        # O += P V of one key block.
        T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz):
        # Rows with no visible key (logsum = 0): O = 0 and lse = +inf, so that the backward's
        # exp(s - lse) is 0 for them.
        for i, j in T.Parallel(block_M, dim):
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
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        Output: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([block_N, dim], dtype)
            V_shared = T.alloc_shared([block_N, dim], dtype)
            O_shared = T.alloc_shared([block_M, dim], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)

            T.copy(Q[bz, bx * block_M : (bx + 1) * block_M, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, neg_inf)

            # Key blocks this query block visits, and the first that needs a mask (the ragged
            # tail of Sk and, when causal, the blocks crossing the diagonal).
            n_blocks = T.ceildiv(seq_kv, block_N)
            first_masked = seq_kv // block_N
            if causal:
                last_key = (bx + 1) * block_M + offset  # one past the last key this block sees
                # At least one (fully masked) block even when no row of this block sees a key
                # (Sq > Sk): the loop is where the consumers wait for the Q tile's TMA load, and
                # a load still in flight at exit could land on O_shared.
                n_blocks = T.max(1, T.min(n_blocks, T.ceildiv(last_key, block_N)))
                first_masked = T.min(first_masked, T.max(0, (bx * block_M + offset) // block_N))

            for k in T.Pipelined(n_blocks, num_stages=num_stages):
                T.copy(K[bz, k * block_N : (k + 1) * block_N, by, :], K_shared)
                scores(Q_shared, K_shared, acc_s)
                mask(k, first_masked, bx, acc_s)
                softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                T.copy(acc_s, acc_s_cast)
                rescale(acc_o, scores_scale)

                T.copy(V[bz, k * block_N : (k + 1) * block_N, by, :], V_shared)
                pv(acc_s_cast, V_shared, acc_o)

            epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz)

    return flash_fwd


# ----------------------------------------------------------------------------- backward kernels
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_preprocess(batch, heads, seq_q, dim, dtype="float16", block=64):
    """delta[b, h, i] = Σ_d O[b, i, h, d] · dO[b, i, h, d], in float32."""
    accum_dtype = "float32"
    shape = [batch, seq_q, heads, dim]

    @T.prim_func
    def flash_bwd_prep(
        Output: T.Tensor(shape, dtype),
        dO: T.Tensor(shape, dtype),
        Delta: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            out_frag = T.alloc_fragment([block, dim], dtype)
            dout_frag = T.alloc_fragment([block, dim], dtype)
            prod = T.alloc_fragment([block, dim], accum_dtype)
            delta = T.alloc_fragment([block], accum_dtype)
            T.copy(Output[bz, bx * block : (bx + 1) * block, by, :], out_frag)
            T.copy(dO[bz, bx * block : (bx + 1) * block, by, :], dout_frag)
            for i, j in T.Parallel(block, dim):
                prod[i, j] = T.cast(out_frag[i, j], accum_dtype) * T.cast(
                    dout_frag[i, j], accum_dtype
                )
            T.reduce_sum(prod, delta, dim=1)
            T.copy(delta, Delta[bz, by, bx * block : (bx + 1) * block])

    return flash_bwd_prep


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd(
    batch,
    heads,
    seq_q,
    seq_kv,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=32,
    num_stages=2,
    threads=256,
):
    """One thread block per (block_M keys, head, batch), looping over blocks of block_N queries.

    Every score tile here is transposed (rows are keys, columns queries): ``acc_s`` holds Sᵀ and
    then Pᵀ, ``acc_dp`` holds dPᵀ, ``ds_cast`` dSᵀ.
    """
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # scores to log2 units, as in the forward
    offset = seq_kv - seq_q  # bottom-right causal alignment
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads, dim]

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
    def probabilities(k, bx, key_tail, lse_shared, acc_s):
        # Pᵀ = exp2(Sᵀ·scale − lse·log2 e); lse = +inf (row sees no key) gives 0.
        # A block needs the mask when it holds keys past Sk or queries past Sq (whose
        # lse/delta are padding), or, causal, when its first query misses the block's
        # last key.
        needs_mask = key_tail or (k + 1) * block_N > seq_q
        if causal:
            needs_mask = needs_mask or k * block_N + offset < (bx + 1) * block_M - 1
        if needs_mask:
            for i, j in T.Parallel(block_M, block_N):
                key = bx * block_M + i
                query = k * block_N + j
                visible = key < seq_kv and query < seq_q
                if causal:
                    visible = visible and key <= query + offset
                acc_s[i, j] = T.if_then_else(
                    visible, T.exp2(acc_s[i, j] * scale - lse_shared[j] * LOG2E), 0
                )
        else:
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale - lse_shared[j] * LOG2E)

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
    def dq_accumulate(k, by, bz, ds_cast, ds_shared, K_shared, dq, dQ_accum):
        # dQ (this key block's share) = dS K: dSᵀ goes through shared memory to be read
        # transposed, then one whole-tile atomic add (bounds-checked past Sq).
        T.copy(ds_cast, ds_shared)
        T.gemm(ds_shared, K_shared, dq, transpose_A=True, clear_accum=True)
        T.atomic_add(dQ_accum[bz, k * block_N : (k + 1) * block_N, by, :], dq)

    @T.macro
    def epilogue(dv, dk, dV_shared, dK_shared, dV, dK, bx, by, bz):
        # dK and dV of this key block have no other owner: stored once.
        T.copy(dv, dV_shared)
        T.copy(dV_shared, dV[bz, bx * block_M : (bx + 1) * block_M, by, :])
        T.copy(dk, dK_shared)
        T.copy(dK_shared, dK[bz, bx * block_M : (bx + 1) * block_M, by, :])

    @T.prim_func
    def flash_bwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        Delta: T.Tensor([batch, heads, seq_q], accum_dtype),
        dQ_accum: T.Tensor(q_shape, accum_dtype),
        dK: T.Tensor(kv_shape, dtype),
        dV: T.Tensor(kv_shape, dtype),
    ):
        # At least two thread blocks, those past the keys leaving at once: with a grid of extent
        # 1, bx would be the constant 0, and from that TileLang 0.1.15 fails to build some causal
        # shapes with Sq > Sk (ptxas runs out of registers at D128, Sq 255, Sk 17). With more key
        # blocks the test always holds and the compiler drops it.
        with T.Kernel(max(T.ceildiv(seq_kv, block_M), 2), heads, batch, threads=threads) as (
            bx,
            by,
            bz,
        ):
            if bx * block_M < seq_kv:
                K_shared = T.alloc_shared([block_M, dim], dtype)
                V_shared = T.alloc_shared([block_M, dim], dtype)
                Q_shared = T.alloc_shared([block_N, dim], dtype)
                dO_shared = T.alloc_shared([block_N, dim], dtype)
                lse_shared = T.alloc_shared([block_N], accum_dtype)
                delta_shared = T.alloc_shared([block_N], accum_dtype)
                ds_shared = T.alloc_shared([block_M, block_N], dtype)
                dK_shared = T.alloc_shared([block_M, dim], dtype)
                dV_shared = T.alloc_shared([block_M, dim], dtype)
                acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
                acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
                acc_dp = T.alloc_fragment([block_M, block_N], accum_dtype)
                ds_cast = T.alloc_fragment([block_M, block_N], dtype)
                dk = T.alloc_fragment([block_M, dim], accum_dtype)
                dv = T.alloc_fragment([block_M, dim], accum_dtype)
                dq = T.alloc_fragment([block_N, dim], accum_dtype)

                # Keys past Sk read as zeros and are never stored.
                T.copy(K[bz, bx * block_M : (bx + 1) * block_M, by, :], K_shared)
                T.copy(V[bz, bx * block_M : (bx + 1) * block_M, by, :], V_shared)
                T.clear(dk)
                T.clear(dv)

                # Causal: query i sees key j iff i >= j - offset, so the first query block that sees
                # any key of this block is the one holding query bx·block_M − offset. (It is never
                # past the end: the last query sees every key.)
                q_start = 0
                if causal:
                    q_start = T.max(0, bx * block_M - offset) // block_N
                q_end = T.ceildiv(seq_q, block_N)
                key_tail = (bx + 1) * block_M > seq_kv

                for k in T.Pipelined(q_start, q_end, num_stages=num_stages):
                    T.copy(Q[bz, k * block_N : (k + 1) * block_N, by, :], Q_shared)
                    T.copy(lse[bz, by, k * block_N : (k + 1) * block_N], lse_shared)
                    scores(K_shared, Q_shared, acc_s)
                    probabilities(k, bx, key_tail, lse_shared, acc_s)
                    T.copy(dO[bz, k * block_N : (k + 1) * block_N, by, :], dO_shared)
                    T.copy(Delta[bz, by, k * block_N : (k + 1) * block_N], delta_shared)
                    dp(V_shared, dO_shared, acc_dp)
                    dv_update(acc_s, acc_s_cast, dO_shared, dv)
                    ds(acc_s, acc_dp, delta_shared, ds_cast)
                    dk_update(ds_cast, Q_shared, dk)
                    dq_accumulate(k, by, bz, ds_cast, ds_shared, K_shared, dq, dQ_accum)

                epilogue(dv, dk, dV_shared, dK_shared, dV, dK, bx, by, bz)

    return flash_bwd


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd_postprocess(batch, heads, seq_q, dim, dtype="float16", block=64):
    """dQ = dQ_accum converted from float32 to the input dtype."""
    accum_dtype = "float32"
    shape = [batch, seq_q, heads, dim]

    @T.prim_func
    def flash_bwd_post(dQ_accum: T.Tensor(shape, accum_dtype), dQ: T.Tensor(shape, dtype)):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            dq = T.alloc_fragment([block, dim], accum_dtype)
            dq_cast = T.alloc_fragment([block, dim], dtype)
            T.copy(dQ_accum[bz, bx * block : (bx + 1) * block, by, :], dq)
            T.copy(dq, dq_cast)
            T.copy(dq_cast, dQ[bz, bx * block : (bx + 1) * block, by, :])

    return flash_bwd_post


# ----------------------------------------------------------------------------- configurations
def forward_config(dim, arch="sm_90a"):
    """Forward tiles, measured on an H100 for this pipelined forward."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch {arch}: this script is written for Hopper (sm_90a: TMA, WGMMA)")
    if dim <= 64:
        return dict(block_M=192, block_N=128, num_stages=2, threads=384)
    return dict(block_M=128, block_N=128, num_stages=1, threads=256)


def default_config(arch="sm_90a", seq_q=None):
    """Backward tiles: block_M keys per thread block, block_N queries per loop step.

    Hopper: 256 threads are two consumer warpgroups of 64 keys each (TileLang adds a producer
    warpgroup for the TMA loads), and two stages let the next Q/dO tile load while this one is
    used. Measured on an H100 (2026-11-22, B4 S4096 fp16, all of ``tune_configs``): 128 keys ×
    64 queries was fastest at D=64 and D=128, causal or not — 389 TFLOP/s at D128 against 306
    for 128×32 (upstream's choice) and 274 for 64×64 — so neither the head dim nor ``causal``
    changes the choice.
    With fewer than 64 queries (``seq_q``) the 64-query step does not build at D=128 (ptxas runs
    out of registers: TileLang lays that kernel out differently when the tile is taller than
    the tensor), so such short inputs step 32 queries at a time.
    """
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch {arch}: this script is written for Hopper (sm_90a: TMA, WGMMA)")
    block_N = 32 if seq_q is not None and seq_q < 64 else 64
    return dict(block_M=128, block_N=block_N, num_stages=2, threads=256)


def tune_configs():
    """The space ``--tune`` compares: 64 keys per consumer warpgroup (one or two warpgroups),
    32 or 64 queries a step, one or two stages. All of them build for sm_90a at D=64 and D=128;
    which of them spill registers at D=128 (dK and dV take 128 per thread) is for the GPU run
    to show. With 32 queries a step the dQ GEMM is too short for WGMMA and uses mma.sync."""
    return [
        dict(block_M=bm, block_N=bn, num_stages=st, threads=th)
        for bm, th in ((64, 128), (128, 256))
        for bn in (32, 64)
        for st in (1, 2)
    ]


# ----------------------------------------------------------------------------- torch-facing
def device_arch(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def _check_inputs(q, k, v, causal, softmax_scale):
    """ValueError naming the first bad argument; the device last, so any other needs no GPU."""
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
    B, _, H, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        got = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"q, k, v must share a dtype, float16 or bfloat16; got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k, v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        hint = "q's batch, heads, dim: MHA script; GQA: example_gqa_bwd.py"
        raise ValueError(f"k must be [{B}, seqlen_k, {H}, {D}] ({hint}), got {tuple(k.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


def dtype_name(t):
    return "float16" if t.dtype == torch.float16 else "bfloat16"


def attention_forward(q, k, v, causal, softmax_scale):
    """Forward kernel alone: ``out [B, Sq, H, D]`` and ``lse [B, H, Sq]`` (float32, natural log)."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    cfg = forward_config(D, device_arch(q.device))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to launch
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        kernel = flashattn_fwd(B, H, Sq, Sk, D, causal, softmax_scale, dtype_name(q), **cfg)
        kernel(q, k, v, out, lse)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, config=None):
    """The three backward kernels: returns ``dq, dk, dv`` in the input dtype."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    if q.numel() == 0 or k.numel() == 0:  # an empty sum: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtype = dtype_name(q)
    cfg = config or default_config(device_arch(q.device), Sq)
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    flashattn_bwd_preprocess(B, H, Sq, D, dtype)(out, dout, delta)
    dq_accum = torch.zeros(B, Sq, H, D, dtype=torch.float32, device=q.device)  # atomics add here
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    kernel = flashattn_bwd(B, H, Sq, Sk, D, causal, softmax_scale, dtype, **cfg)
    kernel(q, k, v, dout, lse, delta, dq_accum, dk, dv)
    dq = torch.empty_like(q)
    flashattn_bwd_postprocess(B, H, Sq, D, dtype)(dq_accum, dq)
    return dq, dk, dv


# torch.compile: the kernels as custom operators (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls each as one opaque node, without a graph break, and learns their outputs'
# shapes, dtypes and strides from the fake implementations. A config travels as its values in
# CONFIG_KEYS order (an operator takes no dicts; None: the default), so tuned tiles compile too.
# The two halves are two operators joined by register_autograd: the forward operator saves its
# inputs and outputs for the backward operator and carries the config (backward tiles) to it.
CONFIG_KEYS = ("block_M", "block_N", "num_stages", "threads")


@torch.library.custom_op("tl_attn::mha_bwd_bshd_forward", mutates_args=())
def attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, softmax_scale)


@attention_forward_op.register_fake
def _(q, k, v, causal, softmax_scale, config):
    B, Sq, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("tl_attn::mha_bwd_bshd_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    return attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, cfg)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # a statistic for the backward; attention() returns out
    ctx.set_materialize_grads(False)  # backward never reads dlse: no zeros made for it
    ctx.settings = (causal, softmax_scale, config)


def backward(ctx, dout, dlse):
    dq, dk, dv = attention_backward_op(dout, *ctx.saved_tensors, *ctx.settings)
    return dq, dk, dv, None, None, None


attention_forward_op.register_autograd(backward, setup_context=setup_context)


class EagerAttention(torch.autograd.Function):
    """The formula above for eager calls, over the plain functions, without the operators'
    per-call dispatch (docs/CONVENTIONS.md, "Eager calls": why, and why ``forward`` takes
    ``ctx``)."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, causal, softmax_scale = inputs[:5]  # then the backward's config
        output = attention_forward(q, k, v, causal, softmax_scale)
        setup_context(ctx, inputs, output)  # the operators' formula, as they run it
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not zeros
    def backward(ctx, dout, dlse):
        causal, softmax_scale, config = ctx.settings
        cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
        dq, dk, dv = attention_backward(dout, *ctx.saved_tensors, causal, softmax_scale, cfg)
        return dq, dk, dv, None, None, None


def attention(q, k, v, causal=False, softmax_scale=None, config=None):
    """Differentiable FlashAttention for ``q [B, Sq, H, D]``, ``k, v [B, Sk, H, D]`` (fp16/bf16,
    CUDA). Returns ``out [B, Sq, H, D]``. ``config`` overrides the backward tiles
    (see ``default_config``)."""
    _check_inputs(q, k, v, causal, softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    tiles = [config[key] for key in CONFIG_KEYS] if config else None
    # Compiled code (and fake tensors) call the operator; an eager call on real tensors runs the
    # same formula as a plain Function (EagerAttention), without the operator's dispatch.
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    apply = EagerAttention.apply if eager else attention_forward_op
    out, _ = apply(q, k, v, causal, float(softmax_scale), tiles)
    return out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, causal=False, softmax_scale=None):
    """Plain PyTorch in float32 (float64 stays float64; runs on CPU too), differentiable by
    autograd; same conventions as ``attention`` (rows that see no key: out 0, dq 0)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    D = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (Sk - Sq), float("-inf"))
    # softmax of an all -inf row is NaN; such rows get probabilities 0 (and so zero gradient)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
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
    parser = _harness().base_parser(__doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS)
    parser.set_defaults(dim=128)
    return parser


def make_inputs(batch, heads, seq_q, seq_k, dim, dtype, device="cuda", seed=0):
    """Normal random q, k, v (requiring grad) and an upstream gradient dout."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, dim, generator=g, device=device, dtype=dtype)
    k = torch.randn(batch, seq_k, heads, dim, generator=g, device=device, dtype=dtype)
    v = torch.randn(batch, seq_k, heads, dim, generator=g, device=device, dtype=dtype)
    dout = torch.randn(batch, seq_q, heads, dim, generator=g, device=device, dtype=dtype)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def check(batch, heads, seq_q, seq_k, dim, causal, dtype, config=None):
    """Out and dq, dk, dv against autograd through ``ref_program`` (relative error under 1e-2
    for out, 2e-2 for the gradients)."""
    harness = _harness()
    q, k, v, dout = make_inputs(batch, heads, seq_q, seq_k, dim, dtype)
    scale = 1.0 / math.sqrt(dim)
    out = attention(q, k, v, causal, scale, config=config)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dout, causal, scale)
    harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
    harness.check_grads({"dq": dq, "dk": dk, "dv": dv}, {"dq": ref_dq, "dk": ref_dk, "dv": ref_dv})


def benchmark(batch, heads, seq_q, seq_k, dim, causal, dtype, configs=None):
    """Forward+backward and backward alone, ours (one row per entry of ``configs``, a name →
    backward config dict; default: ``default_config``) beside SDPA FLASH (FA2) and cuDNN on the
    same inputs. Returns the rows of both reports: {"fwd+bwd": [...], "bwd": [...]}."""
    harness = _harness()
    q, k, v, dout = make_inputs(batch, heads, seq_q, seq_k, dim, dtype)
    scale = 1.0 / math.sqrt(dim)
    configs = configs or {"tilelang": None}
    fwd_bwd, bwd = {}, {}
    for name, cfg in configs.items():
        out = attention(q, k, v, causal, scale, config=cfg)  # graph kept for backward alone
        fwd_bwd[name] = lambda cfg=cfg: torch.autograd.grad(
            attention(q, k, v, causal, scale, config=cfg), (q, k, v), dout
        )
        bwd[name] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    peers_fwd_bwd, peers_bwd = harness.sdpa_backward_peers(q, k, v, dout, causal, scale)
    fwd = harness.attention_flops(batch, heads, seq_q, seq_k, dim, dim, causal)
    bwd_flops = harness.attention_flops(batch, heads, seq_q, seq_k, dim, dim, causal, True)
    shape = f"B{batch} H{heads} Sq{seq_q} Sk{seq_k} D{dim} causal={causal}"
    shape += " " + str(dtype).removeprefix("torch.")
    return {
        "fwd+bwd": harness.report(
            f"forward+backward {shape}", fwd_bwd, peers_fwd_bwd, fwd + bwd_flops
        ),
        "bwd": harness.report(f"backward {shape}", bwd, peers_bwd, bwd_flops),
    }


def compile_all(batch, heads, seq_q, seq_k, dim, causal, dtype, arch, config=None):
    """Build the four kernels for ``arch`` without a GPU; returns name → CUDA source."""
    harness = _harness()
    scale = 1.0 / math.sqrt(dim)
    cfg = config or default_config(arch, seq_q)
    fwd_cfg = forward_config(dim, arch)
    kernels = {
        "flashattn_fwd": (flashattn_fwd, (seq_k, dim, causal, scale, dtype), fwd_cfg),
        "flashattn_bwd_preprocess": (flashattn_bwd_preprocess, (dim, dtype), {}),
        "flashattn_bwd": (flashattn_bwd, (seq_k, dim, causal, scale, dtype), cfg),
        "flashattn_bwd_postprocess": (flashattn_bwd_postprocess, (dim, dtype), {}),
    }
    return {
        name: harness.compile_for(fn, arch, batch, heads, seq_q, *args, **kw).get_kernel_source()
        for name, (fn, args, kw) in kernels.items()
    }


def _config_name(cfg):
    return f"{cfg['block_M']}x{cfg['block_N']}/{cfg['num_stages']}st/{cfg['threads']}t"


def main(argv=None):
    harness = _harness()
    args = build_parser().parse_args(argv)
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Sk = args.seq_len_k or Sq
    script = pathlib.Path(__file__).name

    if args.compile_only:
        sources = compile_all(B, H, Sq, Sk, D, args.causal, args.dtype, args.arch)
        print(f"{script}: built for {args.arch} with {default_config(args.arch, Sq)}")
        for name, src in sources.items():
            print(harness.describe_source(name, src))
        return

    harness.require_gpu(script, capability=(9, 0))
    dtype = harness.DTYPES[args.dtype]
    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest backward is checked.
        named = {"tilelang " + _config_name(c): c for c in tune_configs()}
        rows = benchmark(B, H, Sq, Sk, D, args.causal, dtype, named)
        config = named[harness.fastest(rows["bwd"])]
        print(f"tuned: {config}")
    if args.check:
        print(f"check B{B} H{H} Sq{Sq} Sk{Sk} D{D} causal={args.causal} {args.dtype}")
        check(B, H, Sq, Sk, D, args.causal, dtype, config)
    if args.bench and not args.tune:
        benchmark(B, H, Sq, Sk, D, args.causal, dtype, {"tilelang": config})


if __name__ == "__main__":
    main()
