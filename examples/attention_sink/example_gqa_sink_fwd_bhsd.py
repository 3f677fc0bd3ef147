"""Attention with sinks and a sliding window (gpt-oss style), GQA forward, BHSD layout, TileLang on
Hopper (SM90).

Computes ``O = softmax(Q Kᵀ · scale) V`` for ``q [B, H, Sq, D]`` and ``k, v [B, Hkv, Sk, D]``
(query head ``h`` reads kv head ``h // (H / Hkv)``) with two additions:

- a sliding window, ``window_size = (left, right)`` as in FlashAttention: query ``i`` sees key
  ``j`` when ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (``-1``: no bound on that side;
  ``(-1, -1)`` is full attention). ``causal=True`` sets ``right = 0`` whatever ``right`` was
  given, as FlashAttention does, so ``causal=True, window_size=(left, r)`` is
  ``window_size=(left, 0)`` (bottom-right aligned, as FlashAttention ≥ 2.1);
- attention sinks: one extra logit per query head, ``sinks[h]`` (float32), that joins each
  row's softmax denominator but has no value vector:
  ``p_j = exp(s_j) / (exp(sinks[h]) + Σ_k exp(s_k))`` over the visible keys ``k``, so a row may
  give less than all of its weight to the keys. ``sinks=None`` is plain attention.

The log-sum-exp returned with ``return_lse`` includes the sink:
``lse = log(exp(sinks[h]) + Σ_k exp(s_k))``, so ``p_j = exp(s_j − lse)`` holds for the keys and
``p_sink = exp(sinks[h] − lse)`` for the sink, which is what a backward pass needs. A query row
that sees no key gives ``O = 0`` and ``lse = +inf``, with or without a sink, as everywhere in
this collection.

What it teaches, on top of the hand-scheduled persistent forward of
``examples/flash_attention/example_gqa_fwd_bshd.py`` (a producer warp issuing TMA loads into
a K/V ring guarded by full/empty mbarriers, consumer warpgroups with asynchronous WGMMA and
``setmaxnreg``, the softmax of key block k overlapping the P V GEMM of block k−1, one thread block
per SM walking a list of tiles; with a window bounded on one side only, and more tiles than SMs,
the tiles come one at a time from a global counter, heaviest first: ``counter_section``):

- a window is a range of key blocks: a query tile visits only the blocks that hold a key some
  row of the tile can see (``window_key_blocks``); blocks entirely outside the window are never
  loaded. Producer and consumers compute the range with the same function, so both walk the
  same blocks and agree on the K/V ring's stages and barrier phases;
- masks run only where needed (``window_mask_runs``): on the blocks that straddle the window's
  left edge, its right (causal) edge, or the end of the keys; every block between them is used
  as is. With a left edge the key loop runs in three parts (masked, whole, masked), so no block
  decides at run time whether to mask — that decision, in the loop, costs the registers that
  make ptxas spill;
- the sink is folded into the softmax once, after the key loop: the final row maximum is
  ``max(running max, sink)``, and the accumulator and the running sum are rescaled by
  ``exp(running max − final max) <= 1``, so no exponential ever exceeds 1 (see ``row_factors``);
  the online softmax of the key loop is the dense kernel's, unchanged;
- Q in two shared-memory slots (``q_stages=2``): a narrow window gives a tile two or three key
  blocks, so the tile's start is a large share of its time. With one slot the producer can load
  the next tile's Q only once this tile's last Q Kᵀ is done, and the next tile's first Q Kᵀ
  waits for that load; with two, the next Q (and its first K/V blocks) load while this tile
  still computes. With one thread block an SM the next tile then starts under this one's last
  P V (``next_tile_under_last_pv``): its first Q Kᵀ is issued before that GEMM and its first
  softmax runs while it occupies the tensor cores, as key block k's softmax runs under P V of
  block k−1 inside a tile;
- two thread blocks an SM for the narrowest windows (``ctas_per_sm=2``, 64-row tiles of 64
  keys, half the register file each: ``__launch_bounds__(256, 2)``, 232 registers a consumer
  thread). A tile there is one or two short key blocks, mostly waiting on its loads and on
  its own chain of WGMMA, softmax and epilogue; a second thread block on the SM fills those
  waits with its own tiles.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, sinks=None, window_size=(-1, -1), causal=False, softmax_scale=None,
              return_lse=False, config=None)

    q: (batch, nheads, seqlen_q, headdim), float16 or bfloat16, on a CUDA device;
        headdim 64 or 128.
    k, v: (batch, nheads_k, seqlen_k, headdim), same dtype and device;
        nheads a multiple of nheads_k (groups 1 to 16 tested).
    sinks: (nheads,), float32, on q's device, or None. One logit per query head, in the units of
        the scaled scores QKᵀ · softmax_scale; -inf is allowed (no sink for that head).
    window_size: (left, right), ints >= -1. The sliding window (above); -1 is unbounded.
    causal: bool. right = 0 (bottom-right aligned), whatever window_size[1] says.
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    return_lse: bool. Also return lse: (batch, nheads, seqlen_q), float32, natural log,
        including the sink (above); +inf for a row that sees no key.
    config: dict. Tile configuration (block_M, block_N, num_stages, q_stages, ctas_per_sm);
        default ``default_config``.
    Returns out: (batch, nheads, seqlen_q, headdim), or (out, lse) when return_lse.

Underneath, ``attention`` calls the custom operator ``tl_attn::gqa_sink_fwd_bhsd``
(``torch.library``), so ``torch.compile(model, fullgraph=True)`` compiles a model around it
without a graph break.
Whichever way it is called, the kernel for a shape is settled once (``forward_plan``: window,
tiles, SM count, build) and launched through its compiled entry point (``entry``), so that a
narrow window's forward, a fraction of a millisecond on the GPU, is not paced by host work.

Run:
    python examples/attention_sink/example_gqa_sink_fwd_bhsd.py --causal --window 128 0
    python examples/attention_sink/example_gqa_sink_fwd_bhsd.py --window 64 64 --no-sinks
    python examples/attention_sink/example_gqa_sink_fwd_bhsd.py --compile-only --arch sm_90a
"""

import argparse
import functools
import importlib.util
import math
import numbers
import pathlib
import sys

import einops
import tilelang
import tilelang.language as T
import torch
from tilelang import tvm

LOG2E = 1.4426950408889634
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    # The kernel splits producer and consumers itself (below); no automatic warp specialization.
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_90a",)  # --arch: Hopper only (TMA, WGMMA and setmaxnreg throughout)
PRODUCER_REGS = 24
SECTION_BYTES = 16 << 20  # counter_section: K and V of a section's heads, to stay in L2


# ----------------------------------------------------------------------------- window blocks
# Which key blocks a query tile visits, and which of them it must mask. The kernel calls these
# with its loop variables (TileLang expressions); on plain ints they give ints (the tests check
# them against the window's mask). Rows m_blk·block_M … are one tile; rows past Sq are padding.


def _tile_rows(m_blk, block_M, seq_q):
    # First and last (real) query row of the tile.
    return m_blk * block_M, T.min((m_blk + 1) * block_M, seq_q) - 1


