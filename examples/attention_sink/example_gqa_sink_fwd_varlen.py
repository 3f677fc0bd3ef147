"""Attention with sinks and a sliding window (gpt-oss style), GQA forward, variable-length (packed)
batches, TileLang on Hopper (SM90).

The attention of example_gqa_sink_fwd_bhsd.py (read its docstring for the semantics) over the
packed layout of examples/flash_attention/example_gqa_fwd_varlen.py:

    q [total_q, H, D]    k, v [total_k, Hkv, D]    cu_seqlens_q, cu_seqlens_k: int32 [B + 1]

Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows
``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``; its queries attend to its own keys only, and query and
key lengths may differ per sequence. Per sequence, with its own lengths ``Sq`` and ``Sk``:

- the sliding window ``window_size = (left, right)``: query ``i`` sees key ``j`` when
  ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (``-1``: no bound on that side; bottom-right
  aligned within the sequence). ``causal=True`` sets ``right = 0``, as FlashAttention does;
- the sinks: one extra logit per query head, ``sinks[h]`` (float32), that joins each row's
  softmax denominator but has no value vector, so a row may give less than all of its weight to
  the keys. ``sinks=None`` is plain attention. ``lse`` includes the sink.

A query row that sees no key (a sequence without keys, rows before a causal diagonal, a window
that ends before key 0) gives ``out = 0`` and ``lse = +inf``, with or without a sink.

The kernel is the persistent warp-specialized varlen forward (a producer warp loading Q and
a K/V ring by TMA at each sequence's packed offset, consumer warpgroups with asynchronous WGMMA
and ``setmaxnreg``, one thread block per SM walking a tile list built on the host, guarded stores
of a sequence's last partial query block) with the BHSD sink forward's two additions:

- a tile's key loop covers only the key blocks of its window (``window_key_blocks``) and masks
  only the blocks that straddle an edge (``window_mask_runs``: with a left edge the loop runs
  in three parts, masked, whole, masked). Both functions come from example_gqa_sink_fwd_bhsd.py
  and here take the sequence's lengths as run-time values, read from ``cu_seqlens`` in the
  kernel. The producer and the consumers call them alike, so they walk the same blocks and agree
  on the ring's stages and barrier phases; the host's tile list (``tile_schedule``) charges each
  tile the same blocks, so the thread blocks get balanced work under any window;
- the sink is folded into the softmax once per row, in the epilogue, as in the BHSD forward;
- Q in two shared-memory slots (``q_stages``), as in the BHSD forward: the next tile's Q loads
  while this one's short window still computes;
- a last round of fewer tiles than SMs goes in parts over the window's key blocks, as in the
  varlen forward (its ``last_round_parts``): each part leaves its output and lse without the
  sink, and a second kernel (``flashattn_fwd_varlen_combine``) merges a row's parts and adds
  its sink once, the epilogue's fold over the parts.

Reused from the sibling scripts (imported, not copied): the window helpers, ``normalize_window``,
the reference, the tile configurations and ``entry`` (a kernel's compiled entry point) from
example_gqa_sink_fwd_bhsd.py; the ``cu_seqlens``
checks, the host read of its values, the deal of the tile list (``deal_tiles``) and the padded
test batch from examples/flash_attention/example_gqa_fwd_varlen.py.

API (FlashAttention's ``flash_attn_varlen_func`` conventions; docs/CONVENTIONS.md):

    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     sinks=None, window_size=(-1, -1), causal=False, softmax_scale=None,
                     return_lse=False, config=None)

    q: (total_q, nheads, headdim), float16 or bfloat16, on a CUDA device; headdim 64 or 128.
    k, v: (total_k, nheads_k, headdim), same dtype and device; nheads a multiple of nheads_k.
    cu_seqlens_q, cu_seqlens_k: (batch + 1,), int32, on q's device. Cumulative sequence
        lengths, starting at 0.
    max_seqlen_q, max_seqlen_k: int. At least the longest query / key sequence.
    sinks: (nheads,), float32, on q's device, or None. One logit per query head, in the units of
        the scaled scores QKᵀ · softmax_scale; -inf is allowed (no sink for that head).
    window_size: (left, right), ints >= -1. The sliding window (above); -1 is unbounded.
    causal: bool. right = 0 (bottom-right aligned per sequence), whatever window_size[1] says.
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    return_lse: bool. Also return lse: (nheads, total_q), float32, natural log, including the
        sink; +inf for a row that sees no key.
    config: dict. Tile configuration (block_M, block_N, num_stages, q_stages); default
        ``default_config``.
    Returns out: (total_q, nheads, headdim), or (out, lse) when return_lse.

Underneath, ``attention_varlen`` calls the custom operator ``tl_attn::gqa_sink_fwd_varlen``
(``torch.library``), which also reads and checks the ``cu_seqlens`` values, so
``torch.compile(model, fullgraph=True)`` compiles a model around it without a graph break.

Run:
    python examples/attention_sink/example_gqa_sink_fwd_varlen.py --causal --window 128 0
    python examples/attention_sink/example_gqa_sink_fwd_varlen.py --window 64 64 --no-sinks
    python examples/attention_sink/example_gqa_sink_fwd_varlen.py --compile-only --arch sm_90a
"""

import functools
import math
import pathlib
import sys

import tilelang
import tilelang.language as T
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import example_gqa_sink_fwd_bhsd as sink  # noqa: E402  (the sibling BHSD sink forward)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "flash_attention"))
import example_gqa_fwd_varlen as varlen  # noqa: E402  (the persistent varlen forward)

