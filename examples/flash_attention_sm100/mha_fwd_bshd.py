"""FlashAttention forward, multi-head, BSHD layout, written in TileLang for Blackwell (SM100).

Computes ``O = softmax(Q Kᵀ · scale) V`` for ``q [B, Sq, H, D]`` and ``k, v [B, Sk, H, D]`` with
the same online softmax as the Hopper script (examples/flash_attention/example_mha_fwd_bshd.py):
each thread block owns ``block_M`` query rows, streams K and V ``block_N`` keys at a time and keeps
the running row maximum ``scores_max`` and row sum ``logsum``. It also returns the log-sum-exp
``lse`` of each row, which the backward pass needs.

What it shows on Blackwell: the fifth-generation tensor core instruction (TCGEN05 MMA) is issued
by a single thread, runs asynchronously, and writes its accumulator into tensor memory (TMEM), a
128-lane on-chip memory next to the tensor cores, instead of registers. ``T.alloc_tmem`` reserves
TMEM columns, ``T.tcgen05_gemm(..., mbar=bar)`` issues the MMA and makes it arrive on the mbarrier
``bar`` when it completes, and ``T.mbarrier_wait_parity(bar, phase)`` waits for that. Reading the
accumulator back is a ``T.copy`` from TMEM into a register fragment (``tcgen05.ld``). Three
variants (``--variant``):

- ``ss``  (128 threads): both GEMMs are ``mma_ss`` — operands from shared memory, accumulator in
  TMEM. P goes registers → shared memory → tensor core.
- ``ts``  (256 threads): GEMM 2 is ``mma_ts`` — P is stored into TMEM (``tcgen05.st``) and read
  from there as the A operand, so P never touches shared memory.
- ``wasp`` (256 threads, warp-specialized): warps 0-3 do the softmax, warp 4 issues the TMA loads
  (DMA) into a ``num_stages``-deep ring of K/V buffers, warp 5 issues the MMAs; the output is
  accumulated in TMEM across key blocks, and the roles hand work to each other through mbarriers
  only. If this kernel fails to build, ``attention`` warns and builds ``ts`` instead.

Causal masking is aligned bottom-right (as FlashAttention ≥ 2.1): query ``i`` sees key ``j`` when
``j <= i + Sk - Sq``. A query row that sees no key at all gives ``O = 0`` and ``lse = +inf``.

Status: every kernel is compiled for sm_100a and its generated code inspected by
tests/test_sm100.py; the script has not been run on Blackwell hardware yet. On a B200, ``main``
runs the full numeric check and benchmark.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None, return_lse=False,
              variant="wasp", config=None)

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device;
        headdim 64 or 128.
    k, v: (batch, seqlen_k, nheads, headdim), same dtype and device.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    return_lse: bool. Also return lse: (batch, nheads, seqlen_q), float32, natural log.
    variant: one of "ss", "ts", "wasp" (above).
    config: dict. Tiles (block_M, block_N, and num_stages for ``wasp``); default
        ``default_config``.
    Returns out: (batch, seqlen_q, nheads, headdim), or (out, lse) when return_lse.

Underneath, ``attention`` calls the custom operator ``tl_attn::sm100_mha_fwd_bshd``
(``torch.library``), so ``torch.compile(model, fullgraph=True)`` compiles a model around it without
a graph break; ``variant`` travels as a string.

Run:
    python examples/flash_attention_sm100/mha_fwd_bshd.py --variant wasp --causal
    python examples/flash_attention_sm100/mha_fwd_bshd.py --compile-only --arch sm_100a  # no GPU
"""

import math
import numbers
import pathlib
import sys

import tilelang
import tilelang.language as T
import torch

LOG2E = 1.4426950408889634
# The loops below are plain T.serial loops whose ordering we state with mbarriers ourselves, so
# TileLang's automatic producer/consumer split (built for T.Pipelined) is switched off.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_100a",)  # --arch: Blackwell only (TCGEN05 MMA, tensor memory)
VARIANTS = ("ss", "ts", "wasp")
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one block may use on SM100 (227 KB)
TMEM_COLUMNS = 512  # 128 lanes × 512 columns of 32 bits per SM