def window_key_blocks(m_blk, block_M, block_N, seq_q, seq_kv, left, right):
    """``(n_start, n_blocks)``: the key blocks ``n_start … n_start + n_blocks − 1`` that hold a
    key some row of the tile sees. Keys ``[lo, hi)`` are the union of the rows' windows: the
    first row's left edge to the last row's right edge. Blocks outside are never loaded; the
    producer and the consumers both call this, so they walk the same blocks.

    At least one block, even when no row sees a key (causal with Sq > Sk, or a window that ends
    before key 0): the consumers then mask all of it and write O = 0 and lse = +inf, as for any
    empty row. (``lo < hi`` whenever ``hi > 0``, and ``lo <= Sk − 1``, so ``n_start`` is always
    a block of K.)"""
    offset = seq_kv - seq_q
    first_row, last_row = _tile_rows(m_blk, block_M, seq_q)
    lo = 0
    if left >= 0:
        lo = T.max(0, first_row + offset - left)
    hi = seq_kv
    if right >= 0:
        hi = T.max(0, T.min(seq_kv, last_row + offset + right + 1))
    n_start = lo // block_N
    return n_start, T.max(1, T.ceildiv(hi, block_N) - n_start)


def window_mask_runs(m_blk, n_start, n_blocks, block_M, block_N, seq_q, seq_kv, left, right):
    """``(n_left, n_inner_end)``: of the tile's key blocks ``n_start + k`` (``k = 0 … n_blocks −
    1``), the blocks ``n_left <= k < n_inner_end`` are seen whole by every row of the tile and go
    unmasked; the blocks before them (the window's left edge) and after them (its right edge,
    the ragged tail ``Sk % block_N``) are masked. A block is whole when it starts at or after the
    last row's first key and ends at or before the first row's last key, and before Sk. When
    the edges overlap, ``n_inner_end = n_left`` and every block is masked."""
    offset = seq_kv - seq_q
    first_row, last_row = _tile_rows(m_blk, block_M, seq_q)
    first_whole = 0  # the first block starting at or after the last row's first key
    if left >= 0:
        first_whole = T.ceildiv(T.max(0, last_row + offset - left), block_N)
    end_whole = seq_kv // block_N  # one past the last block ending before Sk …
    if right >= 0:  # … and at or before the first row's last key
        last_key = T.max(0, first_row + offset + right + 1)  # one past it
        end_whole = T.min(end_whole, last_key // block_N)
    n_left = T.min(T.max(first_whole - n_start, 0), n_blocks)
    return n_left, T.max(T.min(end_whole - n_start, n_blocks), n_left)


# ----------------------------------------------------------------------------- kernel
def counter_section(batch, heads, heads_kv, seq_q, seq_kv, dim, one_sided, block_M, slots):
    """Heads a section of the tile counter's order holds, or 0 for the round-robin deal.

    A window bounded on one side only (causal without a left bound, say) makes a tile's cost grow
    or shrink along the sequence. With more tiles than thread blocks (``slots``: SMs times thread
    blocks an SM), a global counter then hands the tiles out one at a time, to whichever thread
    block is free, heaviest first (longest processing time first) within sections of heads whose
    K and V fit ``SECTION_BYTES`` (they stay in L2 while the section runs; a group's query heads
    share theirs): the scheduler of the dense forwards at D=64 and D=128
    (examples/flash_attention/example_gqa_fwd_bshd.py, ``counter_section``). A window bounded on
    both sides, or on neither, costs about the same for every tile: those go round-robin.

    Against the deal it replaced (causal tiles in pairs of equal cost, others round-robin) it
    measured 1.08-1.18x where that deal left thread blocks idle, 1.00-1.04x on regular causal
    grids and 0.96x on one the pairs filled (benchmarks/results/sink_counter_h200.md)."""
    nm, flat = -(-seq_q // block_M), batch * heads
    if not one_sided or nm * flat <= slots:
        return 0
    cap = max(1, SECTION_BYTES * heads // (seq_kv * dim * 2 * 2 * heads_kv))
    return max(d for d in range(1, min(cap, flat) + 1) if flat % d == 0)


def tile_of(t, num_m_blocks, heads, section, heavy_last):
    """(query block, head, batch) of tile t, in flashattn_fwd's order. Round-robin (``section``
    0): a head's query blocks in a row, so thread blocks running side by side share K/V in L2.
    From the counter: sections of ``section`` heads, in each the heaviest query blocks first (the
    last ones when ``heavy_last``: a window bounded on the right only), one of each head."""
    nm = num_m_blocks
    if section == 0:
        m_blk, f = t % nm, t // nm
    else:
        r = t % (section * nm)
        f = t // (section * nm) * section + r % section
        rank = r // section  # 0: the heaviest query block
        m_blk = nm - 1 - rank if heavy_last else rank
    return m_blk, f % heads, f // heads


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim,
    window_left,  # -1 or >= 0, as normalised by normalize_window (causal is window_right = 0)
    window_right,
    has_sinks,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=128,
    num_stages=2,
    num_sms=132,  # an H100 SXM's; attention() passes the device's own count
    q_stages=1,
    ctas_per_sm=1,
):
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    offset = seq_kv - seq_q  # bottom-right alignment: query i's window is centred on key i+offset
    neg_inf = -T.infinity(accum_dtype)
    q_shape = [batch, heads, seq_q, dim]
    kv_shape = [batch, heads_kv, seq_kv, dim]
    if ctas_per_sm not in (1, 2) or (ctas_per_sm == 2 and block_M != 64):
        # The measured pairing: 64-row tiles, one consumer warpgroup at 232 registers. Three
        # thread blocks an SM ran once and then faulted (illegal address) under CUDA graphs.
        raise ValueError(f"ctas_per_sm must be 1, or 2 with block_M = 64; got {ctas_per_sm}")
    consumers = 2 * block_M  # one consumer warpgroup (128 threads) per 64 query rows
    # A thread block is given its share of the 64K-register file at launch (with ctas_per_sm
    # thread blocks an SM, that many shares), a thread's share rounded down to a multiple of 8;
    # setmaxnreg only moves registers among its warps (a request beyond that allocation waits
    # forever). The producer keeps 24 a thread; the consumers share the rest (multiples of 8, at
    # most 240): 240 for two consumer warpgroups, 160 for three, 232 for one of two thread blocks.
    regs = 65536 // (ctas_per_sm * (consumers + 128)) // 8 * 8 * (consumers + 128)
    consumer_regs = min(240, (regs - 128 * PRODUCER_REGS) // consumers // 8 * 8)
    # With Q in two slots and one thread block an SM, each tile after a thread block's first
    # starts under the last P V of the one before (``next_tile_under_last_pv``); two thread
    # blocks an SM already run one's tile edges under the other's GEMMs (``default_config``).
    cross_tile = q_stages > 1 and ctas_per_sm == 1

    # Persistent schedule: one thread block per SM walks a list of tiles (a tile = block_M query
    # rows of one head), so the producer loads the next tile's Q and K while the consumers
    # finish the last one. When the window is bounded on one side only (causal without a left
    # bound, say), a tile's cost grows or shrinks along the sequence; when there are more tiles
    # than thread blocks they then come one at a time from a global counter, heaviest first
    # (``counter_section``): ``dynamic``. A window bounded on both sides costs about the same
    # for every tile: round-robin.
    num_m_blocks = (seq_q + block_M - 1) // block_M
    num_tiles = num_m_blocks * heads * batch
    one_sided = (window_left < 0) != (window_right < 0)
    section = counter_section(
        batch, heads, heads_kv, seq_q, seq_kv, dim, one_sided, block_M, num_sms * ctas_per_sm
    )  # fmt: skip
    dynamic = section > 0
    grid = min(num_sms * ctas_per_sm, num_tiles)

    def tile_index(cta, it):
        # The it-th tile of thread block cta, round-robin (t >= num_tiles: no tile); with the
        # counter only a thread block's first (its cta).
        return cta + it * grid

    def key_range(m_blk):
        return window_key_blocks(m_blk, block_M, block_N, seq_q, seq_kv, window_left, window_right)

    def tile_coords(t):
        # (query block, head, batch) of tile t (``tile_of``).
        return tile_of(t, num_m_blocks, heads, section, window_right >= 0)

    def mask_runs(m_blk, n_start, n_blocks):
        return window_mask_runs(
            m_blk, n_start, n_blocks, block_M, block_N, seq_q, seq_kv, window_left, window_right
        )

    # ------------------------------------------------------------------ the steps, named
    # T.macro is inlined where it is called: the generated CUDA is the same as with the steps
    # written out in the loops below.
    @T.macro
    def load_q(Q, Q_shared, q_full, q_empty, tile_count, m_blk, by, bz, tile_ids=None, t=None):
        slot = tile_count % q_stages
        # Producer: wait until the consumers are done with the last tile's Q, then load this
        # one. A fresh mbarrier counts as having completed the phase before phase 0, so the
        # first wait on an "empty" barrier (parity 1) passes at once. Rows past Sq read as
        # zeros (TMA fills out of bounds). ``tile_ids``: with the counter, the tile's index t
        # goes beside its Q, for the consumers to read once Q has landed (the mbarrier's
        # arrival publishes it).
        T.mbarrier_wait_parity(q_empty[slot], ((tile_count // q_stages) & 1) ^ 1)
        if tile_ids is not None and T.get_thread_binding() == consumers:
            tile_ids[slot] = t
        T.tma_copy(
            Q[bz, by, m_blk * block_M : (m_blk + 1) * block_M, :],
            Q_shared[slot, :, :],
            barrier=q_full[slot],
        )
        T.barrier_arrive(q_full[slot])

    @T.macro
    def load_kv(K, V, K_shared, V_shared, k_full, v_full, k_empty, v_empty, g, kb, by, bz):
        # Producer: key block kb into ring slot g (stage g % num_stages, phase g // num_stages).
        stage = g % num_stages
        phase = (g // num_stages) & 1
        T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
        T.tma_copy(
            K[bz, by // groups, kb * block_N : (kb + 1) * block_N, :],
            K_shared[stage, :, :],
            barrier=k_full[stage],
        )
        T.barrier_arrive(k_full[stage])
        T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
        T.tma_copy(
            V[bz, by // groups, kb * block_N : (kb + 1) * block_N, :],
            V_shared[stage, :, :],
            barrier=v_full[stage],
        )
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
    def mask(kb, m_blk, acc_s):
        # Scores outside the window (or past Sk) become -inf. Called only on the blocks that
        # window_mask_runs marks (and on the first block of a window bounded on the left).
        for i, j in T.Parallel(block_M, block_N):
            key = kb * block_N + j
            row = m_blk * block_M + i
            # One select per bound: joined by `and` (C's short-circuit `&&`), nvcc compiles
            # the bounds into branches, around which the WGMMA still running waits.
            score = T.if_then_else(key < seq_kv, acc_s[i, j], neg_inf)
            if window_right >= 0:
                score = T.if_then_else(key <= row + offset + window_right, score, neg_inf)
            if window_left >= 0:
                score = T.if_then_else(key >= row + offset - window_left, score, neg_inf)
            acc_s[i, j] = score

    @T.macro
    def softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum):
        # Online softmax: fold the block into the running row max and row sum, and turn the
        # scores into P = exp2(S·scale − max·scale). The sink is not here: see row_factors.
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
        g, kb, masked, m_blk, q_slot, Q_shared, K_shared, V_shared, acc_s, acc_s_cast, acc_o,
        scores_max, scores_max_prev, scores_scale, scores_sum, logsum, k_full, v_full, k_empty,
        v_empty,
    ):  # fmt: skip
        # One key block after the first (ring slot g, key block kb): issue S = Q K(kb)ᵀ and
        # O += P V of the previous block back to back (asynchronous WGMMA), wait for S only,
        # and run its softmax while the P V GEMM still occupies the tensor cores.
        stage = g % num_stages
        prev = (g - 1) % num_stages
        T.mbarrier_wait_parity(k_full[stage], (g // num_stages) & 1)
        T.mbarrier_wait_parity(v_full[prev], ((g - 1) // num_stages) & 1)
        scores(Q_shared[q_slot, :, :], K_shared[stage, :, :], acc_s)
        pv(acc_s_cast, V_shared[prev, :, :], acc_o)
        T.wait_wgmma(1)  # S is ready; the previous block's P V may still run
        T.barrier_arrive(k_empty[stage])
        if masked:
            mask(kb, m_blk, acc_s)
        softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
        T.wait_wgmma(0)  # acc_o and acc_s_cast are free again
        T.barrier_arrive(v_empty[prev])
        rescale(acc_o, scores_scale)
        T.copy(acc_s, acc_s_cast)

    @T.macro
    def row_factors(logsum, scores_max, sink, factor, lse, m_blk, by, bz):
        # Once the tile's last softmax has run, its row statistics are final: each row's output
        # factor goes to ``factor`` and its lse leaves. The sink joins the softmax here, once per
        # row. In base-2 units (x·log2 e), with m = the running max over the row's scores,
        # l = Σ exp2(s − m) and a = Σ exp2(s − m) v:
        #     m' = max(m, sink),  l' = l·exp2(m − m') + exp2(sink − m'),  O = a·exp2(m − m') / l'
        # Both exponents are <= 0, so neither term can overflow, whatever the sink (a sink far
        # above the scores makes exp2(m − m') underflow to 0 and O to 0, its limit; a sink of
        # -inf adds exp2(-inf) = 0, no sink). Starting the loop with m = sink and l = 1 would be
        # as safe, but would also make l > 0 for a row that sees no key; here l = 0 still says
        # "no visible key" (O = 0, lse = +inf), and the key loop is the dense kernel's.
        # The tile's rows below Sq, counted in a local: written as m_blk * block_M + i < seq_q,
        # TileLang 0.1.15 folds the bound into the thread index on some shapes and its
        # ThreadSync pass then rejects the build ("a required shared-memory sync inside a
        # divergent region"): D=128 causal Sq = 4000 (a last query block partial among 32,
        # from the tile counter), and the two-thread-block tiles on some ragged D=64 shapes.
        rows_left = T.alloc_local([1], "int32")
        rows_left[0] = seq_q - m_blk * block_M
        for i in T.Parallel(block_M):
            m = scores_max[i] * scale
            if has_sinks:
                sink2 = sink * LOG2E
                m_sink = T.max(m, sink2)
                ratio = T.exp2(m - m_sink)
                total = logsum[i] * ratio + T.exp2(sink2 - m_sink)
                factor[i] = T.if_then_else(logsum[i] > 0, ratio / total, 0)
                row_lse = T.if_then_else(
                    logsum[i] > 0, (T.log2(total) + m_sink) / LOG2E, T.infinity(accum_dtype)
                )
            else:
                factor[i] = T.if_then_else(logsum[i] > 0, 1.0 / logsum[i], 0)
                row_lse = T.if_then_else(
                    logsum[i] > 0, (T.log2(logsum[i]) + m) / LOG2E, T.infinity(accum_dtype)
                )
            if i < rows_left[0]:  # rows past Sq are not written
                lse[bz, by, m_blk * block_M + i] = row_lse

    @T.macro
    def store_output(acc_o, factor, O_shared, Output, m_blk, by, bz):
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= factor[i]
        # O leaves through shared memory and one TMA store (rows past Sq are clipped).
        T.copy(acc_o, O_shared)
        T.copy(O_shared, Output[bz, by, m_blk * block_M : (m_blk + 1) * block_M, :])

    @T.macro
    def first_block_mask(m_blk, acc_s):
        # A tile's first key block takes the mask when the window is bounded on the left (its
        # left edge), or when it is the tile's only block before the masked run.
        n_start, n_blocks = key_range(m_blk)
        if window_left >= 0:
            mask(n_start, m_blk, acc_s)
        else:
            if mask_runs(m_blk, n_start, n_blocks)[1] == 0:
                mask(n_start, m_blk, acc_s)

    @T.macro
    def start_tile(
        m_blk, kv_count, tile_count, Q_shared, K_shared, q_full, k_full, k_empty, acc_s,
        acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale, scores_sum, logsum,
    ):  # fmt: skip
        # A tile's first key block on its own: S = Q Kᵀ, its softmax; P waits in registers.
        T.fill(acc_o, 0)
        T.fill(logsum, 0)
        T.fill(scores_max, neg_inf)
        q_slot = tile_count % q_stages
        T.mbarrier_wait_parity(q_full[q_slot], (tile_count // q_stages) & 1)
        stage = kv_count % num_stages
        T.mbarrier_wait_parity(k_full[stage], (kv_count // num_stages) & 1)
        scores(Q_shared[q_slot, :, :], K_shared[stage, :, :], acc_s)
        T.wait_wgmma(0)
        T.barrier_arrive(k_empty[stage])
        first_block_mask(m_blk, acc_s)
        softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
        T.copy(acc_s, acc_s_cast)  # P in 16 bits: the A operand of P V

    @T.macro
    def next_tile_under_last_pv(
        m_next, g, next_count, Q_shared, K_shared, V_shared, q_full, k_full, v_full, k_empty,
        v_empty, acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale,
        scores_sum, logsum,
    ):  # fmt: skip
        # Across tiles, as across key blocks: the next tile's first S = Q Kᵀ is issued, then
        # this tile's last P V (g: its key block's place in the K/V stream), and the next
        # tile's first softmax runs while P V still occupies the tensor cores. The next tile's
        # Q is already in its slot; the row statistics start afresh (this tile's lse is out and
        # its output factors kept).
        q_slot = next_count % q_stages
        stage, stage_next = g % num_stages, (g + 1) % num_stages
        T.fill(logsum, 0)
        T.fill(scores_max, neg_inf)
        T.mbarrier_wait_parity(q_full[q_slot], (next_count // q_stages) & 1)
        T.mbarrier_wait_parity(k_full[stage_next], ((g + 1) // num_stages) & 1)
        T.mbarrier_wait_parity(v_full[stage], (g // num_stages) & 1)
        scores(Q_shared[q_slot, :, :], K_shared[stage_next, :, :], acc_s)
        pv(acc_s_cast, V_shared[stage, :, :], acc_o)
        T.wait_wgmma(1)  # S is ready; P V may still run
        T.barrier_arrive(k_empty[stage_next])
        first_block_mask(m_next, acc_s)
        softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
        T.wait_wgmma(0)
        T.barrier_arrive(v_empty[stage])
        # P in 16 bits now, so that S's registers are free again for this tile's epilogue.
        T.copy(acc_s, acc_s_cast)

    @T.macro
    def kernel_body(Q, K, V, Sinks, Output, lse, counter=None):
        with T.Kernel(grid, threads=consumers + 128) as cta:
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
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
            factor = T.alloc_fragment([block_M], accum_dtype)  # a finished tile's, for its O

            # mbarriers between producer and consumers. "full": the producer warp's 32 threads
            # arrive and its TMA load completes the byte count; "empty": every consumer thread
            # arrives when it no longer reads the buffer. K and V stages have a pair each.
            q_full = T.alloc_barrier([32] * q_stages)
            q_empty = T.alloc_barrier([consumers] * q_stages)
            k_full = T.alloc_barrier([32] * num_stages)
            v_full = T.alloc_barrier([32] * num_stages)
            k_empty = T.alloc_barrier([consumers] * num_stages)
            v_empty = T.alloc_barrier([consumers] * num_stages)
            # What every key step after the first reads and writes (key_step's arguments).
            step_buffers = (
                Q_shared, K_shared, V_shared, acc_s, acc_s_cast, acc_o, scores_max,
                scores_max_prev, scores_scale, scores_sum, logsum, k_full, v_full, k_empty, v_empty,
            )  # fmt: skip
            # Both sides count the key blocks and tiles they have been through, so each knows
            # which stage (g % num_stages) and barrier phase (g // num_stages) comes next.
            kv_count = T.alloc_var("int32")
            tile_count = T.alloc_var("int32")
            sink = T.alloc_var(accum_dtype)  # this tile's sink logit (consumers)
            tile_ids = None
            if dynamic:  # the index of the tile whose Q is in each slot
                tile_ids = T.alloc_shared([q_stages], "int32")
            kv_count = 0
            tile_count = 0
            n_iter = T.ceildiv(num_tiles - cta, grid)
            if dynamic:
                # With the counter, a side's tile and the next: the loops below run until the
                # counter has passed the last tile (``num_tiles`` only bounds them).
                n_iter = num_tiles
                t_dyn = T.alloc_var("int32")
                t_next = T.alloc_var("int32")
                t_dyn = cta
            tx = T.get_thread_binding()

            if tx >= consumers:
                # ----------------------------------------------------------- producer warpgroup
                T.set_max_nreg(PRODUCER_REGS, 0)  # hand registers over to the consumers
                # One warp issues the loads, as many threads as TMA needs; the other three
                # would only poll the ring's mbarriers beside the consumers.
                if tx < consumers + 32:
                    for it in T.serial(n_iter):
                        t = t_dyn if dynamic else tile_index(cta, it)
                        if t < num_tiles:
                            m_blk, by, bz = tile_coords(t)
                            n_start, n_blocks = key_range(m_blk)
                            load_q(
                                Q, Q_shared, q_full, q_empty, tile_count, m_blk, by, bz, tile_ids,
                                t,
                            )  # fmt: skip
                            for k in T.serial(n_blocks):
                                load_kv(
                                    K, V, K_shared, V_shared, k_full, v_full, k_empty, v_empty,
                                    kv_count + k, n_start + k, by, bz,
                                )  # fmt: skip
                            kv_count = kv_count + n_blocks
                            tile_count = tile_count + 1
                        if dynamic:
                            # The next tile, taken as this one's last K/V loads are out; the
                            # counter starts at 0, and every thread block's first tile is cta.
                            t_next = 0
                            if tx == consumers:
                                t_next = T.atomic_add(counter[0], 1, return_prev=True)
                            t_dyn = T.shfl_sync(t_next, 0) + grid
                            if t_dyn >= num_tiles:
                                T.loop_break()
                    if dynamic:
                        # None left: the consumers find an index past the last beside no Q.
                        slot = tile_count % q_stages
                        T.mbarrier_wait_parity(q_empty[slot], ((tile_count // q_stages) & 1) ^ 1)
                        if tx == consumers:
                            tile_ids[slot] = t_dyn
                        T.barrier_arrive(q_full[slot])
            else:
                # ---------------------------------------------------------- consumer warpgroups
                T.set_max_nreg(consumer_regs, 1)
                if cross_tile and n_iter > 0 and tile_index(cta, 0) < num_tiles:
                    # The first tile's first key block on its own; every later tile's starts
                    # under the tile before it (next_tile_under_last_pv).
                    start_tile(
                        tile_coords(tile_index(cta, 0))[0], kv_count, tile_count, Q_shared,
                        K_shared, q_full, k_full, k_empty, acc_s, acc_s_cast, acc_o,
                        scores_max, scores_max_prev, scores_scale, scores_sum, logsum,
                    )  # fmt: skip
                for it in T.serial(n_iter):
                    t = t_dyn if dynamic else tile_index(cta, it)
                    if t < num_tiles:
                        m_blk, by, bz = tile_coords(t)
                        n_start, n_blocks = key_range(m_blk)
                        n_left, n_inner_end = mask_runs(m_blk, n_start, n_blocks)
                        if has_sinks:  # loaded now, used at the end of the tile: latency hides
                            sink = Sinks[by]
                        q_slot = tile_count % q_stages
                        if not cross_tile:  # every tile starts on its own
                            start_tile(
                                m_blk, kv_count, tile_count, Q_shared, K_shared, q_full, k_full,
                                k_empty, acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev,
                                scores_scale, scores_sum, logsum,
                            )  # fmt: skip

                        # The other key blocks. A window bounded on the left has two edges: its
                        # blocks go in three runs, left edge (masked), the blocks every row sees
                        # whole (no mask), right edge and ragged tail (masked), so that no block
                        # decides at run time whether to mask; with that decision in the loop
                        # ptxas spills (D=128, window (1024, 0)). A window open on the left keeps
                        # the dense kernel's single loop, each block testing k >= n_inner_end:
                        # three runs there spill at D=64 with 192-row tiles and trip TileLang
                        # 0.1.15's ThreadSync pass on some causal shapes.
                        if window_left >= 0:
                            for k in T.serial(1, n_left):
                                key_step(
                                    kv_count + k, n_start + k, True, m_blk, q_slot, *step_buffers
                                )
                            for k in T.serial(T.max(1, n_left), n_inner_end):
                                key_step(
                                    kv_count + k, n_start + k, False, m_blk, q_slot, *step_buffers
                                )
                            for k in T.serial(T.max(1, n_inner_end), n_blocks):
                                key_step(
                                    kv_count + k, n_start + k, True, m_blk, q_slot, *step_buffers
                                )
                        else:
                            for k in T.serial(1, n_blocks):
                                key_step(
                                    kv_count + k, n_start + k, k >= n_inner_end, m_blk, q_slot,
                                    *step_buffers,
                                )  # fmt: skip
                        # Every Q Kᵀ of this tile is done: the producer may load a later Q here.
                        T.barrier_arrive(q_empty[q_slot])
                        row_factors(logsum, scores_max, sink, factor, lse, m_blk, by, bz)

                        g = kv_count + n_blocks - 1
                        if not dynamic:
                            t_next = tile_index(cta, it + 1)
                        elif cross_tile:  # the next tile's index, beside its Q (needed now)
                            qn = (tile_count + 1) % q_stages
                            T.mbarrier_wait_parity(q_full[qn], (tile_count + 1) // q_stages & 1)
                            t_next = tile_ids[qn]
                        if cross_tile and it + 1 < n_iter and t_next < num_tiles:
                            next_tile_under_last_pv(
                                tile_coords(t_next)[0], g, tile_count + 1, Q_shared, K_shared,
                                V_shared, q_full, k_full, v_full, k_empty, v_empty, acc_s,
                                acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale,
                                scores_sum, logsum,
                            )  # fmt: skip
                        else:
                            stage = g % num_stages
                            T.mbarrier_wait_parity(v_full[stage], (g // num_stages) & 1)
                            pv(acc_s_cast, V_shared[stage, :, :], acc_o)
                            T.wait_wgmma(0)
                            T.barrier_arrive(v_empty[stage])

                        store_output(acc_o, factor, O_shared, Output, m_blk, by, bz)
                        if cross_tile:
                            T.fill(acc_o, 0)  # the next tile's P V accumulates from zero
                        kv_count = kv_count + n_blocks
                        tile_count = tile_count + 1
                    if dynamic:
                        if not cross_tile:
                            # The next tile's index, beside its Q: waited for only now, so
                            # that its load delays nothing of this tile's.
                            slot = tile_count % q_stages
                            T.mbarrier_wait_parity(q_full[slot], (tile_count // q_stages) & 1)
                            t_next = tile_ids[slot]
                        t_dyn = t_next
                        if t_dyn >= num_tiles:
                            T.loop_break()

    if dynamic:  # one more argument: the tile counter, zero at launch

        @T.prim_func
        def flash_fwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            Sinks: T.Tensor([heads], accum_dtype),  # not read when has_sinks is False
            Output: T.Tensor(q_shape, dtype),
            lse: T.Tensor([batch, heads, seq_q], accum_dtype),
            counter: T.Tensor([1], "int32"),
        ):
            kernel_body(Q, K, V, Sinks, Output, lse, counter)

    else:

        @T.prim_func
        def flash_fwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            Sinks: T.Tensor([heads], accum_dtype),  # not read when has_sinks is False
            Output: T.Tensor(q_shape, dtype),
            lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        ):
            kernel_body(Q, K, V, Sinks, Output, lse)

    return flash_fwd


# Two thread blocks an SM (``default_config``'s choice for the narrowest windows).
TWO_CTA_TILES = dict(block_M=64, block_N=64, num_stages=2, q_stages=2, ctas_per_sm=2)


def default_config(dim, window=(-1, -1), arch="sm_90a", seq_len=None):
    """Tile configuration for a (head dim, window as the kernel takes it — see
    ``normalize_window`` —, arch, key length ``seq_len``): for a window bounded on both sides
    and at most 256 keys wide, two thread blocks an SM with 64×64 tiles; otherwise
    ``single_cta_config``'s.

    Two thread blocks an SM against the default before them, one process (H100, 2026-11-23,
    bf16, causal windows, sinks, graph replays): window 128, H64/Hkv8 D64, S4096 0.056 against
    0.064 ms, S8192 0.107 against 0.124, S16384 0.221 against 0.247; D128 S8192 0.162 against
    0.180; window 256 (B8 S2048 D64) 0.312 against 0.322; but window 1024 lost, D64 0.862
    against 0.800 and D128 0.635 against 0.580 ms. 64×128 tiles with two thread blocks lost
    2-6% at D64 (and do not fit twice at D128); three K/V stages were level at D64
    (−0.3 … +1.7%) and lost 13-29% at D128, where they no longer fit twice. 64-row tiles with
    one thread block an SM lost 33-35% at windows 128 and 256.
    """
    single = single_cta_config(dim, window, arch, seq_len)  # raises off Hopper
    left, right = window
    if left >= 0 and right >= 0 and left + right <= 256:
        return dict(TWO_CTA_TILES)
    return single


def single_cta_config(dim, window=(-1, -1), arch="sm_90a", seq_len=None):
    """Tiles for one thread block an SM (every window but the narrowest, and the varlen sink
    forward's always).

    The dense GQA forward's tiles (examples/flash_attention/example_gqa_fwd_bshd.py, measured on
    an H100 with full and causal masks), except where this kernel's masks need more registers:
    D=128: 128×128 tiles (two consumer warpgroups), two K/V stages. D=64: 192-row tiles (three
    consumer warpgroups at 160 registers) for a window open on the left, except one bounded on
    the right with Sk ≤ 2048 (128-row tiles, as the dense kernel's causal case); a window bounded
    on the left takes 128-row tiles (with 192 rows, its two-sided mask makes ptxas spill).
    For a narrow window these tiles also win: at window (128, 0), D=64, H64/Hkv8, bf16
    (H100, 2026-11-23, every ``tune_configs`` entry of 64 and 128 rows in one process, S=4096
    and 8192), 128×128 with two stages was fastest; one stage took 2-4% longer, 128×64 tiles
    9-21%, 64-row tiles 15-42%.

    Q takes two shared-memory slots (``q_stages=2``) wherever they fit: every tile but D=64's
    192 rows, where the second slot makes ptxas spill. Measured against one slot in one process
    (H100, 2026-11-23, bf16, causal windows, GQA H64/Hkv8 D64 unless said): window 128, S4096
    0.069 against 0.081 ms, S8192 0.129 against 0.145, S16384 0.245 against 0.275; window 256,
    B8 S2048 0.321 against 0.364; window 1024 (B2 H32/Hkv8 S8192 D128) 0.553 against 0.553; no
    window (B4 H32/Hkv8 S4096 D128) 0.977 against 0.974. Outputs bit-identical. With two Q
    slots, more K/V stages do not help a narrow window (H100, 2026-11-23, D64 H64/Hkv8, three
    or four stages against two: −2% … +1% at windows 128, 256, 1024 and none, BHSD and varlen),
    and 64-key blocks with four or six stages lose 4–21%.

    With two Q slots and one thread block an SM, each tile after a thread block's first starts
    under the last P V of the tile before (H100, 2026-11-27, bf16, against each tile started on
    its own, nine interleaved rounds; outputs and lse bit-identical): window 1024 D128 1.03x,
    D64 1.02x; no window D128 1.02x, causal D128 1.01x (S1024 and S4096); window 300 D128
    level; rows whose tiles start as before read 1.00-1.02x in the same run, so the gain is
    small. Two thread blocks an SM start every tile on their own: there the other thread
    block's GEMMs already fill a tile's edges, and the cross-tile start measured 0.98-0.99x
    (windows 128 and 256, D64).

    The dense forward's turns at the tensor cores for its 192-row tiles (each consumer
    warpgroup issuing its GEMMs only on its own named barrier's turn) measured level here:
    0.98-1.04x this kernel on five D=64 rows with no window or a causal one (2026-11-28, H200,
    one process, nine rounds, where the same kernel timed twice read 0.99-1.04x). Not kept.
    """
    if not arch.startswith("sm_90"):
        raise ValueError(
            f"arch {arch}: this kernel is written for Hopper (sm_90a: TMA, WGMMA, setmaxnreg)"
        )
    left, right = window
    block_M = 128
    if dim <= 64:
        short = right >= 0 and seq_len is not None and seq_len <= 2048
        block_M = 128 if left >= 0 or short else 192
    q_stages = q_slots(block_M)
    return dict(block_M=block_M, block_N=128, num_stages=2, q_stages=q_stages, ctas_per_sm=1)


def q_slots(block_M):
    """Shared-memory slots for Q: two (``default_config``), one for 192-row tiles."""
    return 1 if block_M > 128 else 2


def tune_configs(dim):
    """The small space ``--tune`` compares (64 query rows per consumer warpgroup; at D=128 two
    warpgroups at most: with a third, 128 registers a thread are too few), and the two-thread-
    block tiles of ``default_config``."""
    rows = (64, 128, 192) if dim <= 64 else (64, 128)
    return [
        dict(block_M=bm, block_N=bn, num_stages=st, q_stages=q_slots(bm), ctas_per_sm=1)
        for bm in rows
        for bn in (64, 128)
        for st in (1, 2)
    ] + [dict(TWO_CTA_TILES)]


# ----------------------------------------------------------------------------- torch-facing
def device_arch(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def dtype_name(t):
    return "float16" if t.dtype == torch.float16 else "bfloat16"


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_window(window_size):
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if not (ok and all(_is_int(w) and w >= -1 for w in window_size)):
        raise ValueError(
            f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), "
            f"got {window_size!r}"
        )


def normalize_window(window_size, causal, seq_q, seq_k):
    """(left, right) as the kernel takes it: ``right = 0`` when causal (FlashAttention's rule),
    and a bound that no row reaches becomes -1 (left >= Sk - 1, right >= Sq - 1: the window of
    every row already covers all keys on that side), so equivalent windows share one kernel."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    if left >= seq_k - 1:
        left = -1
    if right >= seq_q - 1:
        right = -1
    return left, right


def _check_inputs(q, k, v, sinks, window_size, causal, softmax_scale):
    """ValueError naming the first bad argument; the device last, so any other needs no GPU."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    real = isinstance(softmax_scale, numbers.Real)
    if softmax_scale is not None and not (real and 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    _check_window(window_size)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seqlen, dim], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    B, H, _, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        got = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"q, k, v must share a dtype, float16 or bfloat16; got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k, v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        got = tuple(k.shape)
        raise ValueError(f"k must be [{B}, heads_kv, seqlen_k, {D}] to match q, got {got}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv}): H % Hkv != 0")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise ValueError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"sinks must be [heads] = [{H}], got {tuple(sinks.shape)}")
        if sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be float32, got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


def attention_forward(q, k, v, sinks, window_size, causal, softmax_scale, config=None):
    """The kernel on checked, contiguous input (what the operator runs): ``out [B, H, Sq, D]``
    and ``lse [B, H, Sq]`` (float32, natural log, the sink included). ``window_size`` as the
    caller gave it; ``normalize_window`` settles it here, on the real lengths."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to launch
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        key = tuple(sorted(config.items())) if config else None
        launch = forward_plan(
            B, H, Hkv, Sq, Sk, D, tuple(window_size), causal, sinks is not None,
            float(softmax_scale), dtype_name(q), key, q.device,
        )  # fmt: skip
        # The kernel takes a sinks tensor either way; without sinks it never reads it.
        sinks_in = sinks.detach().contiguous() if sinks is not None else lse.new_empty(H)
        launch(q, k, v, sinks_in, out, lse)
    return out, lse


@functools.lru_cache(maxsize=256)
def forward_plan(B, H, Hkv, Sq, Sk, D, window_size, causal, has_sinks, softmax_scale, dtype,
                 config, device):  # fmt: skip
    """The kernel every forward of one shape launches, settled on its first call: the window on
    the real lengths, the tiles (``config``: the caller's as sorted (key, value) pairs, or None
    for ``default_config``), the device's SM count and the build, as ``entry``: host work that
    only the shape decides, which a narrow window's forward (a fraction of a millisecond on the
    GPU) would otherwise pay on every call."""
    left, right = normalize_window(window_size, causal, Sq, Sk)
    arch = device_arch(device)
    measured = default_config(D, (left, right), arch, Sk)  # raises off Hopper
    cfg = dict(config) if config else measured
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    args = (B, H, Hkv, Sq, Sk, D, left, right, has_sinks, softmax_scale, dtype)

    def build(tiles):
        return flashattn_fwd(*args, **tiles, num_sms=num_sms)

    if not config and cfg["ctas_per_sm"] > 1:  # one thread block where two do not build
        single = single_cta_config(D, (left, right), arch, Sk)
        return entry(build_with_fallback(build, cfg, single, (args, num_sms)))
    launch = entry(build(cfg))
    one_sided = (left < 0) != (right < 0)
    slots = num_sms * cfg.get("ctas_per_sm", 1)
    if counter_section(B, H, Hkv, Sq, Sk, D, one_sided, cfg.get("block_M", 128), slots):
        # The tiles from a counter (one more argument), which starts at zero at every launch.
        def launch_counted(*tensors):
            launch(*tensors, torch.zeros(1, dtype=torch.int32, device=tensors[0].device))

        return launch_counted
    return launch


def entry(kernel):
    """A built kernel's compiled entry point, called with every argument in order (none of these
    kernels allocates an output). TileLang's call wrapper, which counts the arguments and builds
    the output list, costs host time on every launch; on a narrow window, whose kernels take a
    fraction of a millisecond, host time paces the call. The entry point still checks each
    argument's shape, dtype and device."""
    executable = getattr(kernel.adapter, "get_exportable_executable", None)
    if executable is None:  # another execution backend: its own call
        return kernel
    module = executable()  # a built module, or (built in this process) one still to link
    if isinstance(module, tvm.runtime.Executable):
        module = module.jit()
    return module.main


_REJECTED = set()  # the kernel arguments whose two-thread-block default TileLang rejected


def build_with_fallback(build, cfg, single, key):
    """``build(cfg)``; if TileLang 0.1.15's ThreadSync pass rejects ``cfg``'s two-thread-block
    tiles ("Cannot lower a required shared-memory sync inside a divergent region"),
    ``build(single)`` instead, the one-thread-block tiles. The rejection is remembered
    (``key``: the kernel's arguments), so it is paid once, not at every call. The shapes once
    rejected (e.g. D=64, Sq=500, Sk=700, window (128, 0)) build since ``row_factors`` holds its
    row bound in a local; this stays for shapes not tried."""
    if key not in _REJECTED:
        try:
            return build(cfg)
        except Exception as error:  # tvm.error.InternalError
            if "[ThreadSync]" not in str(error):
                raise
            _REJECTED.add(key)
    return build(single)


# torch.compile: the kernel as a custom operator (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls it as one opaque node, without a graph break, and learns its outputs'
# shapes, dtypes and strides from the fake implementation. ``sinks`` may be None (Tensor?); the
# window travels as its two ints, as the caller gave them (normalize_window needs the lengths,
# which may be symbolic in traced code: it runs in the operator). A config travels as its values
# in CONFIG_KEYS order (an operator takes no dicts; None: the default), so tuned tiles compile too.
CONFIG_KEYS = ("block_M", "block_N", "num_stages", "q_stages", "ctas_per_sm")


def operator_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    window_size_left: int,
    window_size_right: int,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    window = (window_size_left, window_size_right)
    return attention_forward(q, k, v, sinks, window, causal, softmax_scale, cfg)


attention_forward_op = torch.library.custom_op(
    "tl_attn::gqa_sink_fwd_bhsd", operator_forward, mutates_args=()
)


@attention_forward_op.register_fake
def _(q, k, v, sinks, window_size_left, window_size_right, causal, softmax_scale, config):
    B, H, Sq, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


def attention(
    q,
    k,
    v,
    sinks=None,
    window_size=(-1, -1),
    causal=False,
    softmax_scale=None,
    return_lse=False,
    config=None,
):
    """Attention with sinks and a sliding window: ``q [B, H, Sq, D]``, ``k, v [B, Hkv, Sk, D]``
    (fp16/bf16, CUDA), ``sinks [H]`` float32 or None, ``window_size (left, right)``.

    Returns ``out [B, H, Sq, D]``, and ``lse [B, H, Sq]`` (float32, natural log, sink included)
    when ``return_lse``. ``config`` overrides the tile configuration (see ``default_config``).
    """
    _check_inputs(q, k, v, sinks, window_size, causal, softmax_scale)
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
    out, lse = forward(q, k, v, sinks, *window, causal, float(softmax_scale), tiles)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- reference
def window_mask(seq_q, seq_k, window_size, causal, device=None):
    """Boolean ``[Sq, Sk]``: True where query i sees key j (bottom-right aligned window; causal
    sets right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)
    cols = torch.arange(seq_k, device=device)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    return visible


def ref_program(
    q, k, v, sinks=None, window_size=(-1, -1), causal=False, softmax_scale=None, return_lse=False
):
    """Plain PyTorch in float32 (float64 inputs stay float64; runs on CPU too), same conventions
    as ``attention``."""
    acc = torch.promote_types(q.dtype, torch.float32)
    D = q.shape[-1]
    Sq, Sk = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    groups = q.shape[1] // k.shape[1]
    # Each kv head serves `groups` consecutive query heads.
    kf, vf = (einops.repeat(t.to(acc), "b h s d -> b (h g) s d", g=groups) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), kf) * scale
    visible = window_mask(Sq, Sk, window_size, causal, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse_keys = torch.logsumexp(scores, dim=-1)  # -inf for a row that sees no key
    lse = lse_keys
    if sinks is not None:  # the sink joins the denominator: lse = log(exp(sink) + Σ exp(s))
        lse = torch.logaddexp(lse_keys, sinks.to(acc)[None, :, None].expand_as(lse_keys))
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, vf).to(q.dtype)
    # Rows that see no key: out 0 (above), lse +inf (the collection's convention), sink or not.
    lse = lse.masked_fill(torch.isneginf(lse_keys), float("inf"))
    return (out, lse) if return_lse else out


def attended_pairs(seq_q, seq_k, window_size, causal) -> int:
    """How many (query, key) pairs the window lets through: the work a window kernel does."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seq_q, dtype=torch.int64) + (seq_k - seq_q)
    lo = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = (rows + right).clamp(max=seq_k - 1) if right >= 0 else torch.full_like(rows, seq_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def window_flops(batch, heads, seq_q, seq_k, dim, window_size, causal) -> float:
    """Forward FLOPs over the attended pairs only: 4·B·H·pairs·D (QKᵀ and PV)."""
    return 4.0 * batch * heads * attended_pairs(seq_q, seq_k, window_size, causal) * dim


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def _window_bound(text):
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= -1 (-1: unbounded), got {text}")
    return value


def build_parser(description=None, tune=True):
    """The command line; example_gqa_sink_bwd_bhsd.py shares it (its own title, no --tune)."""
    description = description or __doc__.splitlines()[0]
    parser = _harness().base_parser(description, archs=ARCHS, dims=HEAD_DIMS, tune=tune)
    parser.add_argument("--groups", type=int, default=8, help="query heads per kv head")
    parser.add_argument(
        "--window",
        nargs=2,
        type=_window_bound,
        default=[-1, -1],
        metavar=("LEFT", "RIGHT"),
        help="sliding window (keys before and after the diagonal; -1: unbounded)",
    )
    parser.add_argument(
        "--sinks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one random sink logit per query head (--no-sinks: plain attention)",
    )
    return parser


def _config_name(cfg):
    name = "{block_M}x{block_N}/{num_stages}st".format(**cfg)
    return name + ("/2cta" if cfg.get("ctas_per_sm", 1) > 1 else "")


def _load_example(relpath):
    """A script of examples/flash_attention (the dense peer), or None when it is not there."""
    path = pathlib.Path(__file__).resolve().parents[1] / relpath
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("peer_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flex_peer(q, k, v, sinks, window_size, causal, softmax_scale):
    """FlexAttention (compiled) with the window as a block mask; the sink by rescaling its
    output with its lse, per row: ``out · exp(lse) / (exp(lse) + exp(sink))`` =
    ``out · sigmoid(lse − sink)``. Returns a callable, or None when FlexAttention is missing."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    except ImportError:
        return None
    left, right = window_size
    if causal:
        right = 0
    Sq, Sk = q.shape[2], k.shape[2]
    offset = Sk - Sq

    def window(b, h, q_idx, kv_idx):
        visible = kv_idx >= 0
        if left >= 0:
            visible = visible & (kv_idx >= q_idx + offset - left)
        if right >= 0:
            visible = visible & (kv_idx <= q_idx + offset + right)
        return visible

    block_mask = create_block_mask(window, None, None, Sq, Sk, device=q.device)
    compiled = torch.compile(flex_attention) if q.is_cuda else flex_attention
    gqa = q.shape[1] != k.shape[1]

    def run():
        out, aux = compiled(
            q, k, v, block_mask=block_mask, scale=softmax_scale, enable_gqa=gqa,
            return_aux=AuxRequest(lse=True),
        )  # fmt: skip
        if sinks is None:
            return out
        keep = torch.sigmoid(aux.lse - sinks[None, :, None])  # exp(lse) / (exp(lse) + exp(sink))
        return (out * keep[..., None]).to(q.dtype)

    return run


def dense_peer(q, k, v, causal, softmax_scale):
    """Our dense forward on the same inputs, without window or sinks (a speed reference):
    example_mha_fwd_bhsd.py for MHA, example_gqa_fwd_bshd.py (on BSHD copies, made here,
    outside the timing) for GQA. None when the script is not found."""
    if q.shape[1] == k.shape[1]:
        mod = _load_example("flash_attention/example_mha_fwd_bhsd.py")
        return mod and (lambda: mod.attention(q, k, v, causal, softmax_scale))
    mod = _load_example("flash_attention/example_gqa_fwd_bshd.py")
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return mod and (lambda: mod.attention(qt, kt, vt, causal, softmax_scale))


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.groups < 1 or args.heads % args.groups != 0:
        parser.error(f"--groups ({args.groups}) must be positive and divide --heads ({args.heads})")
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Hkv = H // args.groups
    Sk = args.seq_len_k or Sq
    scale = 1.0 / math.sqrt(D)
    window = tuple(args.window)
    left, right = normalize_window(window, args.causal, Sq, Sk)
    script = pathlib.Path(__file__).name
    what = (
        f"B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} window={window} causal={args.causal} "
        f"sinks={args.sinks} {args.dtype}"
    )

    if args.compile_only:
        cfg = default_config(D, (left, right), args.arch, Sk)
        kernel = harness.compile_for(
            flashattn_fwd, args.arch, B, H, Hkv, Sq, Sk, D, left, right, args.sinks, scale,
            args.dtype, **cfg,
        )  # fmt: skip
        print(f"{script}: built for {args.arch} with {cfg} (window as built: {(left, right)})")
        print(harness.describe_source("flashattn_fwd", kernel.get_kernel_source()))
        return

    harness.require_gpu(script, capability=(9, 0))
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype)
    sinks = torch.randn(H, device="cuda", dtype=torch.float32) * 2 if args.sinks else None

    def ours(cfg):
        return lambda: attention(q, k, v, sinks, window, args.causal, scale, config=cfg)

    def benchmark(configs):
        """Ours, one row per entry of ``configs`` (name → config), beside FlexAttention and our
        dense kernel; every row charged the attended pairs only (so TFLOP/s compare as times)."""
        peers = {}
        flex = flex_peer(q, k, v, sinks, window, args.causal, scale)
        if flex is not None:
            # A peer must agree with us before it is timed.
            err = harness.rel_error(flex(), ours(next(iter(configs.values())))())
            if err < 1e-2:
                peers["flex_attention"] = flex
            else:
                print(f"  flex_attention disagrees with ours (rel {err:.2e}): not timed")
        dense_causal = args.causal or window[1] == 0
        dense = dense_peer(q, k, v, dense_causal, scale)
        dense_name = "tilelang dense" + (" causal" if dense_causal else "")
        if dense is not None:
            peers[dense_name] = dense
        flops = window_flops(B, H, Sq, Sk, D, window, args.causal)
        rows = harness.report(f"forward {what}", dict(ours_named(configs)), peers, flops)
        for r in rows:  # the dense kernel's rate on the work it does
            if r["impl"] == dense_name:
                own = harness.attention_flops(B, H, Sq, Sk, D, D, dense_causal) / r["ms"] * 1e-9
                print(f"  ({dense_name} on its own FLOPs, no window: {own:.1f} TFLOP/s)")
        return rows

    def ours_named(configs):
        return {name: ours(cfg) for name, cfg in configs.items()}

    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest is checked.
        named = {"tilelang " + _config_name(c): c for c in tune_configs(D)}
        config = named[harness.fastest(benchmark(named))]
        print(f"tuned: {config}")

    if args.check:
        out, lse = attention(q, k, v, sinks, window, args.causal, scale, True, config)
        ref_out, ref_lse = ref_program(q, k, v, sinks, window, args.causal, scale, True)
        print(f"check {what}")
        harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
        harness.check_close("lse", lse, ref_lse, rtol=1e-3)  # fp32 statistics: tighter

    if args.bench and not args.tune:
        benchmark({"tilelang": config})


if __name__ == "__main__":
    main()
