"""FlashAttention forward, multi-head, variable-length (packed) batches, TileLang on Hopper (SM90).

Real batches are ragged. Instead of padding every sequence to the longest one, the varlen layout
packs the valid tokens of all sequences back to back (``bert_padding.unpad_input`` builds it from
a padded batch and its attention mask):

    q [total_q, H, D]    k, v [total_k, H, D]    cu_seqlens_q, cu_seqlens_k: int32 [B + 1]

Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows
``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``; its queries attend to its own keys only. Query and key
lengths may differ per sequence. ``max_seqlen_q`` and ``max_seqlen_k`` (Python ints, at least the
longest sequence) are taken for FlashAttention compatibility and checked; the kernel's work
comes from the lengths themselves.

The kernel is the persistent, warp-specialized forward of example_mha_fwd_bshd.py (read that one
first): one warp of a producer warpgroup loads Q and a ring of K/V tiles by TMA and hands them
over through "full" / "empty" mbarriers; consumer warpgroups issue S = Q K(k)ᵀ and O += P(k-1)
V(k-1) back to back as asynchronous WGMMA and run the online softmax of block k while the second
GEMM runs; one thread block per SM loops over tiles, so the next tile's loads run under the
current tile's last GEMM and epilogue. What packing changes:

- the tiles are listed on the host (``tile_schedule``), where the lengths already are (checking
  the input reads ``cu_seqlens``): one tile per (sequence, head, query block), so a sequence
  costs its own blocks and an empty one none. Sequences come heaviest first, and the query
  blocks of one head together, so the thread blocks running side by side share that head's K
  and V in L2. The list is dealt in rounds, one tile per thread block: in each round the
  heaviest tile goes to the thread block with the least work so far. The kernel takes the
  result as a tensor ``[rounds, grid, 6]``; producer and consumers read the same entries, so they
  walk the same tiles and their mbarrier phases stay in step;
- a last round of fewer tiles than SMs would leave SMs idle (most of them when the whole batch
  has far fewer tiles than SMs: short queries over long keys, such as a prefill chunk against
  its context). Its tiles are then walked in parts over their key blocks, one part a thread
  block (``last_round_parts``), where the list's cost model says the round ends sooner by more
  than the extra launch costs. Each part leaves its output, normalised by its own row sums,
  and its lse in float32; ``flashattn_fwd_varlen_combine`` merges each row's parts by their
  lse. It is the dense forward's split over the keys, decided tile by tile;
- a tile reads its sequence's start and length from ``cu_seqlens`` and loads Q, K and V by TMA
  at that row offset into the packed tensors. A box that runs past the end of its sequence reads
  the next sequence's rows (or zeros past the tensor): keys past ``seq_len_k`` are masked to -inf
  before the softmax and query rows past ``seq_len_q`` are never stored, so no other sequence
  leaks in;
- the output of a query block wholly inside its sequence leaves through shared memory by one TMA
  store, as in the dense kernel; the sequence's last, partial block is written row by row under a
  guard (its TMA box would overwrite the next sequence's first rows). ``lse`` is
  ``[H, total_q]``, as in FlashAttention's varlen API.

The host side — the tile list, the tile configurations, the reads and checks of the
``cu_seqlens`` values and ``main``'s padded test batch — and the combine kernel are
example_gqa_fwd_varlen.py's, imported from beside this file: with one kv head per query head
they are the same code.

``total_q``, ``total_k``, ``B`` and the shape of the tile list are TileLang dynamic dimensions
(``T.dynamic``), so one compiled kernel serves every batch: only the head count, head dim, dtype,
causal flag, scale and tiles pick a kernel.

Causal masking is aligned bottom-right per sequence (as FlashAttention ≥ 2.1): query ``i`` of a
sequence sees its key ``j`` when ``j <= i + seq_len_k - seq_len_q``. A query row that sees no key
(or whose sequence has no keys) gives ``out = 0`` and ``lse = +inf``, never NaN.

API (FlashAttention's ``flash_attn_varlen_func`` conventions; docs/CONVENTIONS.md):

    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=False, softmax_scale=None, return_lse=False, config=None)

    q: (total_q, nheads, headdim), float16 or bfloat16, on a CUDA device; headdim 64 or 128.
    k, v: (total_k, nheads, headdim), same dtype and device.
    cu_seqlens_q, cu_seqlens_k: (batch + 1,), int32, on q's device. Cumulative sequence
        lengths, starting at 0.
    max_seqlen_q, max_seqlen_k: int. At least the longest query / key sequence.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    return_lse: bool. Also return lse: (nheads, total_q), float32, natural log.
    config: dict. Tile configuration (block_M, block_N, num_stages); default ``default_config``.
    Returns out: (total_q, nheads, headdim), or (out, lse) when return_lse.

Underneath, ``attention_varlen`` calls the custom operator ``tl_attn::mha_fwd_varlen``
(``torch.library``), which also reads and checks the ``cu_seqlens`` values, so
``torch.compile(model, fullgraph=True)`` compiles a model around it without a graph break.

Run:
    python examples/flash_attention/example_mha_fwd_varlen.py --batch 8 --seq_len 2048 --causal
    python examples/flash_attention/example_mha_fwd_varlen.py --compile-only --arch sm_90a  # no GPU
"""