LOG2E = sink.LOG2E
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    # The kernel splits producer and consumers itself (below); no automatic warp specialization.
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_90a",)  # --arch: Hopper only (TMA, WGMMA and setmaxnreg throughout)
PRODUCER_REGS = 24
# tile_schedule: the busiest thread block's whole walk, in key blocks (plus one a tile), from
# which a last round of few tiles goes in parts. Measured on an H200 (2026-11-29, bf16, one
# process, against whole tiles): the parts cut the GPU's time 1.2-3.2x (CUDA graphs) on five
# few-tile batches, but add 25-35 µs to a call's 60-90 µs of host time; timed call by call they
# won 1.86x where the whole walk was 65-129 blocks (2 x 256 queries over 2 x 8192 keys, H8,
# causal; 128 over 16384, H32/Hkv8) and lost 0.68-0.71x where it was 25-33 (4 x 64 over
# 4 x 4096, H16; a window of 3000 over 8000 keys, D64). With ``forward_plan`` (a call's host
# time about halved, the parts' share 15-23 µs) the parts at a bound of 16 still lost on those
# two batches, 0.94x and 0.71x.
MIN_SPLIT_WALK = 64
# The window's key blocks and masked runs of a tile (example_gqa_sink_fwd_bhsd.py): on ints they
# give ints, on the kernel's run-time lengths TileLang expressions.
window_key_blocks = sink.window_key_blocks
window_mask_runs = sink.window_mask_runs
normalize_window = sink.normalize_window
window_mask = sink.window_mask
entry = sink.entry  # a kernel's compiled entry point, launched without TileLang's call wrapper