# ----------------------------------------------------------------------------- kernels
def softmax_steps(block_M, block_N, dim, seq_q, seq_kv, causal, offset, scale):
    """The steps both kernels below share, as T.macros (inlined where they are called): mask a
    key block's scores, the online softmax over them, the rescale of the running output, and
    the store of each row's lse."""
    accum_dtype = "float32"
    neg_inf = -T.infinity(accum_dtype)

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
            # A row with no visible key yet keeps max = -inf; 0 avoids exp2(-inf + inf).
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
    def store_lse(logsum, scores_max, lse, bx, by, bz):
        # lse = +inf for a row with no visible key (logsum = 0).
        for i in T.Parallel(block_M):
            if bx * block_M + i < seq_q:
                lse[bz, by, bx * block_M + i] = T.if_then_else(
                    logsum[i] > 0,
                    (T.log2(logsum[i]) + scores_max[i] * scale) / LOG2E,
                    T.infinity(accum_dtype),
                )

    return mask, softmax, rescale, store_lse


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
    variant="ss",
    block_M=128,
    block_N=128,
):
    """The ``ss`` and ``ts`` kernels: one loop, every step waited for before the next."""
    if variant not in ("ss", "ts"):
        raise ValueError(f"flashattn_fwd builds the ss and ts variants, got {variant!r}")
    use_ts = variant == "ts"
    # ts: two warpgroups share the 128 TMEM lanes; each reads half of the columns.
    threads = 256 if use_ts else 128
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    offset = seq_kv - seq_q  # bottom-right causal alignment
    neg_inf = -T.infinity(accum_dtype)
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads, dim]

    mask, softmax, rescale, store_lse = softmax_steps(
        block_M, block_N, dim, seq_q, seq_kv, causal, offset, scale
    )

    # The steps of one key block and the epilogue, named. T.macro is inlined: the generated
    # CUDA is the same as with the steps written out in the loop.
    @T.macro
    def scores(Q_shared, K_shared, S_tmem, s_ready):
        # GEMM 1 (mma_ss): S = Q Kᵀ into TMEM; one elected thread issues it.
        T.tcgen05_gemm(Q_shared, K_shared, S_tmem, transpose_B=True, clear_accum=True, mbar=s_ready)

    @T.macro
    def pv(acc_s_cast, P_tmem, P_shared, V_shared, PV_tmem, pv_ready):
        # GEMM 2: this block's P V into TMEM. ss reads P from shared memory, ts from TMEM.
        if use_ts:
            T.copy(acc_s_cast, P_tmem)  # tcgen05.st: registers → TMEM
            # every warp's P columns must be in TMEM before one thread issues the MMA
            T.sync_threads()
            T.tcgen05_gemm(P_tmem, V_shared, PV_tmem, clear_accum=True, mbar=pv_ready)
        else:
            T.copy(acc_s_cast, P_shared)
            T.tcgen05_gemm(P_shared, V_shared, PV_tmem, clear_accum=True, mbar=pv_ready)

    @T.macro
    def pv_accumulate(k, pv_ready, PV_tmem, acc_pv, acc_o):
        # O += this block's P V, once GEMM 2 is done.
        T.mbarrier_wait_parity(pv_ready, k % 2)
        T.copy(PV_tmem, acc_pv)
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] += acc_pv[i, j]

    @T.macro
    def epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz):
        # Normalise; rows with no visible key (logsum = 0) give O = 0 and lse = +inf.
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
        T.copy(acc_o, O_shared)
        T.copy(O_shared, Output[bz, bx * block_M : (bx + 1) * block_M, by, :])
        store_lse(logsum, scores_max, lse, bx, by, bz)

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
            # Accumulators live in tensor memory: S = Q Kᵀ and this block's P V.
            S_tmem = T.alloc_tmem([block_M, block_N], accum_dtype)
            PV_tmem = T.alloc_tmem([block_M, dim], accum_dtype)
            # P, the A operand of GEMM 2: in TMEM (ts) or in shared memory (ss); the other name
            # is None, so that one pv macro takes both.
            P_tmem = T.alloc_tmem([block_M, block_N], dtype) if use_ts else None
            P_shared = None if use_ts else T.alloc_shared([block_M, block_N], dtype)
            s_ready = T.alloc_barrier(1)  # GEMM 1 done (one arrival: the MMA's commit)
            pv_ready = T.alloc_barrier(1)  # GEMM 2 done
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_pv = T.alloc_fragment([block_M, dim], accum_dtype)
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
            # tail block and, when causal, the blocks crossing the diagonal).
            n_blocks = T.ceildiv(seq_kv, block_N)
            first_masked = seq_kv // block_N
            if causal:
                last_key = (bx + 1) * block_M + offset  # one past the last key this block sees
                n_blocks = T.max(0, T.min(n_blocks, T.ceildiv(last_key, block_N)))
                first_masked = T.min(first_masked, T.max(0, (bx * block_M + offset) // block_N))

            # A plain loop, not T.Pipelined: the MMA reads K_shared/V_shared asynchronously, so a
            # buffer may be refilled only after the barrier of the GEMM reading it was waited on.
            for k in T.serial(n_blocks):
                T.copy(K[bz, k * block_N : (k + 1) * block_N, by, :], K_shared)
                scores(Q_shared, K_shared, S_tmem, s_ready)
                # Load V while GEMM 1 runs: its last reader, GEMM 2 of step k-1, was waited on.
                T.copy(V[bz, k * block_N : (k + 1) * block_N, by, :], V_shared)
                T.mbarrier_wait_parity(s_ready, k % 2)  # the barrier completes once per step
                T.copy(S_tmem, acc_s)  # tcgen05.ld: TMEM → registers
                mask(k, first_masked, bx, acc_s)
                softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                T.copy(acc_s, acc_s_cast)  # P in 16 bits: the A operand of GEMM 2
                pv(acc_s_cast, P_tmem, P_shared, V_shared, PV_tmem, pv_ready)
                rescale(acc_o, scores_scale)  # while GEMM 2 runs
                pv_accumulate(k, pv_ready, PV_tmem, acc_pv, acc_o)

            epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz)

    return flash_fwd


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd_wasp(
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
    num_stages=2,
):
    """The warp-specialized kernel: softmax warps 0-3, DMA warp 4, MMA warp 5 (256 threads).

    Barriers, and who arrives on them (count in brackets):
      k_full[s], v_full[s]  DMA warp after issuing the TMA loads of stage s [32 + bytes]
      kv_empty[s]           MMA commit once both GEMMs reading stage s are done [1]
      s_full                GEMM 1 done: S is in TMEM [1]
      s_free                softmax warps have read S, GEMM 1 may overwrite it [128]
      p_full                softmax warps wrote P and rescaled O in TMEM [128]
      o_full                GEMM 2 done: O is current, P may be overwritten [1]
    Every barrier completes exactly once per key block, so the phase to wait for is the block
    count modulo 2 (per stage: the number of times that stage was used, modulo 2).
    """
    threads = 256
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E
    offset = seq_kv - seq_q
    neg_inf = -T.infinity(accum_dtype)
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads, dim]

    mask, softmax, rescale, store_lse = softmax_steps(
        block_M, block_N, dim, seq_q, seq_kv, causal, offset, scale
    )

    # The MMA warp's two GEMMs and the epilogue, named (T.macro is inlined).
    @T.macro
    def scores(stage, Q_shared, K_shared, S_tmem, s_full):
        # GEMM 1 (mma_ss): S = Q Kᵀ into TMEM.
        T.tcgen05_gemm(
            Q_shared,
            K_shared[stage, :, :],
            S_tmem,
            transpose_B=True,
            clear_accum=True,
            mbar=s_full,
        )

    @T.macro
    def pv(k, stage, P_tmem, V_shared, O_tmem, o_full):
        # GEMM 2 (mma_ts): O += P V, P read from TMEM; the first block starts O.
        T.tcgen05_gemm(P_tmem, V_shared[stage, :, :], O_tmem, clear_accum=k == 0, mbar=o_full)

    @T.macro
    def epilogue(acc_o, acc_o_cast, logsum, scores_max, Output, lse, bx, by, bz):
        # Normalise; rows with no visible key (logsum = 0) give O = 0 and lse = +inf.
        for i, j in T.Parallel(block_M, dim):
            acc_o_cast[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
        T.copy(acc_o_cast, Output[bz, bx * block_M : (bx + 1) * block_M, by, :])
        store_lse(logsum, scores_max, lse, bx, by, bz)

    @T.prim_func
    def flash_fwd_wasp(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        Output: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            S_tmem = T.alloc_tmem([block_M, block_N], accum_dtype)
            P_tmem = T.alloc_tmem([block_M, block_N], dtype)
            O_tmem = T.alloc_tmem([block_M, dim], accum_dtype)  # the output, accumulated here

            q_full = T.alloc_barrier(32)
            k_full = T.alloc_barrier([32] * num_stages)
            v_full = T.alloc_barrier([32] * num_stages)
            kv_empty = T.alloc_barrier([1] * num_stages)
            s_full = T.alloc_barrier(1)
            s_free = T.alloc_barrier(128)
            p_full = T.alloc_barrier(128)
            o_full = T.alloc_barrier(1)

            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum_dtype)
            acc_o_cast = T.alloc_fragment([block_M, dim], dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)

            tid = T.get_thread_binding()
            n_blocks = T.ceildiv(seq_kv, block_N)
            first_masked = seq_kv // block_N
            if causal:
                last_key = (bx + 1) * block_M + offset
                n_blocks = T.max(0, T.min(n_blocks, T.ceildiv(last_key, block_N)))
                first_masked = T.min(first_masked, T.max(0, (bx * block_M + offset) // block_N))

            # Prime the "empty" side of every ring: one arrival completes phase 0 of each K/V
            # stage and of s_free, so the first pass of the DMA and MMA warps (waiting for phase
            # 0) finds every buffer free, for any num_stages. Later phases are completed by real
            # consumers, and the k-th use of a stage waits for phase (k // num_stages) % 2.
            if tid == 0:
                for s in T.serial(num_stages):
                    T.mbarrier_arrive(kv_empty[s])
                for _ in T.serial(128):  # s_free expects the 128 softmax threads
                    T.mbarrier_arrive(s_free)

            if tid >= 128 and tid < 160:
                # ---- DMA warp: TMA loads into the K/V ring
                T.tma_copy(
                    Q[bz, bx * block_M : (bx + 1) * block_M, by, :], Q_shared, barrier=q_full
                )
                T.mbarrier_arrive(q_full)
                for k in T.serial(n_blocks):
                    stage = k % num_stages
                    T.mbarrier_wait_parity(kv_empty[stage], (k // num_stages) % 2)
                    T.tma_copy(
                        K[bz, k * block_N : (k + 1) * block_N, by, :],
                        K_shared[stage, :, :],
                        barrier=k_full[stage],
                    )
                    T.mbarrier_arrive(k_full[stage])
                    T.tma_copy(
                        V[bz, k * block_N : (k + 1) * block_N, by, :],
                        V_shared[stage, :, :],
                        barrier=v_full[stage],
                    )
                    T.mbarrier_arrive(v_full[stage])
            elif tid >= 160 and tid < 192:
                # ---- MMA warp: issues both GEMMs; the tensor core runs them asynchronously
                T.mbarrier_wait_parity(q_full, 0)
                for k in T.serial(n_blocks):
                    stage = k % num_stages
                    T.mbarrier_wait_parity(k_full[stage], (k // num_stages) % 2)
                    T.mbarrier_wait_parity(s_free, k % 2)  # primed for k = 0
                    scores(stage, Q_shared, K_shared, S_tmem, s_full)
                    T.mbarrier_wait_parity(p_full, k % 2)
                    T.mbarrier_wait_parity(v_full[stage], (k // num_stages) % 2)
                    pv(k, stage, P_tmem, V_shared, O_tmem, o_full)
                    # tcgen05.commit: arrives when every MMA issued so far (both GEMMs that read
                    # this stage) has finished, so the DMA warp may refill it.
                    T.tcgen05_mma_arrive(kv_empty[stage])
            elif tid < 128:
                # ---- softmax warps: one TMEM lane (query row) per thread
                T.fill(logsum, 0)
                T.fill(scores_max, neg_inf)
                for k in T.serial(n_blocks):
                    T.mbarrier_wait_parity(s_full, k % 2)
                    T.copy(S_tmem, acc_s)
                    T.mbarrier_arrive(s_free)  # S is in registers: GEMM 1 of k+1 may start
                    mask(k, first_masked, bx, acc_s)
                    softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                    T.copy(acc_s, acc_s_cast)
                    if k > 0:
                        # GEMM 2 of block k-1 must be done: it wrote O and read P.
                        T.mbarrier_wait_parity(o_full, (k - 1) % 2)
                        T.copy(O_tmem, acc_o)
                        rescale(acc_o, scores_scale)
                        T.copy(acc_o, O_tmem)
                    T.copy(acc_s_cast, P_tmem)
                    T.mbarrier_arrive(p_full)

                # Epilogue: wait for the last GEMM 2 before reading O from TMEM.
                T.fill(acc_o, 0)
                if n_blocks > 0:
                    T.mbarrier_wait_parity(o_full, (n_blocks - 1) % 2)
                    T.copy(O_tmem, acc_o)
                epilogue(acc_o, acc_o_cast, logsum, scores_max, Output, lse, bx, by, bz)

    return flash_fwd_wasp


def flashattn_ss(*args, **kwargs):
    """The ``ss`` kernel, variant pinned: both GEMMs read shared memory."""
    return flashattn_fwd(*args, variant="ss", **kwargs)


def flashattn_ts(*args, **kwargs):
    """The ``ts`` kernel, variant pinned: GEMM 2 reads P from tensor memory."""
    return flashattn_fwd(*args, variant="ts", **kwargs)


def default_config(variant):
    """Tiles for a variant: 128 query rows (one per TMEM lane), 128 keys, which fit shared memory
    and TMEM at every supported head dim; the warp-specialized kernel keeps two K/V stages in
    flight. Checked against SM100's limits by ``smem_bytes``/``tmem_columns`` below."""
    if variant == "wasp":
        return dict(block_M=128, block_N=128, num_stages=2)
    return dict(block_M=128, block_N=128)


def smem_bytes(variant, dim, block_M, block_N, num_stages=1, elem_bytes=2):
    """Dynamic shared memory one block asks for, in bytes (16-bit elements):

        ss:   Q (M·D) + K, V (2·N·D) + O (M·D) + P (M·N)   M=N=D=128: 163840
        ts:   Q (M·D) + K, V (2·N·D) + O (M·D)             M=N=D=128: 131072
        wasp: Q (M·D) + stages · K, V (2·N·D)              M=N=D=128, 2 stages: 163840
    all under SM100's 232448 (a third wasp stage would need 229376, still under; a fourth not).
    TileLang may reuse a buffer's bytes once its last reader is done (O reuses Q's), so the
    compiled kernel can ask for less; never more.
    """
    if variant == "wasp":
        elems = block_M * dim + num_stages * 2 * block_N * dim
    else:
        elems = 2 * block_M * dim + 2 * block_N * dim
        if variant == "ss":
            elems += block_M * block_N
    return elems * elem_bytes


def tmem_columns(variant, dim, block_N):
    """TMEM columns (of 512): fp32 S (N) + fp32 PV/O (D), plus 16-bit P for ts/wasp, which
    TileLang packs two to a 32-bit column (N/2); each allocation rounds up to a power of 2."""

    def alloc(cols):
        return max(32, 1 << (cols - 1).bit_length())

    cols = alloc(block_N) + alloc(dim)
    if variant != "ss":
        cols += alloc(block_N // 2)
    return cols


def check_config(variant, dim, cfg):
    """Refuse a tile choice that cannot fit one SM100 block."""
    need = smem_bytes(variant, dim, **cfg)
    if need > SMEM_LIMIT:
        raise ValueError(f"{variant} {cfg}: {need} bytes of shared memory > {SMEM_LIMIT}")
    cols = tmem_columns(variant, dim, cfg["block_N"])
    if cols > TMEM_COLUMNS:
        raise ValueError(f"{variant} {cfg}: {cols} TMEM columns > {TMEM_COLUMNS}")


# ----------------------------------------------------------------------------- building
def _compile(jit_fn, args, kwargs, target):
    """Compile for this GPU (``target=None``) or, without one, for a target such as
    ``{"kind": "cuda", "arch": "sm_100a"}``."""
    if target is None:
        return jit_fn(*args, **kwargs)
    program = jit_fn.get_tir(*args, **kwargs)
    return tilelang.compile(program, target=target, pass_configs=jit_fn.pass_configs)


def build_forward(variant, args, config=None, target=None):
    """Build the forward kernel for ``variant``; return ``(kernel, variant_built)``.

    ``args`` = (batch, heads, seq_q, seq_kv, dim, causal, softmax_scale, dtype). The
    warp-specialized kernel leans on the newest parts of TileLang's TCGEN05 support; if it does
    not build, warn and build ``ts`` (the same math, one loop) instead.
    """
    dim = args[4]
    if variant == "wasp":
        cfg = config or default_config("wasp")
        check_config("wasp", dim, cfg)
        try:
            return _compile(flashattn_fwd_wasp, args, cfg, target), "wasp"
        except Exception as err:  # any build failure: the fallback is the point
            first_line = (str(err).strip().splitlines() or [""])[0]
            print(
                f"warning: the wasp kernel failed to build ({type(err).__name__}: {first_line}); "
                "falling back to the ts variant",
                file=sys.stderr,
            )
            variant, config = "ts", None
    cfg = config or default_config(variant)
    check_config(variant, dim, cfg)
    pinned = flashattn_ss if variant == "ss" else flashattn_ts
    if target is None:
        return pinned(*args, **cfg), variant
    return _compile(flashattn_fwd, args, {"variant": variant, **cfg}, target), variant


# ----------------------------------------------------------------------------- torch-facing
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
    B, _, H, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        got = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"q, k, v must share a dtype, float16 or bfloat16; got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k, v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        hint = "q's batch, heads, dim: MHA script; GQA: gqa_fwd_bshd.py"
        raise ValueError(f"k must be [{B}, seqlen_k, {H}, {D}] ({hint}), got {tuple(k.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


_kernels = {}


def attention_forward(q, k, v, causal, softmax_scale, config=None, variant="wasp"):
    """The kernel on checked, contiguous input: ``out`` and ``lse`` (what the operator runs)."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to build
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        dtype = "float16" if q.dtype == torch.float16 else "bfloat16"
        args = (B, H, Sq, Sk, D, bool(causal), float(softmax_scale), dtype)
        key = (variant, args, tuple(sorted((config or {}).items())))
        if key not in _kernels:  # remembers a wasp → ts fallback, so it warns once
            _kernels[key] = build_forward(variant, args, config)[0]
        _kernels[key](q, k, v, out, lse)
    return out, lse


# torch.compile: the kernel as a custom operator (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls it as one opaque node, without a graph break, and learns its outputs'
# shapes, dtypes and strides from the fake implementation. The variant is an operator argument (a
# string); a config travels as its values in that variant's CONFIG_KEYS order (an operator takes
# no dicts; None: the default).
CONFIG_KEYS = {
    "ss": ("block_M", "block_N"),
    "ts": ("block_M", "block_N"),
    "wasp": ("block_M", "block_N", "num_stages"),
}


def operator_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    variant: str,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS[variant], config, strict=True)) if config else None
    return attention_forward(q, k, v, causal, softmax_scale, cfg, variant)


attention_forward_op = torch.library.custom_op(
    "tl_attn::sm100_mha_fwd_bshd", operator_forward, mutates_args=()
)


@attention_forward_op.register_fake
def _(q, k, v, causal, softmax_scale, variant, config):
    B, Sq, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


def attention(
    q, k, v, causal=False, softmax_scale=None, return_lse=False, variant="wasp", config=None
):
    """FlashAttention forward on Blackwell for ``q [B, Sq, H, D]``, ``k, v [B, Sk, H, D]``.

    Returns ``out [B, Sq, H, D]``, and ``lse [B, H, Sq]`` (float32, natural log) when
    ``return_lse``. ``variant`` is one of ``VARIANTS``; ``config`` overrides the tiles.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    _check_inputs(q, k, v, causal, softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    tiles = [config[key] for key in CONFIG_KEYS[variant]] if config else None
    # Compiled code, fake tensors and calls autograd records take the operator (a backward
    # through it is then an error, not a silent zero gradient); any other eager call runs its
    # body without the operator's dispatch (docs/CONVENTIONS.md, "Eager calls").
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    forward = operator_forward if eager and not recorded else attention_forward_op
    out, lse = forward(q, k, v, causal, float(softmax_scale), variant, tiles)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, causal=False, softmax_scale=None, return_lse=False):
    """Plain PyTorch in float32 (float64 inputs stay float64; runs on CPU too), same conventions
    as ``attention``."""
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
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key: probabilities 0, output 0, lse +inf (FlashAttention's convention).
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    # No --tune: the SM100 kernels have one set of tiles, no tune_configs to compare.
    parser = _harness().base_parser(
        __doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS, tune=False
    )
    parser.add_argument("--variant", choices=VARIANTS, default="wasp", help="see the docstring")
    return parser


def main(argv=None):
    harness = _harness()
    args = build_parser().parse_args(argv)
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Sk = args.seq_len_k or Sq
    scale = 1.0 / math.sqrt(D)
    script = pathlib.Path(__file__).name

    if args.compile_only:
        kargs = (B, H, Sq, Sk, D, args.causal, scale, args.dtype)
        kernel, built = build_forward(args.variant, kargs, target=harness.target_for(args.arch))
        print(f"{script}: built the {built} variant for {args.arch}")
        print(harness.describe_source(f"flashattn_fwd[{built}]", kernel.get_kernel_source()))
        return

    harness.require_gpu(script, arch="sm_100a", capability=(10, 0))
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Sk, H, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Sk, H, D, device="cuda", dtype=dtype)

    def run():
        return attention(q, k, v, args.causal, scale, variant=args.variant)

    if args.check:
        out, lse = attention(q, k, v, args.causal, scale, return_lse=True, variant=args.variant)
        ref_out, ref_lse = ref_program(q, k, v, args.causal, scale, return_lse=True)
        print(f"check {args.variant} B{B} H{H} Sq{Sq} Sk{Sk} D{D} causal={args.causal}")
        harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
        harness.check_close("lse", lse, ref_lse, rtol=1e-3)  # fp32 statistics: tighter

    if args.bench:
        flops = harness.attention_flops(B, H, Sq, Sk, D, D, args.causal)
        peers = harness.sdpa_peers(q, k, v, args.causal, scale)
        title = f"forward {args.variant} B{B} H{H} Sq{Sq} Sk{Sk} D{D} causal={args.causal}"
        harness.report(title, {f"tilelang_{args.variant}": run}, peers, flops)


if __name__ == "__main__":
    main()