import functools
import math
import numbers
import pathlib
import sys

import tilelang
import tilelang.language as T
import torch

LOG2E = 1.4426950408889634
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    # The kernel splits producer and consumers itself (below); no automatic warp specialization.
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_90a",)  # --arch: Hopper only (TMA, WGMMA and setmaxnreg throughout)
PRODUCER_REGS = 24
TURNS = 9  # named barriers 9, 10, 11: the consumer warpgroups' turns at the tensor cores

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import example_gqa_fwd_varlen as gqa  # noqa: E402  (the GQA varlen script, beside this one)

# The host side is the GQA script's, unchanged for H = Hkv: the tile list (``tile_schedule``:
# tiles of one head run side by side, heaviest first) and the launches over it (``launch_plan``),
# the tile configurations, the reads and checks of cu_seqlens' values, and main's padded test
# batch.
tile_schedule = gqa.tile_schedule
launch_plan = gqa.launch_plan
flashattn_fwd_varlen_combine = gqa.flashattn_fwd_varlen_combine  # no head layout of its own
default_config = gqa.default_config
tune_configs = gqa.tune_configs
device_arch = gqa.device_arch
_host_values = gqa._host_values
_check_values = gqa._check_values
_bert_padding = gqa._bert_padding
random_lengths = gqa.random_lengths
padded_batch = gqa.padded_batch