# ----------------------------------------------------------------------------- kernel
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd_varlen(
    heads,
    heads_kv,
    dim,
    window_left,  # -1 or >= 0, as normalised by normalize_window (causal is window_right = 0)
    window_right,
    has_sinks,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=128,
    num_stages=2,
    q_stages=1,
):
    accum_dtype = "float32"
    groups = heads // heads_kv
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    neg_inf = -T.infinity(accum_dtype)
    # Sizes that change from batch to batch are dynamic: no recompilation for a new batch. The
    # tile list (tile_schedule) is [rounds, grid, 6], and its grid is the launch grid; slots:
    # the parts' outputs (one, unused, when no tile goes in parts).
    total_q, total_k, batch, rounds, grid, slots = T.dynamic(
        "total_q, total_k, batch, rounds, grid, slots"
    )
    consumers = 2 * block_M  # one consumer warpgroup (128 threads) per 64 query rows
    # A thread block is given the 64K-register file at launch, a thread's share rounded down to
    # a multiple of 8; setmaxnreg only moves registers among its warps (a request beyond that
    # allocation waits forever). The producer keeps 24 a thread; the consumers share the rest
    # (multiples of 8, at most 240): 240 for two consumer warpgroups, 160 for three, 112 for four.
    regs = 65536 // (consumers + 128) // 8 * 8 * (consumers + 128)
    consumer_regs = min(240, (regs - 128 * PRODUCER_REGS) // consumers // 8 * 8)

    def key_range(m_blk, seq_len_q, seq_len_k):
        # The tile's key blocks n_start … n_start + n_blocks − 1 (at least one: a tile whose
        # rows see no key visits one block, masked whole, and writes O = 0, lse = +inf).
        return window_key_blocks(
            m_blk, block_M, block_N, seq_len_q, seq_len_k, window_left, window_right
        )

    def mask_runs(m_blk, n_start, n_blocks, seq_len_q, seq_len_k):
        return window_mask_runs(
            m_blk, n_start, n_blocks, block_M, block_N, seq_len_q, seq_len_k, window_left,
            window_right,
        )  # fmt: skip

    # ------------------------------------------------------------------ the steps, named
    # T.macro is inlined where it is called: the generated CUDA is the same as with the steps
    # written out in the loops below.
    @T.macro
    def load_q(Q, Q_shared, q_full, q_empty, tile_count, q_row, by):
        # Producer: wait until the consumers are done with the last tile's Q, then load this
        # one from packed row q_row. A fresh mbarrier counts as having completed the phase
        # before phase 0, so the first wait on an "empty" barrier (parity 1) passes at once.
        # Rows past the sequence read the next sequence's queries (or zeros past the tensor):
        # they are never stored.
        slot = tile_count % q_stages
        T.mbarrier_wait_parity(q_empty[slot], ((tile_count // q_stages) & 1) ^ 1)
        T.tma_copy(Q[q_row : q_row + block_M, by, :], Q_shared[slot, :, :], barrier=q_full[slot])
        T.barrier_arrive(q_full[slot])

    @T.macro
    def load_kv(K, V, K_shared, V_shared, k_full, v_full, k_empty, v_empty, g, kv_row, by):
        # Producer: the key block starting at packed row kv_row into ring slot g (stage
        # g % num_stages, phase g // num_stages). Keys past the sequence are masked later.
        stage = g % num_stages
        phase = (g // num_stages) & 1
        T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
        T.tma_copy(
            K[kv_row : kv_row + block_N, by // groups, :], K_shared[stage, :, :],
            barrier=k_full[stage],
        )  # fmt: skip
        T.barrier_arrive(k_full[stage])
        T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
        T.tma_copy(
            V[kv_row : kv_row + block_N, by // groups, :], V_shared[stage, :, :],
            barrier=v_full[stage],
        )  # fmt: skip
        T.barrier_arrive(v_full[stage])

    @T.macro
    def scores(Q_shared, K_stage, acc_s):
        # S = Q Kᵀ of one key block, issued asynchronously (the caller waits).
        T.wgmma_gemm(
            Q_shared,
            K_stage,
            acc_s,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )

    @T.macro
    def pv(acc_s_cast, V_stage, acc_o):
        # O += P V of one key block, issued asynchronously (the caller waits).
        T.wgmma_gemm(acc_s_cast, V_stage, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def mask(kb, row0, seq_len_q, seq_len_k, acc_s):
        # Scores outside the window, or past the sequence's keys (the next sequence's), become
        # -inf. Called only on the blocks that window_mask_runs marks (and on the first block
        # of a window bounded on the left).
        for i, j in T.Parallel(block_M, block_N):
            key = kb * block_N + j
            centre = row0 + i + seq_len_k - seq_len_q  # bottom-right, per sequence
            visible = key < seq_len_k
            if window_right >= 0:
                visible = visible and key <= centre + window_right
            if window_left >= 0:
                visible = visible and key >= centre - window_left
            acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], neg_inf)

    @T.macro
    def softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum):
        # Online softmax: fold the block into the running row max and row sum, and turn the
        # scores into P = exp2(S·scale − max·scale). The sink is not here: see epilogue.
        T.copy(scores_max, scores_max_prev)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            # A row that has seen no visible key yet keeps max = -inf; using 0 instead makes
            # exp2 give 0 rather than NaN (-inf - -inf).
            scores_max[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i])
            scores_scale[i] = T.exp2(scores_max_prev[i] * scale - scores_max[i] * scale)
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale - scores_max[i] * scale)
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def rescale(acc_o, scores_scale):
        # What was accumulated under the old row max, brought to the new one.
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def key_step(
        g, kb, masked, q_slot, row0, seq_len_q, seq_len_k, Q_shared, K_shared, V_shared, acc_s,
        acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale, scores_sum, logsum, k_full,
        v_full, k_empty, v_empty,
    ):  # fmt: skip
        # One key block after the first (ring slot g, key block kb of the sequence): issue
        # S = Q K(kb)ᵀ and O += P V of the previous block back to back (asynchronous WGMMA),
        # wait for S only, and run its softmax while the P V GEMM still occupies the tensor
        # cores.
        stage = g % num_stages
        prev = (g - 1) % num_stages
        T.mbarrier_wait_parity(k_full[stage], (g // num_stages) & 1)
        T.mbarrier_wait_parity(v_full[prev], ((g - 1) // num_stages) & 1)
        scores(Q_shared[q_slot, :, :], K_shared[stage, :, :], acc_s)
        pv(acc_s_cast, V_shared[prev, :, :], acc_o)
        T.wait_wgmma(1)  # S is ready; the previous block's P V may still run
        T.barrier_arrive(k_empty[stage])
        if masked:
            mask(kb, row0, seq_len_q, seq_len_k, acc_s)
        softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
        T.wait_wgmma(0)  # acc_o and acc_s_cast are free again
        T.barrier_arrive(v_empty[prev])
        rescale(acc_o, scores_scale)
        T.copy(acc_s, acc_s_cast)

    @T.macro
    def epilogue(
        acc_o, logsum, scores_max, sink_logit, factor, row_lse, O_shared, Output, lse, q_offset,
        row0, seq_len_q, by,
    ):  # fmt: skip
        # The sink joins the softmax here, once per row (example_gqa_sink_fwd_bhsd.py's epilogue
        # explains it). In base-2 units, with m the running max, l the running sum:
        #     m' = max(m, sink),  l' = l·exp2(m − m') + exp2(sink − m'),  O = a·exp2(m − m') / l'
        # Both exponents are <= 0; l = 0 still says "no visible key" (O = 0, lse = +inf).
        for i in T.Parallel(block_M):
            m = scores_max[i] * scale
            if has_sinks:
                sink2 = sink_logit * LOG2E
                m_sink = T.max(m, sink2)
                ratio = T.exp2(m - m_sink)
                total = logsum[i] * ratio + T.exp2(sink2 - m_sink)
                factor[i] = T.if_then_else(logsum[i] > 0, ratio / total, 0)
                row_lse[i] = T.if_then_else(
                    logsum[i] > 0, (T.log2(total) + m_sink) / LOG2E, T.infinity(accum_dtype)
                )
            else:
                factor[i] = T.if_then_else(logsum[i] > 0, 1.0 / logsum[i], 0)
                row_lse[i] = T.if_then_else(
                    logsum[i] > 0, (T.log2(logsum[i]) + m) / LOG2E, T.infinity(accum_dtype)
                )
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= factor[i]
        # Through shared memory. A block wholly inside the sequence leaves by one TMA store; the
        # sequence's last, partial block by a guarded store of its own rows (a TMA box would
        # overwrite the next sequence's first rows).
        T.copy(acc_o, O_shared)
        if row0 + block_M <= seq_len_q:
            T.copy(O_shared, Output[q_offset + row0 : q_offset + row0 + block_M, by, :])
        else:
            for i, j in T.Parallel(block_M, dim):
                if row0 + i < seq_len_q:
                    Output[q_offset + row0 + i, by, j] = O_shared[i, j]
        for i in T.Parallel(block_M):
            if row0 + i < seq_len_q:
                lse[by, q_offset + row0 + i] = row_lse[i]

    @T.macro
    def part_epilogue(acc_o, logsum, scores_max, O_part, lse_part, slot):
        # A part of a tile: its output normalised by its own row sums and its lse (log2 units),
        # in float32, every row of the tile, for flashattn_fwd_varlen_combine, which adds the
        # sink once per row. A row that sees none of the part's keys leaves O = 0 and
        # lse = -inf: no weight in the merge.
        for i, j in T.Parallel(block_M, dim):
            O_part[slot, i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
        for i in T.Parallel(block_M):
            lse_part[slot, i] = T.if_then_else(
                logsum[i] > 0, T.log2(logsum[i]) + scores_max[i] * scale, neg_inf
            )

    @T.prim_func
    def flash_fwd_varlen(
        Q: T.Tensor([total_q, heads, dim], dtype),
        K: T.Tensor([total_k, heads_kv, dim], dtype),
        V: T.Tensor([total_k, heads_kv, dim], dtype),
        cu_seqlens_q: T.Tensor([batch + 1], "int32"),
        cu_seqlens_k: T.Tensor([batch + 1], "int32"),
        tiles: T.Tensor([rounds, grid, 6], "int32"),
        Sinks: T.Tensor([heads], accum_dtype),  # not read when has_sinks is False
        Output: T.Tensor([total_q, heads, dim], dtype),
        lse: T.Tensor([heads, total_q], accum_dtype),
        O_part: T.Tensor([slots, block_M, dim], accum_dtype),
        lse_part: T.Tensor([slots, block_M], accum_dtype),
    ):
        with T.Kernel(grid, threads=consumers + 128) as cta:
            Q_shared = T.alloc_shared([q_stages, block_M, dim], dtype)
            K_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            O_shared = T.alloc_shared([block_M, dim], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)

            # mbarriers between producer and consumers. "full": the producer warp's 32 threads
            # arrive and its TMA load completes the byte count; "empty": every consumer thread
            # arrives when it no longer reads the buffer. K and V stages have a pair each.
            q_full = T.alloc_barrier([32] * q_stages)
            q_empty = T.alloc_barrier([consumers] * q_stages)
            k_full = T.alloc_barrier([32] * num_stages)
            v_full = T.alloc_barrier([32] * num_stages)
            k_empty = T.alloc_barrier([consumers] * num_stages)
            v_empty = T.alloc_barrier([consumers] * num_stages)
            # Both sides count the key blocks and tiles they have been through, so each knows
            # which stage (g % num_stages) and barrier phase (g // num_stages) comes next. An
            # empty entry of the list (bz < 0, the last round's padding) counts for neither.
            kv_count = T.alloc_var("int32")
            tile_count = T.alloc_var("int32")
            kv_count = 0
            tile_count = 0
            # The current tile, read once into registers: its sequence bz, head by, query block
            # m_blk within the sequence, and the sequence's packed offsets and lengths.
            bz = T.alloc_var("int32")
            by = T.alloc_var("int32")
            m_blk = T.alloc_var("int32")
            q_offset = T.alloc_var("int32")  # first packed row of the sequence's queries
            k_offset = T.alloc_var("int32")  # and of its keys
            seq_len_q = T.alloc_var("int32")
            seq_len_k = T.alloc_var("int32")
            sink_logit = T.alloc_var(accum_dtype)  # this tile's sink (consumers)
            tx = T.get_thread_binding()

            if tx >= consumers:
                # ----------------------------------------------------------- producer warpgroup
                T.set_max_nreg(PRODUCER_REGS, 0)  # hand registers over to the consumers
                # One warp issues the loads, as many threads as TMA needs; the other three
                # would only poll the ring's mbarriers beside the consumers.
                if tx < consumers + 32:
                    for it in T.serial(rounds):
                        bz = tiles[it, cta, 2]  # < 0: no tile this round
                        if bz >= 0:
                            m_blk = tiles[it, cta, 0]
                            by = tiles[it, cta, 1]
                            q_offset = cu_seqlens_q[bz]
                            k_offset = cu_seqlens_k[bz]
                            seq_len_q = cu_seqlens_q[bz + 1] - q_offset
                            seq_len_k = cu_seqlens_k[bz + 1] - k_offset
                            n_start = key_range(m_blk, seq_len_q, seq_len_k)[0]
                            first = tiles[it, cta, 4]  # the window's blocks first … end - 1
                            n_blocks = tiles[it, cta, 5] - first
                            q_row = q_offset + m_blk * block_M
                            load_q(Q, Q_shared, q_full, q_empty, tile_count, q_row, by)
                            for k in T.serial(n_blocks):
                                load_kv(
                                    K, V, K_shared, V_shared, k_full, v_full, k_empty, v_empty,
                                    kv_count + k, k_offset + (n_start + first + k) * block_N, by,
                                )  # fmt: skip
                            kv_count = kv_count + n_blocks
                            tile_count = tile_count + 1
            else:
                # ---------------------------------------------------------- consumer warpgroups
                T.set_max_nreg(consumer_regs, 1)
                for it in T.serial(rounds):
                    bz = tiles[it, cta, 2]
                    if bz >= 0:
                        m_blk = tiles[it, cta, 0]
                        by = tiles[it, cta, 1]
                        q_offset = cu_seqlens_q[bz]
                        k_offset = cu_seqlens_k[bz]
                        seq_len_q = cu_seqlens_q[bz + 1] - q_offset
                        seq_len_k = cu_seqlens_k[bz + 1] - k_offset
                        row0 = m_blk * block_M
                        n_start, n_window = key_range(m_blk, seq_len_q, seq_len_k)
                        n_left, n_inner_end = mask_runs(
                            m_blk, n_start, n_window, seq_len_q, seq_len_k
                        )
                        # This entry walks the window's blocks first … end - 1: all of them, or
                        # (slot >= 0) a part.
                        slot = tiles[it, cta, 3]
                        first = tiles[it, cta, 4]
                        end = tiles[it, cta, 5]
                        n_blocks = end - first
                        kv_base = kv_count - first  # window block k is ring slot kv_base + k
                        lens = (row0, seq_len_q, seq_len_k)
                        step_buffers = (
                            *lens, Q_shared, K_shared, V_shared, acc_s, acc_s_cast, acc_o,
                            scores_max, scores_max_prev, scores_scale, scores_sum, logsum, k_full,
                            v_full, k_empty, v_empty,
                        )  # fmt: skip
                        T.fill(acc_o, 0)
                        T.fill(logsum, 0)
                        T.fill(scores_max, neg_inf)
                        if has_sinks:  # loaded now, used in the epilogue: its latency hides
                            sink_logit = Sinks[by]
                        q_slot = tile_count % q_stages
                        T.mbarrier_wait_parity(q_full[q_slot], (tile_count // q_stages) & 1)

                        # Block ``first``: S = Q Kᵀ, its softmax; P waits in registers.
                        stage = kv_count % num_stages
                        T.mbarrier_wait_parity(k_full[stage], (kv_count // num_stages) & 1)
                        scores(Q_shared[q_slot, :, :], K_shared[stage, :, :], acc_s)
                        T.wait_wgmma(0)
                        T.barrier_arrive(k_empty[stage])
                        if window_left >= 0:
                            # the left edge, a tile of one block, or a part's first block
                            # (the mask leaves a block every row sees whole as it is)
                            mask(n_start + first, *lens, acc_s)
                        else:
                            if first >= n_inner_end:
                                mask(n_start + first, *lens, acc_s)
                        softmax(
                            acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum
                        )
                        T.copy(acc_s, acc_s_cast)  # P in 16 bits: the A operand of P V

                        # The other key blocks. A window bounded on the left: three runs, left
                        # edge (masked), the blocks every row sees whole (no mask), right edge
                        # and ragged tail (masked), so that no block decides at run time whether
                        # to mask (that decision in the loop makes ptxas spill); a part walks
                        # the runs' stretch between its first and end. A window open on the left
                        # keeps the varlen kernel's single loop, each block testing
                        # k >= n_inner_end (as the BHSD sink forward does).
                        if window_left >= 0:
                            left_end = T.max(first + 1, T.min(n_left, end))
                            whole_end = T.max(left_end, T.min(n_inner_end, end))
                            for k in T.serial(first + 1, left_end):
                                key_step(kv_base + k, n_start + k, True, q_slot, *step_buffers)
                            for k in T.serial(left_end, whole_end):
                                key_step(kv_base + k, n_start + k, False, q_slot, *step_buffers)
                            for k in T.serial(whole_end, end):
                                key_step(kv_base + k, n_start + k, True, q_slot, *step_buffers)
                        else:
                            for k in T.serial(first + 1, end):
                                key_step(
                                    kv_base + k, n_start + k, k >= n_inner_end, q_slot,
                                    *step_buffers,
                                )  # fmt: skip
                        # Every Q Kᵀ of this tile is done: the producer may load the next Q.
                        T.barrier_arrive(q_empty[q_slot])

                        g = kv_count + n_blocks - 1
                        stage = g % num_stages
                        T.mbarrier_wait_parity(v_full[stage], (g // num_stages) & 1)
                        pv(acc_s_cast, V_shared[stage, :, :], acc_o)
                        T.wait_wgmma(0)
                        T.barrier_arrive(v_empty[stage])

                        if slot < 0:
                            # scores_scale and scores_sum are free now: they carry each row's
                            # output factor and lse through the epilogue.
                            epilogue(
                                acc_o, logsum, scores_max, sink_logit, scores_scale, scores_sum,
                                O_shared, Output, lse, q_offset, row0, seq_len_q, by,
                            )  # fmt: skip
                        else:
                            part_epilogue(acc_o, logsum, scores_max, O_part, lse_part, slot)
                        kv_count = kv_count + n_blocks
                        tile_count = tile_count + 1

    return flash_fwd_varlen


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd_varlen_combine(heads, dim, has_sinks, dtype="float16", block_M=128, rows=16):
    """The rows of the tiles walked in parts (``tile_schedule``'s ``combine`` list), each
    merged from its parts, and the sink added once.

    Part p of a row holds O_p, normalised by its own row sum, and lse_p, the log2 of that sum
    plus its row max (log2 units); s is the head's sink in log2 units (−inf without one). With
    M = max(max_p lse_p, s), w_p = 2^(lse_p − M) and W = Σ w_p + 2^(s − M), the row is
    O = Σ w_p O_p / W and lse = (M + log2 W) / log2 e: the epilogue's sink fold, over the parts.
    A row no part saw (every lse_p −inf) gets O = 0 and lse = +inf, sink or not. One thread
    block per ``rows`` rows of a split tile."""
    accum_dtype = "float32"
    total_q, batch, slots, n_split = T.dynamic("total_q, batch, slots, n_split")

    @T.prim_func
    def flash_fwd_combine(
        O_part: T.Tensor([slots, block_M, dim], accum_dtype),
        lse_part: T.Tensor([slots, block_M], accum_dtype),
        combine: T.Tensor([n_split, 5], "int32"),
        cu_seqlens_q: T.Tensor([batch + 1], "int32"),
        Sinks: T.Tensor([heads], accum_dtype),  # not read when has_sinks is False
        Output: T.Tensor([total_q, heads, dim], dtype),
        lse: T.Tensor([heads, total_q], accum_dtype),
    ):
        with T.Kernel(n_split * (block_M // rows), threads=128) as bx:
            j, rb = bx // (block_M // rows), bx % (block_M // rows)  # split tile, rows in it
            row0 = combine[j, 0] * block_M + rb * rows  # within the sequence
            by, bz, slot0, parts = combine[j, 1], combine[j, 2], combine[j, 3], combine[j, 4]
            q_offset = cu_seqlens_q[bz]
            seq_len_q = cu_seqlens_q[bz + 1] - q_offset
            lse_max = T.alloc_fragment([rows], accum_dtype)
            seen = T.alloc_fragment([rows], "bool")
            weights = T.alloc_fragment([rows], accum_dtype)
            acc_o = T.alloc_fragment([rows, dim], accum_dtype)
            T.fill(lse_max, -T.infinity(accum_dtype))
            T.fill(weights, 0)
            T.fill(acc_o, 0)
            for p in T.serial(parts):
                for i in T.Parallel(rows):
                    lse_max[i] = T.max(lse_max[i], lse_part[slot0 + p, rb * rows + i])
            for i in T.Parallel(rows):
                seen[i] = lse_max[i] > -T.infinity(accum_dtype)
                if has_sinks:
                    lse_max[i] = T.max(lse_max[i], Sinks[by] * LOG2E)
                # a row no part saw and no sink: any finite M (its weights are all 0)
                lse_max[i] = T.if_then_else(lse_max[i] == -T.infinity(accum_dtype), 0, lse_max[i])
            for p in T.serial(parts):
                for i, d in T.Parallel(rows, dim):
                    w = T.exp2(lse_part[slot0 + p, rb * rows + i] - lse_max[i])
                    acc_o[i, d] += w * O_part[slot0 + p, rb * rows + i, d]
                for i in T.Parallel(rows):
                    weights[i] += T.exp2(lse_part[slot0 + p, rb * rows + i] - lse_max[i])
            if has_sinks:
                for i in T.Parallel(rows):
                    weights[i] += T.exp2(Sinks[by] * LOG2E - lse_max[i])
            for i, d in T.Parallel(rows, dim):
                if row0 + i < seq_len_q:  # rows past the sequence's end are not written
                    Output[q_offset + row0 + i, by, d] = T.cast(
                        T.if_then_else(seen[i], acc_o[i, d] / weights[i], 0), dtype
                    )
            for i in T.Parallel(rows):
                if row0 + i < seq_len_q:
                    lse[by, q_offset + row0 + i] = T.if_then_else(
                        seen[i], (lse_max[i] + T.log2(weights[i])) / LOG2E, T.infinity(accum_dtype)
                    )

    return flash_fwd_combine


# ----------------------------------------------------------------------------- tile list
def tile_costs(len_q, len_k, m_blk, block_M, block_N, window):
    """Each tile's cost, as ``tile_schedule`` charges it: the key blocks the kernel visits
    (``window_key_blocks`` on the tile's lengths, the same function the kernel runs) plus one for
    loading Q and storing O. int64 tensors in, one out; computed once per distinct (query block,
    lengths), since every head of a sequence costs the same."""
    left, right = window
    keys = torch.stack([m_blk, len_q, len_k], dim=1)
    distinct, where = torch.unique(keys, dim=0, return_inverse=True)
    blocks = [
        int(window_key_blocks(m, block_M, block_N, sq, sk, left, right)[1])
        for m, sq, sk in distinct.tolist()
    ]
    return torch.tensor(blocks, dtype=torch.int64)[where] + 1


def tile_schedule(cu_seqlens_q, cu_seqlens_k, heads, block_M, block_N, window, num_sms):
    """The persistent kernel's work list, from the cumulative lengths (Python ints) and the
    window as the kernel takes it (``normalize_window``): ``(table, combine)``.

    example_gqa_fwd_varlen.py's list (its ``tile_schedule`` explains the entries and the order:
    heaviest sequences first, a sequence head by head, the query blocks of a head last to
    first, dealt in rounds with the heaviest tile of a round going to the least loaded thread
    block, a last round of fewer tiles than SMs perhaps in parts over its key blocks), with
    each tile charged the key blocks of its window (``tile_costs``), and parts only where the
    busiest thread block would walk MIN_SPLIT_WALK key blocks or more with whole tiles: a
    shorter walk leaves the call bound by its host time, to which the parts' second launch only
    adds. An entry's ``first`` and ``end`` count the window's blocks: block ``first`` is key
    block ``n_start + first`` of ``window_key_blocks``."""
    cu_q = torch.tensor(cu_seqlens_q, dtype=torch.int64)
    cu_k = torch.tensor(cu_seqlens_k, dtype=torch.int64)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    m_blocks = (len_q + block_M - 1) // block_M
    per_sequence = m_blocks * heads
    seq = torch.repeat_interleave(torch.arange(len(len_q)), per_sequence)
    j = torch.arange(len(seq)) - (torch.cumsum(per_sequence, 0) - per_sequence)[seq]
    head = j // m_blocks[seq]
    m_blk = m_blocks[seq] - 1 - j % m_blocks[seq]
    cost = tile_costs(len_q[seq], len_k[seq], m_blk, block_M, block_N, window)
    sequence_cost = torch.zeros(len(len_q), dtype=torch.int64).index_add_(0, seq, cost)
    rank = torch.empty_like(sequence_cost)
    rank[torch.argsort(-sequence_cost, stable=True)] = torch.arange(len(len_q))
    order = torch.argsort(rank[seq], stable=True)  # stable: head by head, block by block
    tiles = torch.stack([m_blk, head, seq, cost - 1], dim=1)[order]  # cost - 1: key blocks
    return varlen.deal_tiles(tiles, num_sms, MIN_SPLIT_WALK)


@functools.lru_cache(maxsize=64)
def forward_plan(
    cu_seqlens_q, cu_seqlens_k, heads, heads_kv, dim, window_size, causal, has_sinks,
    softmax_scale, dtype, config, device,
):  # fmt: skip
    """``launch(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out, lse)`` for one batch's lengths
    (``cu_seqlens_q/k`` as tuples), settled on its first call and kept for the next call with
    the same lengths (a model's layers share one batch's ``cu_seqlens``), as the varlen
    forward's ``forward_plan``: the window on the longest sequences, the tiles (``config``: the
    caller's as sorted (key, value) pairs, or None for ``default_config``), the tile list on the
    device and the builds as compiled entry points (``entry``). The kernel takes a sinks tensor
    either way; without sinks (None) it gets a stand-in it never reads, made here once, as are
    the parts' stand-ins without parts."""
    longest_q, longest_k = (
        max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
        for cu in (cu_seqlens_q, cu_seqlens_k)
    )
    window = normalize_window(window_size, causal, longest_q, longest_k)
    arch = varlen.device_arch(device)
    cfg = dict(config) if config else default_config(dim, window, arch, longest_k)
    block_M, block_N = cfg["block_M"], cfg["block_N"]
    forward = entry(
        flashattn_fwd_varlen(heads, heads_kv, dim, *window, has_sinks, softmax_scale, dtype, **cfg)
    )
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    table, combine = tile_schedule(
        cu_seqlens_q, cu_seqlens_k, heads, block_M, block_N, window, num_sms
    )  # fmt: skip
    tiles, slots = table.to(device), int(combine[:, 4].sum())
    no_sinks = None if has_sinks else torch.empty(heads, dtype=torch.float32, device=device)
    if not slots:
        O_part = torch.empty(1, block_M, dim, dtype=torch.float32, device=device)
        lse_part = torch.empty(1, block_M, dtype=torch.float32, device=device)

        def launch(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out, lse):
            sinks = no_sinks if sinks is None else sinks
            forward(q, k, v, cu_seqlens_q, cu_seqlens_k, tiles, sinks, out, lse, O_part, lse_part)

        return launch
    # Tiles in parts: merged, with the sink, by a second kernel.
    merge = entry(flashattn_fwd_varlen_combine(heads, dim, has_sinks, dtype, block_M))
    combine = combine.to(device)

    def launch_in_parts(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out, lse):
        sinks = no_sinks if sinks is None else sinks
        O_part = q.new_empty(slots, block_M, dim, dtype=torch.float32)
        lse_part = q.new_empty(slots, block_M, dtype=torch.float32)
        forward(q, k, v, cu_seqlens_q, cu_seqlens_k, tiles, sinks, out, lse, O_part, lse_part)
        merge(O_part, lse_part, combine, cu_seqlens_q, sinks, out, lse)

    return launch_in_parts


def default_config(dim, window=(-1, -1), arch="sm_90a", seq_len=None):
    """Tile configuration: the BHSD sink forward's (its ``default_config``), for the window as
    the kernel takes it and ``seq_len`` the longest key sequence. Hopper only.

    Two Q slots against one, measured here too (H100, 2026-11-23, bf16, causal, sinks, H64/Hkv8
    D64 window 128, random lengths): 8 sequences up to 4096, 0.275 against 0.300 ms; 16 up to
    2048, 0.270 against 0.294 ms; at H32/Hkv8 D128, window 1024 0.584 against 0.588 ms and no
    window 0.611 against 0.608 ms. Outputs bit-identical.

    One thread block an SM always (``single_cta_config``): the BHSD kernel's two thread blocks
    for the narrowest windows are not written here."""
    return strip_ctas(sink.single_cta_config(dim, window, arch, seq_len))


def strip_ctas(cfg):
    """A BHSD sink forward config without its ``ctas_per_sm`` (1 here)."""
    return {key: cfg[key] for key in CONFIG_KEYS}


def tune_configs(dim):
    """The small space ``--tune`` compares: the BHSD sink forward's one-thread-block entries."""
    return [strip_ctas(c) for c in sink.tune_configs(dim) if c["ctas_per_sm"] == 1]


# ----------------------------------------------------------------------------- torch-facing
def _check_sinks(sinks, heads, device):
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must be [heads] = [{heads}], got {tuple(sinks.shape)}")
    if sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be float32, got {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device ({device}), got {sinks.device}")


def _check_inputs(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, window_size, causal,
    softmax_scale,
):  # fmt: skip
    """ValueError naming the first bad argument, from metadata alone: the varlen forward's rules
    (example_gqa_fwd_varlen.py), then the window's and the sinks'. What needs cu_seqlens' values,
    and the CUDA check, is ``_check_values`` (in the operator)."""
    varlen._check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
    )
    sink._check_window(window_size)
    _check_sinks(sinks, q.shape[1], q.device)


_check_values = varlen._check_values
_host_values = varlen._host_values


def attention_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sinks, window_size, causal, softmax_scale,
    config=None,
):  # fmt: skip
    """The kernel on checked, contiguous input: ``out`` and ``lse [H, total_q]`` (float32, the
    sink included); what the operator runs. ``window_size`` as the caller gave it; it is
    normalised in ``forward_plan``, on the longest sequences (a bound no row of any sequence
    reaches is -1)."""
    del max_seqlen_q  # the tile list comes from the lengths themselves
    H, D = q.shape[1:]
    out = torch.empty_like(q)
    lse = torch.empty(H, q.shape[0], dtype=torch.float32, device=q.device)
    if k.shape[0] == 0:  # no keys in any sequence: every row is empty, nothing to launch
        out.zero_()
        lse.fill_(math.inf)
    elif q.shape[0] > 0:
        launch = forward_plan(
            tuple(_host_values(cu_seqlens_q)), tuple(_host_values(cu_seqlens_k)), H, k.shape[1],
            D, tuple(window_size), bool(causal), sinks is not None, float(softmax_scale),
            sink.dtype_name(q), tuple(sorted(config.items())) if config else None, q.device,
        )  # fmt: skip
        sinks = sinks if sinks is None else sinks.detach().contiguous()
        launch(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out, lse)
    return out, lse


# torch.compile: the kernel as a custom operator (docs/CONVENTIONS.md, "torch.compile"), with
# the varlen forward's arguments and the BHSD sink forward's two (sinks: Tensor?, the window as
# its two ints, as the caller gave them). A config travels as its values in CONFIG_KEYS order.
# The checks that read cu_seqlens run in the real implementation, never in traced code.
CONFIG_KEYS = ("block_M", "block_N", "num_stages", "q_stages")


def operator_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sinks: torch.Tensor | None,
    window_size_left: int,
    window_size_right: int,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    window = (window_size_left, window_size_right)
    return attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sinks, window, causal, softmax_scale,
        cfg,
    )  # fmt: skip


attention_forward_op = torch.library.custom_op(
    "tl_attn::gqa_sink_fwd_varlen", operator_forward, mutates_args=()
)


@attention_forward_op.register_fake
def _(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, window_size_left,
    window_size_right, causal, softmax_scale, config,
):  # fmt: skip
    total_q, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(H, total_q, dtype=torch.float32)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sinks=None,
    window_size=(-1, -1),
    causal=False,
    softmax_scale=None,
    return_lse=False,
    config=None,
):
    """Varlen attention with sinks and a sliding window: ``q [total_q, H, D]``, ``k, v [total_k,
    Hkv, D]`` (fp16/bf16, CUDA), ``cu_seqlens_q/k`` int32 ``[B + 1]``, ``max_seqlen_q/k`` ints,
    ``sinks [H]`` float32 or None, ``window_size (left, right)``.

    Returns ``out [total_q, H, D]``, and ``lse [H, total_q]`` (float32, natural log, sink
    included) when ``return_lse``. ``config`` overrides the tile configuration (see
    ``default_config``). Each ``cu_seqlens`` is read back to the host once (the checks and the
    tile list), inside the operator.
    """
    _check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, window_size,
        causal, softmax_scale,
    )  # fmt: skip
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    window = [int(w) for w in window_size]  # (left, right): two int arguments of the operator
    q, k, v = (t.contiguous() for t in (q, k, v))
    sinks = sinks if sinks is None else sinks.contiguous()
    tiles = [config[key] for key in CONFIG_KEYS] if config else None
    # Compiled code, fake tensors and calls autograd records take the operator (a backward
    # through it is then an error, not a silent zero gradient); any other eager call runs its
    # body without the operator's dispatch (docs/CONVENTIONS.md, "Eager calls").
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    recorded = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sinks)
    )
    forward = operator_forward if eager and not recorded else attention_forward_op
    out, lse = forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, *window, causal,
        float(softmax_scale), tiles,
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- reference
def ref_program(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sinks=None,
    window_size=(-1, -1),
    causal=False,
    softmax_scale=None,
    return_lse=False,
):
    """Plain PyTorch in float32 (float64 stays float64; runs on CPU), same signature and
    conventions as ``attention_varlen``: the BHSD sink forward's ``ref_program`` on each
    sequence, with that sequence's own lengths."""
    del max_seqlen_q, max_seqlen_k  # FlashAttention compatibility: cu_seqlens holds the lengths
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=acc, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[b : b + 2], bounds_k[b : b + 2]
        if q1 == q0 or k1 == k0:
            continue  # no queries, or no keys: out 0, lse +inf
        qb, kb, vb = (t.to(acc).transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        o, l_ = sink.ref_program(qb, kb, vb, sinks, window_size, causal, scale, return_lse=True)
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), l_[0]
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def varlen_window_flops(cu_seqlens_q, cu_seqlens_k, heads, dim, window_size, causal) -> float:
    """Forward FLOPs over the attended pairs of every sequence: 4·H·pairs·D."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    pairs = sum(
        sink.attended_pairs(bounds_q[b + 1] - bounds_q[b], bounds_k[b + 1] - bounds_k[b],
                            window_size, causal)
        for b in range(len(bounds_q) - 1)
    )  # fmt: skip
    return 4.0 * heads * pairs * dim


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    parser = sink.build_parser(__doc__.splitlines()[0] + " " + __doc__.splitlines()[1])
    parser.set_defaults(batch=8, seq_len=2048)
    parser.description += (
        ". Sequence lengths are drawn at random from 1..--seq_len (keys: 1..--seq_len_k, or the "
        "query lengths when it is not given); the batch holds a sequence of length 1 and one of "
        "the maximum."
    )
    return parser


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
    window_arg = tuple(args.window)
    script = pathlib.Path(__file__).name

    if args.compile_only:
        window = normalize_window(window_arg, args.causal, Sq, Sk)
        cfg = default_config(D, window, args.arch, Sk)
        kernel = harness.compile_for(
            flashattn_fwd_varlen, args.arch, H, Hkv, D, *window, args.sinks, scale, args.dtype,
            **cfg,
        )  # fmt: skip
        print(
            f"{script}: built for {args.arch} with {cfg} (window as built: {window}; batch sizes "
            "and tile list dynamic)"
        )
        print(harness.describe_source("flashattn_fwd_varlen", kernel.get_kernel_source()))
        merge = harness.compile_for(
            flashattn_fwd_varlen_combine, args.arch, H, D, args.sinks, args.dtype, cfg["block_M"]
        )  # fmt: skip
        print(harness.describe_source("flashattn_fwd_varlen_combine", merge.get_kernel_source()))
        return

    harness.require_gpu(script, capability=(9, 0))
    bp = varlen._bert_padding()
    dtype = harness.DTYPES[args.dtype]
    (q_pad, k_pad, v_pad), mask_q, mask_k = varlen.padded_batch(
        B, Sq, Sk, H, Hkv, D, dtype, distinct_k=args.seq_len_k is not None
    )
    # Padded batch + mask → packed tokens, cu_seqlens and max_seqlen.
    q, _, cu_seqlens_q, max_seqlen_q, _ = bp.unpad_input(q_pad, mask_q)
    k, _, cu_seqlens_k, max_seqlen_k, _ = bp.unpad_input(k_pad, mask_k)
    v = bp.unpad_input(v_pad, mask_k)[0]
    varlen_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    torch.manual_seed(0)
    sinks = torch.randn(H, device="cuda", dtype=torch.float32) * 2 if args.sinks else None
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    what = (
        f"B{B} H{H} Hkv{Hkv} max {Sq}/{Sk} D{D} window={window_arg} causal={args.causal} "
        f"sinks={args.sinks} {args.dtype}"
    )
    print(f"{what}: {q.shape[0]} query tokens\n  query lengths {lengths}")

    def benchmark(configs):
        """Ours, one row per entry of ``configs`` (name → config), beside the BHSD sink forward
        on the padded batch (every sequence at the longest lengths: the work padding costs),
        every row charged the packed batch's attended pairs."""
        ours = {
            name: lambda c=cfg: attention_varlen(
                *varlen_args, sinks, window_arg, args.causal, scale, config=c
            )
            for name, cfg in configs.items()
        }
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q_pad, k_pad, v_pad))
        peers = {
            "tilelang sink bhsd, padded": lambda: sink.attention(
                qt, kt, vt, sinks, window_arg, args.causal, scale
            )
        }
        flops = varlen_window_flops(cu_seqlens_q, cu_seqlens_k, H, D, window_arg, args.causal)
        return harness.report(f"varlen forward {what}", ours, peers, flops)

    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest is checked.
        named = {"tilelang varlen " + sink._config_name(c): c for c in tune_configs(D)}
        config = named[harness.fastest(benchmark(named))]
        print(f"tuned: {config}")

    if args.check:
        out, lse = attention_varlen(
            *varlen_args, sinks, window_arg, args.causal, scale, return_lse=True, config=config
        )
        ref_out, ref_lse = ref_program(
            *varlen_args, sinks, window_arg, args.causal, scale, return_lse=True
        )
        print(f"check {what}")
        harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
        harness.check_close("lse", lse, ref_lse, rtol=1e-3)  # fp32 statistics: tighter

    if args.bench and not args.tune:
        benchmark({"tilelang varlen": config})


if __name__ == "__main__":
    main()