# ----------------------------------------------------------------------------- kernel
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd_varlen(
    heads,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=128,
    num_stages=2,
):
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    neg_inf = -T.infinity(accum_dtype)
    # Sizes that change from batch to batch are dynamic: no recompilation for a new batch. The
    # tile list (tile_schedule) is [rounds, grid, 6], and its grid is the launch grid; the parts'
    # outputs have ``slots`` rows of tiles.
    total_q, total_k, batch, rounds, grid, slots = T.dynamic(
        "total_q, total_k, batch, rounds, grid, slots"
    )  # fmt: skip
    consumers = 2 * block_M  # one consumer warpgroup (128 threads) per 64 query rows
    # A thread block is given the 64K-register file at launch, a thread's share rounded down to
    # a multiple of 8; setmaxnreg only moves registers among its warps (a request beyond that
    # allocation waits forever). The producer keeps 24 a thread; the consumers share the rest
    # (multiples of 8, at most 240): 240 for two consumer warpgroups, 160 for three, 112 for four.
    regs = 65536 // (consumers + 128) // 8 * 8 * (consumers + 128)
    consumer_regs = min(240, (regs - 128 * PRODUCER_REGS) // consumers // 8 * 8)

    def first_masked_block(row0, seq_len_q, seq_len_k):
        # Only the ragged tail block (seq_len_k % block_N) and, when causal, the blocks crossing
        # the diagonal need a mask; every key block before this one is used unmasked.
        if causal:
            diagonal = row0 + seq_len_k - seq_len_q
            return T.min(seq_len_k // block_N, T.max(0, diagonal // block_N))
        return seq_len_k // block_N

    # Three consumer warpgroups (192-row tiles, D=64) take turns issuing their GEMMs, as in the
    # dense forward: each waits for its turn on its own named barrier, issues, and hands the
    # turn to the next, so that one's GEMMs run under the others' softmax.
    turns = block_M == 192

    @T.macro
    def turn_wait():
        if turns:
            T.sync_threads(TURNS + T.get_thread_binding() // 128, 256)

    @T.macro
    def turn_pass():
        if turns:
            T.named_barrier_arrive(TURNS + (T.get_thread_binding() // 128 + 1) % 3, 256)

    @T.macro
    def scores(Q_shared, K_stage, acc_s):
        # S = Q Kᵀ of one key block, issued asynchronously (the caller waits).
        T.wgmma_gemm(
            Q_shared, K_stage, acc_s, transpose_B=True, clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )  # fmt: skip

    @T.macro
    def pv(acc_s_cast, V_stage, acc_o):
        # O += P V of one key block, issued asynchronously (the caller waits).
        T.wgmma_gemm(acc_s_cast, V_stage, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def online_softmax(
        k, masked, seq_len_k, diagonal, acc_s, scores_max, scores_max_prev, scores_scale,
        scores_sum, logsum,
    ):  # fmt: skip
        # acc_s holds S = Q Kᵀ of key block k: mask it (``masked``: a bool, or a condition
        # tested at run time), fold it into the running row max and row sum, and turn it into
        # P = exp2(S·scale - max·scale). Keys past seq_len_k belong to the next sequence: they
        # never get in. Row i sees key j when j <= diagonal + i (causal).
        if causal:
            if masked:
                # A row of the sequence sees keys up to diagonal + i <= seq_len_k - 1: the
                # causal bound alone keeps the next sequence's keys out (rows past seq_len_q
                # are never stored).
                for i, j in T.Parallel(block_M, block_N):
                    visible = k * block_N + j <= diagonal + i
                    acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], neg_inf)
        elif masked:
            for i, j in T.Parallel(block_M, block_N):
                visible = k * block_N + j < seq_len_k
                acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], neg_inf)
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
    def key_step(
        k, masked, kv_count, seq_len_k, diagonal, Q_shared, K_shared, V_shared, acc_s, acc_s_cast,
        acc_o, scores_max, scores_max_prev, scores_scale, scores_sum, logsum, k_full, v_full,
        k_empty, v_empty,
    ):  # fmt: skip
        # Key block k: issue S(k) = Q K(k)ᵀ and O += P(k-1) V(k-1) back to back (asynchronous
        # WGMMA), wait for S(k) only, and run its softmax while P(k-1) V(k-1) still occupies
        # the tensor cores.
        g = kv_count + k
        stage = g % num_stages
        prev = (g - 1) % num_stages
        T.mbarrier_wait_parity(k_full[stage], (g // num_stages) & 1)
        turn_wait()
        scores(Q_shared, K_shared[stage, :, :], acc_s)
        # V(k-1)'s wait comes after S(k)'s issue, under that GEMM: even a landed load's wait
        # costs cycles, idle tensor cores if spent first.
        T.mbarrier_wait_parity(v_full[prev], ((g - 1) // num_stages) & 1)
        pv(acc_s_cast, V_shared[prev, :, :], acc_o)
        turn_pass()
        T.wait_wgmma(1)  # S(k) is ready; P(k-1) V(k-1) may still run
        T.barrier_arrive(k_empty[stage])
        online_softmax(
            k, masked, seq_len_k, diagonal, acc_s, scores_max, scores_max_prev, scores_scale,
            scores_sum, logsum,
        )  # fmt: skip
        T.wait_wgmma(0)  # acc_o and acc_s_cast are free again
        T.barrier_arrive(v_empty[prev])
        # Rescale what was accumulated under the old row max.
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]
        T.copy(acc_s, acc_s_cast)

    @T.macro
    def epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, q_offset, row0, seq_len_q, by):
        # Normalise; rows with no visible key (logsum = 0) give O = 0 and lse = +inf.
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
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
                lse[by, q_offset + row0 + i] = T.if_then_else(
                    logsum[i] > 0,
                    (T.log2(logsum[i]) + scores_max[i] * scale) / LOG2E,
                    T.infinity(accum_dtype),
                )

    @T.macro
    def part_epilogue(acc_o, logsum, scores_max, O_part, lse_part, slot):
        # A part of a tile: its output normalised by its own row sums and its lse (log2 units),
        # in float32, every row of the tile, for flashattn_fwd_varlen_combine. A row that sees
        # none of the part's keys leaves O = 0 and lse = -inf: no weight in the merge.
        for i, j in T.Parallel(block_M, dim):
            O_part[slot, i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
        for i in T.Parallel(block_M):
            lse_part[slot, i] = T.if_then_else(
                logsum[i] > 0, T.log2(logsum[i]) + scores_max[i] * scale, neg_inf
            )

    @T.prim_func
    def flash_fwd_varlen(
        Q: T.Tensor([total_q, heads, dim], dtype),
        K: T.Tensor([total_k, heads, dim], dtype),
        V: T.Tensor([total_k, heads, dim], dtype),
        cu_seqlens_q: T.Tensor([batch + 1], "int32"),
        cu_seqlens_k: T.Tensor([batch + 1], "int32"),
        tiles: T.Tensor([rounds, grid, 6], "int32"),
        Output: T.Tensor([total_q, heads, dim], dtype),
        lse: T.Tensor([heads, total_q], accum_dtype),
        O_part: T.Tensor([slots, block_M, dim], accum_dtype),
        lse_part: T.Tensor([slots, block_M], accum_dtype),
    ):
        with T.Kernel(grid, threads=consumers + 128) as cta:
            Q_shared = T.alloc_shared([block_M, dim], dtype)
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
            q_full = T.alloc_barrier(32)
            q_empty = T.alloc_barrier(consumers)
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
            # The current tile, read once into registers: its sequence bz, head by, first query
            # row row0 within the sequence, the sequence's packed offsets and lengths, and the
            # key blocks first … end - 1 it walks (all of them, or a part's) and the part's slot.
            bz = T.alloc_var("int32")
            by = T.alloc_var("int32")
            row0 = T.alloc_var("int32")
            q_offset = T.alloc_var("int32")  # first packed row of the sequence's queries
            k_offset = T.alloc_var("int32")  # and of its keys
            seq_len_q = T.alloc_var("int32")
            seq_len_k = T.alloc_var("int32")
            first = T.alloc_var("int32")
            end = T.alloc_var("int32")
            slot = T.alloc_var("int32")  # -1: a whole tile
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
                            row0 = tiles[it, cta, 0] * block_M
                            by = tiles[it, cta, 1]
                            q_offset = cu_seqlens_q[bz]
                            k_offset = cu_seqlens_k[bz]
                            seq_len_q = cu_seqlens_q[bz + 1] - q_offset
                            seq_len_k = cu_seqlens_k[bz + 1] - k_offset
                            first = tiles[it, cta, 4]
                            end = tiles[it, cta, 5]
                            n_blocks = end - first
                            # A fresh mbarrier counts as having completed the phase before phase 0,
                            # so the first wait on an "empty" barrier (parity 1) passes at once.
                            T.mbarrier_wait_parity(q_empty, (tile_count & 1) ^ 1)
                            T.tma_copy(
                                Q[q_offset + row0 : q_offset + row0 + block_M, by, :],
                                Q_shared,
                                barrier=q_full,
                            )
                            T.barrier_arrive(q_full)
                            for k in T.serial(n_blocks):
                                g = kv_count + k
                                stage = g % num_stages
                                phase = (g // num_stages) & 1
                                kv0 = k_offset + (first + k) * block_N  # its first key's row
                                T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
                                T.tma_copy(
                                    K[kv0 : kv0 + block_N, by, :],
                                    K_shared[stage, :, :],
                                    barrier=k_full[stage],
                                )
                                T.barrier_arrive(k_full[stage])
                                T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
                                T.tma_copy(
                                    V[kv0 : kv0 + block_N, by, :],
                                    V_shared[stage, :, :],
                                    barrier=v_full[stage],
                                )
                                T.barrier_arrive(v_full[stage])
                            kv_count = kv_count + n_blocks
                            tile_count = tile_count + 1
            else:
                # ---------------------------------------------------------- consumer warpgroups
                T.set_max_nreg(consumer_regs, 1)
                if turns and T.get_thread_binding() < 128:  # the first warpgroup goes first
                    T.named_barrier_arrive(TURNS, 256)
                for it in T.serial(rounds):
                    bz = tiles[it, cta, 2]
                    if bz >= 0:
                        row0 = tiles[it, cta, 0] * block_M
                        by = tiles[it, cta, 1]
                        q_offset = cu_seqlens_q[bz]
                        k_offset = cu_seqlens_k[bz]
                        seq_len_q = cu_seqlens_q[bz + 1] - q_offset
                        seq_len_k = cu_seqlens_k[bz + 1] - k_offset
                        slot = tiles[it, cta, 3]
                        first = tiles[it, cta, 4]
                        end = tiles[it, cta, 5]
                        diagonal = row0 + seq_len_k - seq_len_q  # bottom-right, per sequence
                        n_blocks = end - first
                        first_masked = first_masked_block(row0, seq_len_q, seq_len_k)
                        T.fill(acc_o, 0)
                        T.fill(logsum, 0)
                        T.fill(scores_max, neg_inf)
                        T.mbarrier_wait_parity(q_full, tile_count & 1)

                        # Key block ``first``: S = Q Kᵀ, its softmax; P waits in registers.
                        stage = kv_count % num_stages
                        T.mbarrier_wait_parity(k_full[stage], (kv_count // num_stages) & 1)
                        turn_wait()
                        scores(Q_shared, K_shared[stage, :, :], acc_s)
                        turn_pass()
                        T.wait_wgmma(0)
                        T.barrier_arrive(k_empty[stage])
                        online_softmax(
                            first, first_masked <= first, seq_len_k, diagonal, acc_s, scores_max,
                            scores_max_prev, scores_scale, scores_sum, logsum,
                        )  # fmt: skip
                        T.copy(acc_s, acc_s_cast)  # P in 16 bits: the A operand of P V

                        # The other key blocks in two loops, so that neither tests for the mask
                        # inside: those before the first masked one (the causal diagonal, or
                        # without causal the ragged last block), then the masked ones. A part may
                        # end before the first masked block. Block k is the (k - first)-th of the
                        # tile in the K/V stream.
                        step_args = (
                            kv_count - first, seq_len_k, diagonal, Q_shared, K_shared, V_shared,
                            acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale,
                            scores_sum, logsum, k_full, v_full, k_empty, v_empty,
                        )  # fmt: skip
                        unmasked_end = T.max(first + 1, T.min(first_masked, end))
                        for k in T.serial(first + 1, unmasked_end):
                            key_step(k, False, *step_args)
                        for k in T.serial(unmasked_end, end):
                            key_step(k, True, *step_args)
                        # Every Q Kᵀ of this tile is done: the producer may load the next Q.
                        T.barrier_arrive(q_empty)

                        g = kv_count + n_blocks - 1
                        stage = g % num_stages
                        T.mbarrier_wait_parity(v_full[stage], (g // num_stages) & 1)
                        turn_wait()
                        pv(acc_s_cast, V_shared[stage, :, :], acc_o)
                        turn_pass()
                        T.wait_wgmma(0)
                        T.barrier_arrive(v_empty[stage])

                        if slot < 0:
                            epilogue(
                                acc_o, logsum, scores_max, O_shared, Output, lse, q_offset, row0,
                                seq_len_q, by,
                            )  # fmt: skip
                        else:
                            part_epilogue(acc_o, logsum, scores_max, O_part, lse_part, slot)
                        kv_count = kv_count + n_blocks
                        tile_count = tile_count + 1

    return flash_fwd_varlen


# ----------------------------------------------------------------------------- torch-facing
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
    if k.shape[1] != H or k.shape[2] != D:
        hint = "q's heads, dim: MHA script; GQA: example_gqa_fwd_varlen.py"
        raise ValueError(f"k must be [total_k, {H}, {D}] ({hint}), got {tuple(k.shape)}")
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


def attention_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, config=None
):
    """The kernel on checked, contiguous input: ``out`` and ``lse`` (what the operator runs)."""
    del max_seqlen_q  # the tile list comes from the lengths themselves
    H, D = q.shape[1:]
    out = torch.empty_like(q)
    lse = torch.empty(H, q.shape[0], dtype=torch.float32, device=q.device)
    if k.shape[0] == 0:  # no keys in any sequence: every row is empty, nothing to launch
        out.zero_()
        lse.fill_(math.inf)
    elif q.shape[0] > 0:
        dtype = "float16" if q.dtype == torch.float16 else "bfloat16"
        launch = forward_plan(
            tuple(_host_values(cu_seqlens_q)), tuple(_host_values(cu_seqlens_k)), H, D,
            bool(causal), float(softmax_scale), dtype,
            tuple(sorted(config.items())) if config else None, q.device,
        )  # fmt: skip
        launch(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse)
    return out, lse


@functools.lru_cache(maxsize=64)
def forward_plan(
    cu_seqlens_q, cu_seqlens_k, heads, dim, causal, softmax_scale, dtype, config, device
):
    """The GQA script's ``forward_plan`` for this script's kernel: settled on the first call
    over one batch's lengths and kept for the next."""
    cfg = dict(config) if config else default_config(dim, device_arch(device), causal)
    kernel = flashattn_fwd_varlen(heads, dim, causal, softmax_scale, dtype, **cfg)
    return launch_plan(kernel, cu_seqlens_q, cu_seqlens_k, heads, dim, causal, dtype, cfg, device)


# torch.compile: the kernel as a custom operator (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls it as one opaque node, without a graph break, and learns its outputs'
# shapes, dtypes and strides from the fake implementation. A config travels as its values in
# CONFIG_KEYS order (an operator takes no dicts; None: the default), so tuned tiles compile too.
# The checks that read cu_seqlens run in the real implementation, never in traced code, so a
# compiled model reads each cu_seqlens tensor once, as eager code does.
CONFIG_KEYS = ("block_M", "block_N", "num_stages")


def operator_forward(
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
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    return attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, cfg
    )


attention_forward_op = torch.library.custom_op(
    "tl_attn::mha_fwd_varlen", operator_forward, mutates_args=()
)


@attention_forward_op.register_fake
def _(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, config
):
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
    causal=False,
    softmax_scale=None,
    return_lse=False,
    config=None,
):
    """Varlen FlashAttention forward (FlashAttention's ``flash_attn_varlen_func`` conventions).

    ``q [total_q, H, D]``, ``k, v [total_k, H, D]`` (fp16/bf16, CUDA), ``cu_seqlens_q/k`` int32
    ``[B + 1]`` on the same device, ``max_seqlen_q/k`` Python ints. Returns ``out [total_q, H,
    D]``, and ``lse [H, total_q]`` (float32, natural log) when ``return_lse``. ``config``
    overrides the tile configuration (see ``default_config``). The inputs are validated, which
    reads each ``cu_seqlens`` tensor back to the host once (see ``_host_values``), inside the
    operator.
    """
    _check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
    )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    tiles = [config[key] for key in CONFIG_KEYS] if config else None
    # Compiled code, fake tensors and calls autograd records take the operator (a backward
    # through it is then an error, not a silent zero gradient); any other eager call runs its
    # body without the operator's dispatch (docs/CONVENTIONS.md, "Eager calls").
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    forward = operator_forward if eager and not recorded else attention_forward_op
    out, lse = forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        float(softmax_scale), tiles,
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- references
def _dense_reference(q, k, v, causal, scale):
    """One sequence, ``q [Sq, H, D]``, ``k, v [Sk, H, D]`` → out, lse ``[H, Sq]``."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        Sq, Sk = q.shape[0], k.shape[0]
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (Sk - Sq), float("-inf"))
    # A row that sees no key gives probabilities 0 (softmax would give NaN): out 0, lse +inf
    # (FlashAttention's convention).
    seen = torch.isfinite(scores).any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    out = torch.einsum("hqk,khd->qhd", probs, v)
    lse = torch.logsumexp(scores, dim=-1)
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
    conventions as ``attention_varlen``: one dense attention per sequence, so memory stays
    bounded by the longest sequence."""
    del max_seqlen_q, max_seqlen_k  # FlashAttention compatibility: cu_seqlens holds the lengths
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
    ``q [B, Sq, H, D]``, ``k, v [B, Sk, H, D]``, masks ``[B, S]`` marking each sequence's valid
    tokens as a prefix. Padded keys are masked out; padded query rows give 0. Float32, one
    batch entry at a time so memory stays bounded."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    rows = torch.arange(q.shape[1], device=q.device)[:, None]
    cols = torch.arange(k.shape[1], device=q.device)[None, :]
    outs = []
    for b in range(q.shape[0]):
        scores = torch.einsum("qhd,khd->hqk", q[b].to(acc), k[b].to(acc)) * scale
        visible = key_mask[b].bool()[None, :].expand(q.shape[1], -1)
        if causal:  # bottom-right within this sequence's own lengths
            diagonal = key_mask[b].sum() - query_mask[b].sum()
            visible = visible & (cols <= rows + diagonal)
        scores = scores.masked_fill(~visible, float("-inf"))
        seen = visible.any(dim=-1, keepdim=True)  # rows that see no key give 0, not NaN
        probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
        outs.append(torch.einsum("hqk,khd->qhd", probs, v[b].to(acc)))
    out = torch.stack(outs) * query_mask[:, :, None, None]
    return out.to(q.dtype)


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    parser = _harness().base_parser(
        __doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS, seq_len=2048
    )
    parser.set_defaults(batch=8)
    parser.description += (
        ". Sequence lengths are drawn at random from 1..--seq_len (keys: 1..--seq_len_k, or the "
        "query lengths when it is not given); the batch holds a sequence of length 1 and one of "
        "the maximum."
    )
    return parser


def _config_name(cfg):
    return "{block_M}x{block_N}/{num_stages}st".format(**cfg)


def main(argv=None):
    harness = _harness()
    args = build_parser().parse_args(argv)
    B, H, D = args.batch, args.heads, args.dim
    Sq = args.seq_len
    Sk = args.seq_len_k or Sq
    scale = 1.0 / math.sqrt(D)
    script = pathlib.Path(__file__).name

    if args.compile_only:
        cfg = default_config(D, args.arch, args.causal)
        kernel = harness.compile_for(
            flashattn_fwd_varlen, args.arch, H, D, args.causal, scale, args.dtype, **cfg
        )
        print(f"{script}: built for {args.arch} with {cfg} (batch sizes and tile list dynamic)")
        print(harness.describe_source("flashattn_fwd_varlen", kernel.get_kernel_source()))
        merge = harness.compile_for(
            flashattn_fwd_varlen_combine, args.arch, H, D, args.dtype, cfg["block_M"]
        )  # fmt: skip
        print(harness.describe_source("flashattn_fwd_varlen_combine", merge.get_kernel_source()))
        return

    harness.require_gpu(script, capability=(9, 0))
    bp = _bert_padding()
    dtype = harness.DTYPES[args.dtype]
    (q_pad, k_pad, v_pad), mask_q, mask_k = padded_batch(
        B, Sq, Sk, H, H, D, dtype, distinct_k=args.seq_len_k is not None
    )
    # Padded batch + mask → packed tokens, cu_seqlens and max_seqlen.
    q, indices_q, cu_seqlens_q, max_seqlen_q, _ = bp.unpad_input(q_pad, mask_q)
    k, _, cu_seqlens_k, max_seqlen_k, _ = bp.unpad_input(k_pad, mask_k)
    v = bp.unpad_input(v_pad, mask_k)[0]
    varlen = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    print(f"B{B} H{H} D{D} causal={args.causal} {args.dtype}: {q.shape[0]} query tokens")
    print(f"  query lengths {lengths}")

    def benchmark(configs):
        """Ours, one row per entry of ``configs`` (name → config), beside the peers."""
        ours = {
            name: lambda c=cfg: attention_varlen(*varlen, args.causal, scale, config=c)
            for name, cfg in configs.items()
        }
        flops = harness.varlen_flops(cu_seqlens_q, cu_seqlens_k, H, D, D, args.causal)
        peers = {}
        fa3 = harness.fa3_varlen_forward()
        if fa3 is not None and dtype == torch.bfloat16:
            peers["fa3 varlen"] = lambda: fa3(*varlen, softmax_scale=scale, causal=args.causal)
        title = f"varlen forward B{B} H{H} max {Sq}/{Sk} D{D} causal={args.causal} {args.dtype}"
        return harness.report(title, ours, peers, flops)

    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest is checked.
        named = {"tilelang varlen " + _config_name(c): c for c in tune_configs(D)}
        config = named[harness.fastest(benchmark(named))]
        print(f"tuned: {config}")

    if args.check:
        out, lse = attention_varlen(*varlen, args.causal, scale, return_lse=True, config=config)
        # Packed → padded again, compared with dense attention on the padded batch.
        out_pad = bp.pad_input(out, indices_q, B, Sq)
        ref = ref_padded(q_pad, k_pad, v_pad, mask_q, mask_k, args.causal, scale)
        _, ref_lse = ref_program(*varlen, args.causal, scale, return_lse=True)
        harness.check_close("out", out_pad, ref, rtol=1e-2)  # fp16/bf16 forward
        harness.check_close("lse", lse, ref_lse, rtol=1e-3)  # fp32 statistics: tighter

    if args.bench and not args.tune:
        benchmark({"tilelang varlen": config})


if __name__ == "__main__":
    main()
