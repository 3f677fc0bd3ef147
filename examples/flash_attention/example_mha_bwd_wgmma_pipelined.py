"""FlashAttention backward for Hopper with FlashAttention-3's schedule written out by hand
(BSHD, multi-head, TileLang).

Computes the gradients of ``O = softmax(Q Kᵀ · scale) V`` for ``q [B, Sq, H, D]`` and
``k, v [B, Sk, H, D]``: with ``P`` the attention probabilities (rebuilt from the forward's
log-sum-exp ``lse``) and ``delta = rowsum(O ∘ dO)``,

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − delta),   dQ = scale · dS K,   dK = scale · dSᵀ Q.

It is the same algorithm as example_mha_bwd_bshd.py (read that one first: one thread block per
block of keys, dK and dV held in registers while the block walks over the queries, dQ summed
over key blocks in float32). That script lets TileLang pipeline the loop; this one writes the
schedule out, and the difference is where the time goes (README, "Backward").

The schedule, per thread block of ``block_M`` = 128 keys (384 threads):

- Producer warpgroup (24 registers, ``setmaxnreg``). Warp 0 loads K and V once, then, per
  step, the next ``block_N`` queries' Q (with their ``lse``) and dO (with their ``delta``) by TMA
  into a ``num_stages``-deep ring; each buffer has a "full" mbarrier (the TMA load's bytes
  complete it) and an "empty" one (the consumers arrive when they no longer read it). Warp 1
  waits until the consumers have put this step's dQ tile in shared memory and adds it into the
  float32 dQ accumulator in global memory with one bulk reduce-add (``cp.reduce.async.bulk
  .add.f32``, a single instruction for the whole tile), off the consumers' path.
- Two consumer warpgroups (240 registers), 64 keys each, dK and dV in registers. Each runs its
  own copy of the loop (a ``T.macro`` called under an ``if`` on the warpgroup), so every
  shared-memory offset in its WGMMA descriptors is a constant, not a register. Every score
  tile is transposed (rows are keys): one step is the chain

      issue Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (asynchronous WGMMA, back to back)
      wait_wgmma(1)    Sᵀ is ready:  Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e)  (dPᵀ still running)
      wait_wgmma(0)    dSᵀ = Pᵀ ∘ (dPᵀ − delta); Pᵀ, dSᵀ to 16 bits; dSᵀ to shared memory
      issue dV += Pᵀ dO            (Pᵀ straight from registers)
      fence + named barrier        both warpgroups' halves of dSᵀ are in shared memory
      issue dK += dSᵀ Q            (dSᵀ from registers)
      wait_wgmma(1)    dV is done: release the dO buffer
      wait_wgmma(0)    dK is done: release the Q buffer
      on warpgroup i % 2 at step i (its turn at dQ):
        issue dQ = dS K            (dSᵀ from shared memory: dQ sums over all 128 keys)
        wait_wgmma(0)  dQ is done: into shared memory for the producer's reduce-add

  so the exponentials may run under the dPᵀ GEMM (ptxas in fact moves that wait up to the first of
  them; the other warpgroup's GEMMs keep the tensor cores busy meanwhile), and one warpgroup's
  dQ GEMM runs beside the other's next Sᵀ and dPᵀ. Where some step needs a mask (the causal
  diagonal, a window's edges, keys past Sk), every step applies it, as a select on each exponent
  (at D = 128 a window's two edges as one unsigned compare, which nvcc keeps branch-free): a
  uniform branch choosing per step between a masked and a plain loop costs more than the selects
  it saves (packed sequences at D = 64 keep that branch: the selects on every step would spill).

  The step is bound by shared-memory bandwidth (its GEMMs read about 256 KB of operands from it
  at D = 128), so a step's dQ is one GEMM by one warpgroup, the two taking turns: a WGMMA
  instruction covers 64 rows of its output and the whole width, reading its B operand once for
  them, so with the tile's larger side as that width the GEMM reads dSᵀ and K once each
  (``dq_form``: dQ [64 queries, 128] at D = 128, dQᵀ [64, 128 queries] at D = 64), 16 KB a step
  less than two warpgroups each computing half of the tile. Its float32 accumulator (64
  registers a thread) does not fit beside dK, dV and the 16-bit Pᵀ and dSᵀ, so dV and dK retire
  first, which also leaves no GEMM in flight where the turn branches (ptxas serialises every
  WGMMA of a kernel where one is). The loop takes two steps a turn, so that each copy of the
  step knows its role at compile time (packed sequences, whose step count is a run-time value,
  guard the second; at D = 64 they branch on the step, as two copies a turn spill on a causal
  walk of one head; so does a dense causal walk over several heads at D = 64, where the branch
  measured faster, and a dense walk of at most three steps at D = 128, where the two copies and
  the odd last step, inlined in a row, spill). The dQ tile is the kernel's heaviest shared-memory
  traffic, so it is stored in the order the threads hold it (``accumulator_index``): every thread
  writes 16 bytes at a time and consecutive threads write consecutive addresses, which keeps the
  stores free of bank conflicts and makes the tile one contiguous block for the bulk reduce-add;
  the float32 accumulator keeps that order, one block per query block. dSᵀ is double-buffered in
  shared memory, so the one barrier per step is enough: a warpgroup writes buffer ``i % 2`` at
  step ``i`` only after both passed step ``i − 1``'s barrier, that is, after step ``i − 2``'s dQ
  GEMM, the last reader of that buffer, is done. After the last step, dK and dV go out through K's
  and V's shared-memory buffers, so that they are written as 16-byte row vectors (straight from
  registers they would fill half of each 32-byte sector).
- A separate small kernel before (``flash_bwd_prep``) computes ``delta`` and ``lse`` in log2
  units, padded to whole query blocks (padding: ``delta`` 0, ``lse`` +inf, so padded queries
  get P = 0 without a mask, and every TMA box starts 16-byte aligned), and zeroes the float32
  dQ tiles the reduce-adds land in (a separate fill would be one more launch); one after
  (``flash_bwd_post``) puts the float32 dQ tiles back in order, scales them and converts them to
  the input dtype. Where some key blocks' query blocks tile all of them without overlap (a short
  sequence: key block 0 reaches every query block; a window: every p-th key block), the zeroing
  is not needed: those key blocks run first, in a launch of their own, and *store* their tiles;
  the others then add (``store_stride``, ``flash_bwd``'s ``key_stride``). A sliding window
  (bounded on both sides) needs neither the zeroing nor a second launch: the lowest key block
  walking each dQ tile stores it and raises a ready flag, and the others wait for that flag
  before they add (``flash_bwd``'s ``ordered_store``). Every key block walks its query blocks
  last to first, so the tiles it stores (no lower key block reaches them) come before the
  ones it adds into, and it only ever waits for lower key blocks, which the GPU starts no later
  than itself: the wait always ends. At D = 128 the window's top key blocks, whose walks the
  end of the queries cuts short, launch after all the others and fill the grid's last wave
  (``launch_order``). At a window's edges a step's queries may see none of one consumer
  warpgroup's 64 keys; at D = 128 that warpgroup then skips its four GEMMs of the step and, on
  its turn, only computes the step's dQ (``idle_step``), leaving the tensor cores to the other.
- The kernels chain by programmatic dependent launch (``T.pdl_trigger`` / ``T.pdl_sync``,
  CUDA's ``griddepcontrol``), dense or packed: a kernel that calls ``T.pdl_sync`` is launched
  before the one ahead of it on the stream has finished, once every thread block of that one
  has called ``T.pdl_trigger`` (or exited), and its threads wait at ``T.pdl_sync`` until that
  grid has finished and its writes are visible. The backward kernel waits there before its
  first load, the postprocess before it reads the dQ tiles (and the sum of a GQA split's
  dK/dV parts, ``flash_bwd_post_kv``, before it reads them); what comes before the wait (barrier
  setup, the launch itself, the ramp of the next grid onto the SMs that free up) overlaps the
  grid ahead. The arithmetic after the wait is unchanged: dK and dV come out bit for bit the
  same, dQ within the rounding of its reduce-adds' order.

A grid too small to fill the GPU (few kv heads and short sequences: a long walk per thread
block on few SMs) takes 64 keys a thread block at D = 64 (``small_grid``): one consumer
warpgroup (256 threads), which computes every step's dQ. Twice the thread blocks, each step
half as long, end the longest walk sooner.

The GPU starts a grid's thread blocks in the order of their index. Causal, key block 0 walks
every query block and the last key block almost none, so in the plain order (one head's key
blocks, then the next head's) the last heads' longest walks start in the grid's last wave and
run on while the other SMs have nothing left. A causal grid is therefore launched as (heads of
a set, key blocks, sets): key block 0 of a few heads, then key block 1 of each, and so on, about
one wave of thread blocks a set (``interleave``, ``grid_interleave``). A set is kept small so
that the heads it walks at once still share their Q, dO and dQ tiles in L2.

Without a mask every walk is as long as any other, and a grid whose walks do not fill its last
wave leaves SMs idle for a whole walk (16k tokens at D = 128 make 4096 walks: 31 waves of 132
SMs, then 4). Those last walks go in parts over their query blocks instead
(``tail_split_plan``): each part is one more thread block, walking at least eight query blocks;
its dQ adds up like any step's, and its dK and dV go out in float32 for
``flash_bwd_post_tail``, which sums a key block's parts after the postprocess. A last wave
over half the SMs is split only when its walks are long (GQA grids of 1024 walks of 1024
steps): the earlier waves end at staggered times and already fill part of the gap.

Grouped-query attention needs one change, which is why ``flash_bwd`` takes ``groups``: a thread
block takes a key block of a kv head and walks the query blocks of each of the group's query
heads in turn (the producer loads that head's Q and dO, the reduce-add goes to that head's dQ),
so the group's dK and dV are summed in registers. example_gqa_bwd.py runs it that way. On a
grid too small to fill the GPU the group's heads are shared out over ``head_splits`` thread
blocks a key block instead (``grid_head_splits``): each writes its part of dK and dV in float32
and the parts are summed after the kernel, which costs less than SMs left idle or a causal
grid's longest walk.

Packed (varlen) batches — ``[total, H, D]`` tensors with ``cu_seqlens`` — need no second
schedule either: with ``layout="thd"`` the three kernels read each sequence's offsets and lengths
at run time (a thread block past its sequence's keys leaves at once), and lse, delta and the
dQ accumulator are cut into per-sequence tiles of ``block_N`` rows (sequence b's from tile
``cu_seqlens_q[b] // block_N + b``, ``tile_start``), padded like the dense rows, so a query box
that runs into the next sequence needs no mask and its dQ rows add zeros into this sequence's
own tile. The grid takes the sequences heaviest first (``sequence_order``): a long sequence
whose key blocks started last would run on alone at the end. example_gqa_bwd_tma_reduce_varlen.py
runs it that way.

A window of a few key blocks needs little of the kernel's dQ half and pays most for its float32
accumulator: example_gqa_sink_bwd_bhsd.py computes dQ for such windows in a query-major pass of
its own and runs this kernel with ``with_dq=False`` (dK and dV only; ``flash_bwd`` says what it
drops).

TileLang needs three things to let the kernel own the schedule: ``TL_DISABLE_WARP_SPECIALIZED``
(no automatic producer/consumer split), ``TL_DISABLE_THREAD_STORAGE_SYNC`` (no barriers
inserted behind the kernel's back: it synchronises with mbarriers and one named barrier), and
``T.wgmma_gemm`` / ``T.wait_wgmma(n)`` (issue a GEMM without waiting; wait until at most ``n``
issued GEMMs are still running — they retire in order).

The forward pass of ``attention`` is the persistent, warp-specialized forward of
example_mha_fwd_bshd.py, imported from beside this file (a sibling script, as bert_padding.py is
for the varlen scripts), so a training step runs the fast forward and the fast backward.

Head dims 64 and 128; fp16 and bf16; any Sq, Sk (an empty sequence launches nothing); causal
aligned bottom-right (query ``i`` sees key ``j`` when ``j <= i + Sk − Sq``; rows that see no key
get ``O = 0`` and ``dQ = 0``).

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None, config=None)

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device; headdim 64 or 128.
    k, v: (batch, seqlen_k, nheads, headdim), same dtype and device.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    config: dict. Backward tile configuration (block_M, block_N, num_stages, dq_stages);
        default ``default_config``.
    Returns out: (batch, seqlen_q, nheads, headdim), differentiable
        (``torch.autograd``): its backward runs the backward kernels above.

In compiled code, ``attention`` calls the custom operator
``tl_attn::mha_bwd_wgmma_pipelined_forward`` (``torch.library``), whose autograd formula calls
``tl_attn::mha_bwd_wgmma_pipelined_backward``, so ``torch.compile(model, fullgraph=True)``
compiles a training step around it without a graph break.
An eager call runs the same formula through ``EagerAttention`` (a plain
``torch.autograd.Function`` over the same functions), without the operators' dispatch.

Run:
    python examples/flash_attention/example_mha_bwd_wgmma_pipelined.py --causal
    python examples/flash_attention/example_mha_bwd_wgmma_pipelined.py --tune
    python examples/flash_attention/example_mha_bwd_wgmma_pipelined.py --compile-only  # no GPU
"""

import functools
import math
import numbers
import pathlib
import sys
import typing

import tilelang
import tilelang.language as T
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import example_mha_fwd_bshd as fwd  # noqa: E402  (the sibling forward script)

LOG2E = 1.4426950408889634
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
NO_UNROLL = {"pragma_unroll_factor": 1}  # a loop nvcc must not unroll
# The backward kernel splits producer and consumers and synchronises them itself.
BWD_PASS_CONFIGS = {
    **PASS_CONFIGS,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
}
HEAD_DIMS = (64, 128)
# Registers a thread after set_max_nreg. It only moves registers between the warpgroups inside
# the thread block's launch allocation (168 a thread for 384 threads), so the consumers' rise
# must be paid for by the producer's drop: 128·24 + 256·240 = 384·168. Ask for more and the
# consumers wait for registers that never come. (With one consumer warpgroup, block_M = 64, the
# launch allocation is 240 a thread for 256 threads.)
PRODUCER_REGS = 24
CONSUMER_REGS = 240
# Named barriers (ids below 8 are left to TileLang's own passes): the two consumer warpgroups
# together, then one per warpgroup for its epilogue.
DS_READY = 8
EPILOGUE = 9


def accumulator_index(r, c):
    """Where element (r, c) of a 64-row WGMMA accumulator tile goes when its threads store it
    in the order they hold it. Thread t of the warpgroup (warp t // 32, lane t % 32) holds rows
    16·warp + lane // 4 and that + 8, columns 8·g + 2·(lane % 4) and that + 1, for every group g
    of 8 columns: four floats per group, stored as one 16-byte vector at (g·128 + t)·4."""
    thread = (r // 16) * 32 + (r % 8) * 4 + (c % 8) // 2
    return ((c // 8) * 128 + thread) * 4 + (r % 16) // 8 * 2 + c % 2


def accumulator_coords(at):
    """(r, c) of the element at position ``at``: the inverse of ``accumulator_index``."""
    thread, e = at // 4 % 128, at % 4
    r = thread // 32 * 16 + thread % 32 // 4 + e // 2 * 8
    return r, at // 512 * 8 + thread % 4 * 2 + e % 2


@T.macro
def bulk_reduce_add(dst, src, count):
    """dst[0:count] += src[0:count] (float32, global += shared) with one bulk asynchronous
    reduce-add. TileLang's ``T.atomic_add(..., use_tma=True)`` splits a tile into boxes of at
    most 256 elements; a contiguous tile needs only this one instruction. The addresses are
    ``T.access_ptr``, not ``T.address_of``: to TileLang 0.1.15 an ``address_of`` is a scalar
    load, whose vector width its storage rewrite takes from the index's stride, and when the
    query block is a compile-time constant (causal Sq > Sk, one query block visible) that
    stride is a head's whole dQ_accum, which can overflow the width ("Can't fetch the lanes of
    a scalable vector"; e.g. D64, Sq 512, Sk 64)."""
    T.call_extern(
        "handle",
        "tl::tma_store_add",
        T.access_ptr(src, "r", count),
        T.access_ptr(dst, "w", count),
        count * 4,
    )


@T.macro
def bulk_store(dst, src, count):
    """dst[0:count] = src[0:count] (float32, global = shared) with one bulk asynchronous copy,
    as ``bulk_reduce_add`` adds."""
    T.call_extern(
        "handle",
        "tl::tma_store",
        T.access_ptr(dst, "w", count),
        T.access_ptr(src, "r", count),
        count * 4,
    )


def dq_form(dim, block_N):
    """The shape in which one consumer warpgroup computes a step's whole dQ tile, as one GEMM
    over all the block's keys: dQ = dS K, ``[block_N, dim]`` (rows are queries), or dQᵀ = Kᵀ dSᵀ,
    ``[dim, block_N]``. A WGMMA instruction covers 64 rows (M) and the whole width (N) of its
    tile, reading its B operand once for all 64 rows; with the larger side as N, the GEMM reads
    dSᵀ and K from shared memory once each (at D = 128: dQ [64, 128], 48 KB a step; two
    warpgroups each computing half of the tile read one of them twice, 64 KB). Returns
    (transposed, rows, cols). The backward and the postprocess both read it from here, so they
    agree on the tile's order."""
    if dim >= block_N and block_N % 64 == 0:
        return False, block_N, dim
    return True, dim, block_N


def seq_index(layout, b, h, s, d):
    """The index of (batch entry b, head h, position s, head-dim d) in a ``[B, S, H, D]``
    (``layout="bshd"``) or ``[B, H, S, D]`` (``"bhsd"``) tensor: the one place the layouts
    differ. example_gqa_sink_bwd_bhsd.py runs these kernels on BHSD tensors. In the packed
    ``[total, H, D]`` layout (``"thd"``, sequences back to back, as
    example_gqa_bwd_tma_reduce_varlen.py runs them) ``b`` is the sequence's first packed row."""
    if layout == "thd":
        s = slice(b + s.start, b + s.stop) if isinstance(s, slice) else b + s
        return (s, h, d)
    return (b, s, h, d) if layout == "bshd" else (b, h, s, d)


def seq_rows(X, layout, b, h, s0, n):
    """Rows ``s0 … s0 + n − 1`` (all of D) of head ``h`` of batch entry ``b`` of ``X``."""
    return X[seq_index(layout, b, h, slice(s0, s0 + n), slice(None))]


def layout_shape(layout, batch, seq, heads, dim):
    """The tensor's shape in ``layout`` (``"thd"``: ``seq`` is the packed token count)."""
    if layout == "thd":
        return [seq, heads, dim]
    return list(seq_index(layout, batch, heads, seq, dim))


def tile_start(q_offset, b, block_N):
    """Packed layout: the first of sequence ``b``'s query tiles (``block_N`` rows each) in the
    backward's per-tile tensors (lse2, Delta, dQ_accum), where ``q_offset`` is its first
    packed row. Sequence b needs ⌈len_b / block_N⌉ tiles, and ``q_offset // block_N + b``
    leaves room for them: the next sequence starts at ``(q_offset + len_b) // block_N + b + 1
    >= q_offset // block_N + len_b // block_N + 1 + b``. So each sequence's blocks are whole
    tiles of their own (a query block never shares a tile with another sequence), and
    ``tile_start(total_q, B, block_N)`` tiles hold them all. Works on Python ints and on
    TileLang expressions alike."""
    return q_offset // block_N + b


def stats_tile(X, layout, b, h, k, n):
    """Query block ``k``'s ``n`` rows of lse2 or Delta: ``X [B, H, S_pad]`` with ``b`` the batch
    entry, or (``"thd"``) ``X [H, tiles, n]`` with ``b`` the sequence's first tile."""
    if layout == "thd":
        return X[h, b + k, :]
    return X[b, h, k * n : (k + 1) * n]


def dq_tile_index(layout, b, h, k):
    """Where query block ``k``'s dQ tile starts in ``dQ_accum``: ``[B, H, blocks, tile]`` with
    ``b`` the batch entry, or (``"thd"``) ``[tiles, H, tile]`` with ``b`` the first tile (tile
    major: the address is then a run-time tile count times a constant, cheap in 64 bits)."""
    return (b + k, h, 0) if layout == "thd" else (b, h, k, 0)


class Rows(typing.NamedTuple):
    """Where a backward thread block's sequence lives, as ``flash_bwd``'s steps index it:
    ``q_row``/``k_row`` the ``b`` of ``seq_index`` for Q and dO / K, V, dK and dV (the batch
    entry; packed: the sequence's first query / key row), ``tile`` the ``b`` of ``stats_tile``
    and ``dq_tile_index`` (the batch entry; packed: the sequence's first tile), ``q_pad`` its
    queries padded to whole query blocks, ``kv_len`` its keys and ``hi``, ``lo`` its window's
    diagonals (``query_block_range``). Dense: Python ints but ``bz``; packed: values known at
    run time only, which flash_bwd_varlen reads from ``cu_seqlens``."""

    q_row: object
    k_row: object
    tile: object
    q_pad: object
    kv_len: object
    hi: object
    lo: object


def query_block_range(bx, block_M, block_N, seq_q_pad, window_edges):
    """(first query block, number of query blocks) that key block ``bx`` walks: those holding a
    query whose window reaches one of its keys. ``window_edges = (left, right, hi, lo)``: query
    i sees key j iff j <= i + hi (when right >= 0) and j >= i + lo (when left >= 0).

    From the block holding query bx·block_M − hi (the first to see the block's first key) to
    the one holding (bx + 1)·block_M − 1 − lo (the last to see its last key). The last query
    sees every key up to Sk − 1 + right, so with no left bound there is at least one; with one,
    a key block no query reaches has none (its dK and dV are 0). Every head of a group walks
    the same range."""
    left, right, hi, lo = window_edges
    q_start = 0
    if right >= 0:
        q_start = T.max(0, bx * block_M - hi) // block_N
    q_end = seq_q_pad // block_N
    n_blocks = q_end - q_start
    if left >= 0:
        last = T.min(q_end - 1, ((bx + 1) * block_M - 1 - lo) // block_N)
        n_blocks = T.max(0, last + 1 - q_start)
    return q_start, n_blocks


# ordered_store's ready flags: raised with release semantics once a stored dQ tile is written
# (the bulk copy runs in the async proxy, the flag in the generic one: fence between them), and
# awaited with acquire semantics before the reduce-add that reads the tile (fence again).
READY_FLAGS_SOURCE = r"""
__device__ __forceinline__ void dq_store_or_add(int store, float* dst, float* src, int bytes,
                                                int* flag) {
  unsigned int src_shared = (unsigned int)__cvta_generic_to_shared(src);
  if (store) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(src_shared), "r"(bytes) : "memory");
  } else {
    int ready = 0;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
    } while (ready == 0);
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src_shared), "r"(bytes) : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void dq_publish(int store, int* flag) {
  if (store) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(flag), "r"(1) : "memory");
  }
}
"""

# The key_stride values the backward splits its key blocks by (store_stride): 1 (one launch that
# stores every tile), or MIN_STORE_STRIDE … MAX_STORE_STRIDE.
MIN_STORE_STRIDE = 8
MAX_STORE_STRIDE = 16


def walked_ranges(seq_q, seq_kv, causal, window, block_M, block_N):
    """(first query block, count) that each key block walks (``query_block_range``), as ints."""
    left, right = window
    if causal:
        right = 0
    offset = seq_kv - seq_q
    edges = (left, right, offset + right, offset - left)
    seq_q_pad = padded_len(seq_q, block_N)
    return [
        [int(x) for x in query_block_range(kb, block_M, block_N, seq_q_pad, edges)]
        for kb in range((seq_kv + block_M - 1) // block_M)
    ]


def ordered_store_pays(seq_q, seq_kv, causal, window, block_M, block_N):
    """Whether the backward takes ``ordered_store``: a window bounded on both sides (causal
    sets the right edge to 0) whose key blocks walk every query block. Measured on an H100
    (2026-11-23, bf16, H64/Hkv8 D64 and H32/Hkv8 D128 at S8192, graph replays, one process):
    1.05-1.27x the zeroed single launch at windows (128, 0), (256, 0), (512, 0) and (64, 64),
    and 1.07x (D128) / 1.18x (D64) the two launches of ``store_stride`` (p = 9) at (1024, 0).
    Without a left edge every key block reaches the first query blocks, whose lowest walker is
    key block 0: all would wait for it at the same tiles, as a trial of that (first come
    stores, the others wait; ``default_config``'s notes) measured, 20% slower. A right edge of
    -1 alone was not measured; it keeps ``store_stride``'s forms. A one-launch stride (p = 1:
    no tile has two walkers) stays with the plain store, which needs no flags. Having each
    tile's highest walker write dQ itself once the others' writes have landed, so that no
    postprocess runs, lost in four forms (2026-11-23, benchmarks/results/bwd_dq_in_kernel.md):
    0.87-0.97x at windows (128, 0) and (64, 64) with the best form, 0.86-0.93x at (1024, 0)
    with D = 128, level at (512, 0) and (1024, 0) with D = 64."""
    left, right = window
    if causal:
        right = 0
    return (
        left >= 0
        and right >= 0
        and every_block_walked(seq_q, seq_kv, causal, tuple(window), block_M, block_N)
    )


def longest_walks(seq_q, seq_kv, causal, window, block_M, block_N):
    """``launch_order``'s ``n_long``: the count of key blocks up to the last one that walks the
    most query blocks."""
    counts = [n for _, n in walked_ranges(seq_q, seq_kv, causal, window, block_M, block_N)]
    return max(kb for kb, n in enumerate(counts) if n == max(counts)) + 1


def launch_order(i, n_long, n_rows):
    """``ordered_store``'s grid at D = 128: (key block, row) of thread block ``i`` of a
    one-dimensional grid, a row being a (kv head, batch entry). Key blocks 0 … n_long − 1 of
    each row come row by row, as in the plain grid (the blocks of a row share their Q, dO and
    dQ tiles in L2); the key blocks after them, whose walks the end of the queries cuts short
    (``longest_walks``), come last, key block by key block, and fill the grid's last wave
    instead of leaving SMs idle in it. A key block still starts after the lower ones of its
    row, the only ones it may wait for.

    Measured on an H100 (2026-11-27, bf16, H32/Hkv8 unless stated, the backward as the sink
    backward runs it, ``run_backward``; seven interleaved rounds a process), against the plain
    grid: window (1024, 0) D128 B2 S8192 1.011 and 1.019x (two processes), B4 S4096 1.040,
    1.055 and 1.062x (three); (256, 256) D128 B2 S8192 0.989x (one). At D = 64 the same order
    lost (window (1024, 0) B2 S8192 0.82-0.85x, (512, 0) B1 H64/Hkv8 S8192 0.80x), while a
    one-dimensional grid in the plain order (its indices a shift and a mask) measured level
    (1.00x). In that build nvcc turns the D = 64 window mask's selects into branches around
    each exp2 (SASS: no FSEL left of 128, 192 BRA against 76), as it did with two selects at
    D = 128 (``window_compare``); D = 64 keeps the plain grid. Two branch-free D = 64 builds of
    the order, timed later (same rows), did not win either: the unsigned compare at D = 64 too,
    1.00x at (1024, 0) and 0.97x at (512, 0); the order written without selects, 0.98x and
    0.94x (at D = 128 0.98-1.02x, level). The key blocks of every row in
    turn (a grid with the key block slowest: the same last wave, no index arithmetic) lost at
    both: D128 0.92-0.97x, (256, 256) 0.91x, D64 0.98-0.99x. The indices held in shared memory,
    or in variables, made ptxas spill (4 and 8 bytes at D = 128), so those forms were not
    timed."""
    n_first = n_long * n_rows
    tail = i - n_first
    key = T.Select(i < n_first, i % n_long, n_long + tail // n_rows)
    return key, T.Select(i < n_first, i // n_long, tail % n_rows)


@functools.lru_cache(maxsize=1024)
def every_block_walked(seq_q, seq_kv, causal, window, block_M, block_N):
    """Whether every query block is walked by some key block, so that ``ordered_store`` (whose
    lowest walker stores each tile) leaves none unwritten. A query block no key block walks
    holds only rows that see no key; the prep would have to zero it."""
    walked = set()
    for start, n in walked_ranges(seq_q, seq_kv, causal, window, block_M, block_N):
        walked.update(range(start, start + n))
    return len(walked) == padded_len(seq_q, block_N) // block_N


@functools.lru_cache(maxsize=1024)
def store_stride(seq_q, seq_kv, causal, window, block_M, block_N):
    """The smallest p for which key blocks 0, p, 2p, … walk query blocks that do not overlap and
    together cover every query block, or None. Then ``flash_bwd`` runs in two launches — those
    key blocks store their dQ tiles, the others add to them — and the prep need not zero the
    accumulator; with p = 1 one launch stores every tile. A window of 1024 keys has one (p = 9
    at D = 128), and so has a short sequence (key block 0 reaches every query block: p = the key
    block count). Query blocks that no key reaches (causal, Sq > Sk) rule it out: nothing would
    store them.

    Measured on an H100 (2026-11-23, bf16, the backward as graph replays, one process, against
    one launch after the zeroing prep): p = 9, window 1024, B2 H32/Hkv8 S8192 D128: 1.964
    against 2.107 ms (+7%); p = 8 and 16, dense at 16k tokens, S1024 (D128 and D64) and S2048
    (D128), causal or not: +1-8%. p = 2, window 128 (B1 H64/Hkv8 S4096 and S8192 D64, S8192
    D128), lost 4-8% (0.210 against 0.195 ms at S4096): the even and the odd key blocks, which
    read the same query blocks, no longer run together, and each launch has its own ramp and
    tail. Hence p = 1 or ``MIN_STORE_STRIDE`` … ``MAX_STORE_STRIDE``; strides between 3 and 7
    were not measured, and neither were strides above 16 (S >= 4096 without a window). A window
    bounded on both sides takes ``ordered_store`` instead where p > 1 (``ordered_store_pays``):
    at window 1024 it measured faster than p = 9."""
    ranges = walked_ranges(seq_q, seq_kv, causal, window, block_M, block_N)
    n_key_blocks = len(ranges)
    seq_q_pad = padded_len(seq_q, block_N)
    for p in [1, *range(MIN_STORE_STRIDE, min(n_key_blocks, MAX_STORE_STRIDE) + 1)]:
        covered = 0  # query blocks 0 … covered − 1 are stored once each, so far
        for start, n in ranges[::p]:
            if n and start != covered:
                break
            covered += n
        else:
            if covered == seq_q_pad // block_N:
                return p
    return None


def first_stored_block(bx, block_M, block_N, seq_q_pad, window_edges):
    """``ordered_store``: the first query block that key block ``bx`` stores rather than adds
    into. The blocks it walks below that one are walked by key block bx − 1 too (a key block's
    range only moves up with bx), so a lower key block stores them; key block 0 stores all."""
    q_start, _ = query_block_range(bx, block_M, block_N, seq_q_pad, window_edges)
    prev_start, prev_n = query_block_range(bx - 1, block_M, block_N, seq_q_pad, window_edges)
    return T.if_then_else(bx == 0, q_start, T.max(q_start, prev_start + prev_n))


def padded_len(seq_q, block_N):
    """Length of the padded ``lse``/``delta`` rows: whole query blocks."""
    return (seq_q + block_N - 1) // block_N * block_N


# ----------------------------------------------------------------------------- backward kernels
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flash_bwd_prep(
    batch, heads, seq_q, seq_q_pad, dim, dtype="float16", block=64, layout="bshd", zero_dq=True
):
    """delta = Σ_d O ∘ dO and lse2 = lse · log2 e per query row, padded to ``seq_q_pad`` rows
    (padding: delta 0, lse2 +inf); and the float32 dQ accumulator set to zero (the backward only
    adds into it), one slice of ``block · dim`` floats per thread block, so no separate fill
    kernel runs. ``zero_dq=False``: not zeroed, for a backward whose first launch stores every
    tile (``store_stride``).

    ``layout="thd"``: packed sequences (``batch``, ``seq_q``, ``seq_q_pad`` are None: the sizes
    are dynamic), one thread block per query tile of ``block`` (the backward's ``block_N``)
    rows, written at the sequence's tiles (``tile_start``), each padded like the dense rows;
    ``lse`` is the forward's ``[H, total_q]`` (FlashAttention's packed layout)."""
    accum_dtype = "float32"
    if layout == "thd":
        return _flash_bwd_prep_packed(heads, dim, dtype, block)
    shape = layout_shape(layout, batch, seq_q, heads, dim)

    @T.prim_func
    def flash_bwd_prep(
        Output: T.Tensor(shape, dtype),
        dO: T.Tensor(shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        Delta: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
        lse2: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
        dQ_accum: T.Tensor([batch, heads, seq_q_pad * dim], accum_dtype),  # flat per head
    ):
        with T.Kernel(T.ceildiv(seq_q_pad, block), heads, batch, threads=128) as (bx, by, bz):
            T.pdl_trigger()  # the backward kernel may launch now (it waits for this grid's end)
            if zero_dq:
                for t in T.Parallel(block * dim):
                    dQ_accum[bz, by, bx * block * dim + t] = 0
            out_frag = T.alloc_fragment([block, dim], dtype)
            dout_frag = T.alloc_fragment([block, dim], dtype)
            prod = T.alloc_fragment([block, dim], accum_dtype)
            delta = T.alloc_fragment([block], accum_dtype)
            T.copy(seq_rows(Output, layout, bz, by, bx * block, block), out_frag)
            T.copy(seq_rows(dO, layout, bz, by, bx * block, block), dout_frag)
            for i, j in T.Parallel(block, dim):
                prod[i, j] = T.cast(out_frag[i, j], accum_dtype) * T.cast(
                    dout_frag[i, j], accum_dtype
                )
            T.reduce_sum(prod, delta, dim=1)
            for i in T.Parallel(block):
                row = bx * block + i
                if row < seq_q:
                    Delta[bz, by, row] = delta[i]
                    lse2[bz, by, row] = lse[bz, by, row] * LOG2E
                else:
                    Delta[bz, by, row] = 0
                    lse2[bz, by, row] = T.infinity(accum_dtype)

    return flash_bwd_prep


def _flash_bwd_prep_packed(heads, dim, dtype, block):
    """flash_bwd_prep's ``"thd"`` kernel (see there)."""
    accum_dtype = "float32"
    total_q, batch, n_tiles, lse_len = T.dynamic("total_q, batch, n_tiles, lse_len")

    @T.prim_func
    def flash_bwd_prep(
        Output: T.Tensor([total_q, heads, dim], dtype),
        dO: T.Tensor([total_q, heads, dim], dtype),
        lse: T.Tensor([heads, lse_len], accum_dtype),
        cu_seqlens_q: T.Tensor([batch + 1], "int32"),
        max_seqlen_q: T.int32,
        Delta: T.Tensor([heads, n_tiles, block], accum_dtype),
        lse2: T.Tensor([heads, n_tiles, block], accum_dtype),
        dQ_accum: T.Tensor([n_tiles, heads, block * dim], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(max_seqlen_q, block), heads, batch, threads=128) as (bx, by, bz):
            T.pdl_trigger()  # as the dense prep: the backward kernel may launch now
            out_frag = T.alloc_fragment([block, dim], dtype)
            dout_frag = T.alloc_fragment([block, dim], dtype)
            prod = T.alloc_fragment([block, dim], accum_dtype)
            delta = T.alloc_fragment([block], accum_dtype)
            q_offset = cu_seqlens_q[bz]  # first packed row of this sequence's queries
            seq_len_q = cu_seqlens_q[bz + 1] - q_offset
            if bx * block < seq_len_q:  # blocks past the sequence's end have no tile
                # Rows past the sequence's end are the next sequence's: computed, not stored.
                T.copy(
                    Output[q_offset + bx * block : q_offset + bx * block + block, by, :], out_frag
                )
                T.copy(dO[q_offset + bx * block : q_offset + bx * block + block, by, :], dout_frag)
                for i, j in T.Parallel(block, dim):
                    prod[i, j] = T.cast(out_frag[i, j], accum_dtype) * T.cast(
                        dout_frag[i, j], accum_dtype
                    )
                T.reduce_sum(prod, delta, dim=1)
                tile = tile_start(q_offset, bz, block) + bx
                for t in T.Parallel(block * dim):
                    dQ_accum[tile, by, t] = 0
                for i in T.Parallel(block):
                    row = bx * block + i
                    if row < seq_len_q:
                        Delta[by, tile, i] = delta[i]
                        lse2[by, tile, i] = lse[by, q_offset + row] * LOG2E
                    else:
                        Delta[by, tile, i] = 0
                        lse2[by, tile, i] = T.infinity(accum_dtype)

    return flash_bwd_prep


@tilelang.jit(pass_configs=BWD_PASS_CONFIGS)
def flash_bwd(
    batch,
    heads,
    seq_q,
    seq_kv,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=64,
    num_stages=2,
    dq_stages=1,
    groups=1,
    window=(-1, -1),
    layout="bshd",
    key_stride=1,
    first_store=False,
    ordered_store=False,
    head_splits=1,
    with_dq=True,
    ctas_per_sm=1,
    interleave=1,
    tail_splits=1,
    num_sms=132,
):
    """One thread block per (block_M keys, kv head, batch); the schedule of the module docstring.

    ``groups`` query heads share each kv head (grouped-query attention; 1 is multi-head): the
    thread block walks the query blocks of every head of its group in turn, so the group's dK
    and dV add up in its registers, with no atomics and no partial sums to combine afterwards.

    ``window = (left, right)``, -1 unbounded (``causal`` is right = 0): query i sees key j iff
    i + offset − left <= j <= i + offset + right. A thread block walks only the query blocks
    whose window reaches one of its keys. example_gqa_sink_bwd_bhsd.py uses it (with
    ``layout="bhsd"``: ``[B, H, S, D]`` tensors); a sink needs nothing here, since its lse
    already holds it and dS = P ∘ (dP − delta) is unchanged.

    Score tiles are transposed (rows are keys, columns queries): ``acc_s`` holds Sᵀ then Pᵀ,
    ``acc_dp`` holds dPᵀ then dSᵀ, and ``dq`` a step's dQ tile, in ``dq_form``'s shape.
    dK is scaled by ``softmax_scale`` once at the end; dQ leaves unscaled (the postprocess
    scales it).

    ``layout="thd"``: packed sequences (example_gqa_bwd_tma_reduce_varlen.py), the kernel
    ``flash_bwd_varlen``; ``batch``, ``seq_q`` and ``seq_kv`` are None, since the token counts,
    the batch and the longest sequence are kernel arguments (one build serves every batch).
    One thread block per (key block, kv head, sequence) of a grid sized for ``max_seqlen_k``,
    its sequences in the order of ``seq_order`` (``sequence_order``: heaviest first):
    it reads its sequence's offsets and lengths from ``cu_seqlens_q/k`` and leaves at once when
    its key block lies past the sequence's keys. Otherwise the schedule is the same, at the
    sequence's rows: K, V, Q and dO by TMA at its packed offsets, lse2, Delta and the dQ tiles
    at its own padded tiles (``tile_start``), so a query box that runs into the next sequence
    reads rows whose lse2 is +inf (P = 0, dS = 0: they add exact zeros into this sequence's
    tile) and a key box that does is masked like the keys past Sk of a dense batch. A sequence
    without queries walks no query block and writes dK = dV = 0 for its keys.

    ``key_stride``, ``first_store`` (dense layouts): the key blocks in two launches, so that the
    dQ accumulator needs no zeroing (``store_stride`` says when that works). ``first_store``:
    this launch takes key blocks 0, p, 2p, … (p = ``key_stride``), whose query blocks do not
    overlap and cover every query block, and *stores* each dQ tile (a bulk copy where the
    reduce-add would be); otherwise, with p > 1, it takes the remaining key blocks and adds, after
    the first launch (stream order). With p = 1 and no ``first_store``: every key block, adding.

    ``head_splits`` (dense layouts, a divisor of ``groups``): the group's query heads are
    shared out over that many thread blocks a key block, each walking ``groups // head_splits``
    of them, for grids too small to fill the GPU. Each part's dK and dV leave in float32 to
    ``dK``, ``dV`` of shape ``[head_splits] + [kv shape]``, summed after the kernel.

    ``ordered_store`` (dense layouts, one launch; ``ordered_store_pays`` says when): the kernel
    takes one more argument, ``Ready``, int32 ``[B, H, query blocks]``, zeroed. Each key block
    walks every head's query blocks last to first; it stores the tiles from
    ``first_stored_block`` on (no lower key block walks them) and raises their flags once the
    stores have landed, and adds into the others after their flags are up. A key block only
    waits for lower ones, which the GPU dispatches no later (blocks start in the order of their
    linear index), so a chain of waits ends at key block 0, which waits for nothing. At D = 128
    the key blocks whose walks the end of the queries cuts short launch after all the others
    (``launch_order``), still each after the lower ones of its row.

    ``with_dq=False`` (dense layouts, one launch): dK and dV only, a kernel without the dQ
    accumulator argument. A step is four GEMMs (no dSᵀ in shared memory, no named barrier,
    producer warp 1 idle); dQ comes from a query-major pass of its own (the narrow windows of
    example_gqa_sink_bwd_bhsd.py).

    ``ctas_per_sm=2`` (with ``block_M = 64`` and ``with_dq=False``): two thread blocks share an
    SM, each with 232 registers a consumer thread, so that one's loads and epilogue can run
    beside the other's GEMMs on the short walks of a narrow window.

    ``interleave`` (dense layouts, not ``ordered_store``; a divisor of the grid's rows, a row
    being one kv head (or head split) of one batch entry): the grid takes that many
    rows at a time, key block 0 of each, then key block 1 of each, …, instead of one row's key
    blocks after the other's. The GPU starts thread blocks in the order of their index; where
    key block 0 walks longest (causal), the last row's longest walks would otherwise start in
    the grid's last wave and run on alone.

    ``tail_splits`` (the plain dense launch without causal or window, ``tail_split_plan``): the
    thread blocks of a last wave that would leave SMs idle (``num_sms``) walk their query blocks
    in that many parts, one thread block a part, each leaving its dK and dV in float32 to the two
    more arguments ``dK_part``, ``dV_part`` (``[parts, block_M, dim]``), which
    ``flash_bwd_post_tail`` sums; dQ adds up as in any step.
    """
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # scores to log2 units, as lse2
    packed = layout == "thd"
    left, right = window
    if causal:
        right = 0
    heads_kv = heads // groups
    # Windows bounded on the left leave a warpgroup idle on some steps (``idle_step``). With
    # D = 64 the second path makes ptxas spill at ragged shapes (44-180 bytes at Sq 1000,
    # Sk 1300), so there every step runs in full, as without a window. At D = 128 it makes
    # some windowed walks of 4-8 steps spill (8-72 bytes) and still wins there
    # (benchmarks/results/bwd_idle_warpgroup.md).
    skip_idle = left >= 0 and dim >= 128
    if not with_dq and (packed or key_stride != 1 or first_store or ordered_store):
        raise ValueError("with_dq=False is for one launch over the dense layouts")
    if packed and (key_stride != 1 or first_store or ordered_store):
        raise ValueError("key_stride, first_store and ordered_store are for the dense layouts")
    plain_launch = not packed and with_dq and not ordered_store
    if interleave < 1 or (interleave > 1 and not plain_launch):
        raise ValueError(f"interleave ({interleave}) must be 1 except for the plain dense launches")
    if head_splits > 1 and (packed or groups % head_splits):
        raise ValueError(f"head_splits ({head_splits}) must divide groups ({groups}), dense only")
    if block_M not in (64, 128) or (block_M == 64 and dim > 64):
        # 64 keys (one consumer warpgroup) are the small grids' tile at D = 64 (``small_grid``);
        # at D = 128 they were tried only with dQ split between two warpgroups' registers, where
        # one warpgroup holding all of it made ptxas serialize its WGMMAs.
        raise ValueError(f"block_M must be 128, or 64 at D = 64; got {block_M} at D = {dim}")
    if not packed:
        offset = seq_kv - seq_q  # bottom-right causal alignment
        # Query i sees key j iff j <= i + hi (right >= 0) and j >= i + lo (left >= 0).
        hi, lo = offset + right, offset - left
        seq_q_pad = padded_len(seq_q, block_N)
        q_shape = layout_shape(layout, batch, seq_q, heads, dim)
        kv_shape = layout_shape(layout, batch, seq_kv, heads_kv, dim)
    if ctas_per_sm not in (1, 2) or (ctas_per_sm == 2 and (block_M != 64 or with_dq)):
        raise ValueError(
            f"ctas_per_sm must be 1, or 2 with block_M = 64 and with_dq=False; got {ctas_per_sm}"
        )
    wg_keys = 64  # keys per consumer warpgroup: the M of its WGMMAs
    consumers = block_M // wg_keys * 128
    threads = consumers + 128  # and one producer warpgroup
    # Two thread blocks an SM split the register file: each one's consumers take what its
    # producer gives up of half of it (232 registers for one consumer warpgroup).
    consumer_regs = CONSUMER_REGS
    if ctas_per_sm > 1:
        consumer_regs = (65536 // ctas_per_sm - 128 * PRODUCER_REGS) // consumers // 8 * 8
    dq_transposed, dq_rows, dq_cols = dq_form(dim, block_N)
    dq_tile = dim * block_N  # floats of one step's dQ tile

    # head_splits: the group's query heads are shared out over that many thread blocks a key
    # block, each walking ``walked`` of them (grid row ``by`` = kv head · head_splits + part).
    walked = groups // head_splits

    def step_count(n_blocks):
        """Steps of a thread block: ``n_blocks`` query blocks for each head it walks."""
        return n_blocks if walked == 1 else walked * n_blocks

    def key_block(bx):
        """The key block of thread block ``bx`` (``key_stride``, ``first_store``)."""
        if first_store:
            return bx * key_stride
        if key_stride == 1:
            return bx
        return bx // (key_stride - 1) * key_stride + 1 + bx % (key_stride - 1)

    most_steps = None  # the most steps a thread block walks (packed: known at run time only)
    even_walks = False  # every launched key block walks an even number of query blocks
    if not packed:
        n_key_blocks = (seq_kv + block_M - 1) // block_M
        n_stored = (n_key_blocks + key_stride - 1) // key_stride  # key blocks 0, p, 2p, …
        grid_x = n_stored if first_store or key_stride == 1 else n_key_blocks - n_stored
        ranges = walked_ranges(seq_q, seq_kv, causal, window, block_M, block_N)
        launched = list(range(n_key_blocks) if ordered_store else map(key_block, range(grid_x)))
        most_steps = step_count(max((ranges[kb][1] for kb in launched), default=0))
        even_walks = all(ranges[kb][1] % 2 == 0 for kb in launched)
    # A dense walk over several heads, in the producer's two warps: heads, then query blocks, as
    # two loops, so that no step divides by the walk's length to find its head and block. The
    # blocks' loop stays rolled (unrolled by nvcc, it grew the producer's code fourfold), and
    # so does warp 0's loop over the heads; warp 1's, rolled, made ptxas spill 8 bytes (B1
    # H16/Hkv4 S1024 causal). Not with a tail split, whose parts' walks then spilled 8 bytes.
    nest_heads = not packed and walked > 1 and not ordered_store and tail_splits == 1
    most_blocks = most_steps // walked if nest_heads else None

    def may_run(count, most):
        """The test a loop over the steps sits under where its count may be 0 and is at most 1
        (``most``: its largest value in this launch): there TileLang 0.1.15 runs the loop once
        anyway (its simplifier reads the loop's own ``i < count`` as count >= 1), e.g. the
        two-steps loop of a causal grid of three query blocks. Elsewhere the test is left out:
        kept by the compiler, it made ptxas spill on two builds (a wide tail at D = 128, a
        window's dK/dV launch at D = 64)."""
        return count > 0 if most is not None and most <= 1 else True

    def step_coords(by, q_start, n_blocks, i):
        """(query head, query block) of step ``i``: the walked heads one after the other.
        ``ordered_store``: each head's query blocks last to first, so that the tiles this key
        block stores (the highest of its range) come before the ones it adds into."""
        if ordered_store:
            n = T.max(n_blocks, 1)
            return by * walked + i // n, q_start + n_blocks - 1 - i % n
        if walked == 1:
            return by, q_start + i
        # No step runs when n_blocks is 0, but TVM may fold the division where it is in the
        # second launch of a window's key blocks (key_stride): there, divide by at least 1.
        n = T.max(n_blocks, 1) if key_stride > 1 else n_blocks
        return by * walked + i // n, q_start + i % n

    # The loop's compute steps, named. T.macro is inlined: the generated CUDA is the same as
    # with the steps written out. Each GEMM step (scores, dp, dv_update, dq_gemm, dk_update)
    # issues one asynchronous WGMMA and returns at once; the waits that retire them, and the
    # barriers that hand buffers back and forth, stay in the loop where their order is read.
    @T.macro
    def scores(r0, stage, K_shared, Q_shared, acc_s):
        # Sᵀ = K Qᵀ for this warpgroup's keys.
        T.wgmma_gemm(
            K_shared[r0 : r0 + wg_keys, :],
            Q_shared[stage, :, :],
            acc_s,
            transpose_B=True,
            clear_accum=True,
        )

    @T.macro
    def dp(r0, stage, V_shared, dO_shared, acc_dp):
        # dPᵀ = V dOᵀ for this warpgroup's keys.
        T.wgmma_gemm(
            V_shared[r0 : r0 + wg_keys, :],
            dO_shared[stage, :, :],
            acc_dp,
            transpose_B=True,
            clear_accum=True,
        )

    # Keys past Sk (the last key block; packed: the next sequence's) and keys outside the
    # query's window are masked; queries past Sq have lse2 = +inf (P = 0) and need no mask.
    # Where any step may need the mask, every step applies it (``probabilities``): dense
    # grids with a diagonal, a window or Sk not a multiple of block_M, and packed sequences
    # (whose lengths are known only at run time) at D = 128. Packed at D = 64, each step
    # decides: the selects on every step make ptxas spill there, beside the sequence's offsets.
    if packed:
        mask_every_step = dim >= 128
    else:
        mask_every_step = right >= 0 or left >= 0 or seq_kv % block_M != 0
    # A window bounded on both sides, at D = 128: its two edges as one unsigned compare (two
    # selects there measured 8% slower: nvcc branched around each exp2). D = 64 keeps the two
    # selects, which compile branch-free there and measured faster than the compare.
    window_compare = left >= 0 and right >= 0 and dim >= 128
    # The dense loop takes two steps a turn of the warpgroups at dQ, so that each copy of the
    # step knows its role at compile time; at D = 64 under the diagonal, a walk over several
    # heads branches on the step instead: faster there, slower on every other long dense walk
    # (benchmarks/results/bwd_schedule_trials.md). So does a walk of at most three steps at
    # D = 128: there the two-steps loop runs at most once, and ptxas, given its two copies of
    # the step and the odd last one in a row, spilled 140-248 bytes (causal: WGMMAs serialized).
    branch_turns = not packed and (
        (dim <= 64 and right >= 0 and left < 0 and walked > 1) or (dim > 64 and most_steps <= 3)
    )

    @T.macro
    def probabilities(wg, k, bx, stage, acc_s, lse_shared, seq):
        # Pᵀ = exp2(Sᵀ·scale − lse2), masked where the step's keys meet Sk, the diagonal or
        # the window. A uniform branch choosing per step measured slower on dense causal rows
        # than the selects on every step (benchmarks/results/bwd_mask_every_step.md).
        first_key = bx * block_M + wg * wg_keys
        masked = mask_every_step
        if packed and not mask_every_step:
            masked = first_key + wg_keys > seq.kv_len
            if right >= 0:
                masked = masked or k * block_N + seq.hi < first_key + wg_keys - 1
            if left >= 0:
                masked = masked or first_key < k * block_N + block_N - 1 + seq.lo
        if masked:
            for i, j in T.Parallel(wg_keys, block_N):
                key = first_key + i
                # Selects on the exponent, one per bound, not on exp2's result and not
                # joined by `and` (C's short-circuit `&&`): written so, the compiler keeps the
                # loop branch-free, and branches here make ptxas serialize the WGMMA still
                # running (dPᵀ) with this loop. With the window's right edge at the diagonal
                # (causal), that edge is below Sk for every query before Sq, so it alone
                # bounds the keys.
                logit = acc_s[i, j] * scale - lse_shared[stage, j]
                if right != 0:
                    logit = T.if_then_else(key < seq.kv_len, logit, -T.infinity(accum_dtype))
                first_seen = k * block_N + j + seq.lo
                if window_compare:
                    # first_seen <= key <= first_seen + left + right, as one compare.
                    offset = T.reinterpret(key - first_seen, "uint32")
                    inside = offset <= T.Cast("uint32", left + right)
                    logit = T.if_then_else(inside, logit, -T.infinity(accum_dtype))
                else:
                    if right >= 0:
                        last_seen = k * block_N + j + seq.hi
                        logit = T.if_then_else(key <= last_seen, logit, -T.infinity(accum_dtype))
                    if left >= 0:
                        logit = T.if_then_else(key >= first_seen, logit, -T.infinity(accum_dtype))
                acc_s[i, j] = T.exp2(logit)
        else:
            for i, j in T.Parallel(wg_keys, block_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale - lse_shared[stage, j])

    @T.macro
    def ds(r0, stage, ds_buf, acc_s, acc_dp, delta_shared, acc_s_cast, ds_cast, ds_shared):
        # dSᵀ = Pᵀ ∘ (dPᵀ − delta), in place of dPᵀ; Pᵀ and dSᵀ to 16 bits (the operands of
        # dv_update and dk_update); dSᵀ to shared memory for dq_gemm.
        for r, c in T.Parallel(wg_keys, block_N):
            acc_dp[r, c] = acc_s[r, c] * (acc_dp[r, c] - delta_shared[stage, c])
        T.copy(acc_s, acc_s_cast)
        T.copy(acc_dp, ds_cast)
        if with_dq:
            T.copy(ds_cast, ds_shared[ds_buf, r0 : r0 + wg_keys, :])

    @T.macro
    def dv_update(stage, acc_s_cast, dO_shared, dv):
        # dV += Pᵀ dO, Pᵀ straight from registers.
        T.wgmma_gemm(acc_s_cast, dO_shared[stage, :, :], dv)

    @T.macro
    def dq_gemm(ds_buf, K_shared, ds_shared, dq):
        # The step's whole dQ tile (``dq_form``), one GEMM over all the block's keys: dSᵀ, both
        # warpgroups' halves of it, and K from shared memory.
        if dq_transposed:  # dQᵀ = Kᵀ dSᵀ
            T.wgmma_gemm(K_shared, ds_shared[ds_buf, :, :], dq, transpose_A=True, clear_accum=True)
        else:  # dQ = dS K
            T.wgmma_gemm(ds_shared[ds_buf, :, :], K_shared, dq, transpose_A=True, clear_accum=True)

    @T.macro
    def dk_update(stage, ds_cast, Q_shared, dk):
        # dK += dSᵀ Q, dSᵀ straight from registers (scaled by softmax_scale once, at the end).
        T.wgmma_gemm(ds_cast, Q_shared[stage, :, :], dk)

    @T.macro
    def dq_store(slot, dq, dq_shared):
        # The dQ tile into dq_shared for producer warp 1's bulk reduce-add, in the order the
        # threads hold it (``accumulator_index``): 16-byte stores, no bank conflicts.
        for r, c in T.Parallel(dq_rows, dq_cols):
            dq_shared[slot, accumulator_index(r, c)] = dq[r, c]

    @T.macro
    def dq_step(i, ds_buf, K_shared, ds_shared, dq_shared, dq_full, dq_empty, dq):
        # The step's dQ by this warpgroup: its GEMM, then the tile to shared memory and over to
        # producer warp 1.
        dq_gemm(ds_buf, K_shared, ds_shared, dq)
        T.wait_wgmma(0)
        slot = i % dq_stages
        T.mbarrier_wait_parity(dq_empty[slot], ((i // dq_stages) & 1) ^ 1)
        dq_store(slot, dq, dq_shared)
        T.fence_proxy_async()  # the TMA reduce-add reads dq_shared (async proxy)
        T.barrier_arrive(dq_full[slot])

    @T.macro
    def dq_reduce_ordered(i, h, k, tx, seq, dq_full, dq_empty, dq_shared, dQ_accum, ready, s_lo):
        # ordered_store: query blocks from s_lo on are walked by no lower key block, so this one
        # stores them first (descending walk) and then raises their ready flags; into the lower
        # ones it adds once the key block that stores them has raised theirs. It only waits on
        # lower key blocks, dispatched no later than itself, so it cannot wait for one that
        # never runs. The branch is in the device functions (READY_FLAGS_SOURCE): TileLang
        # 0.1.15's loop unswitching rejects address_of under a condition that varies by step.
        slot = i % dq_stages
        T.mbarrier_wait_parity(dq_full[slot], (i // dq_stages) & 1)
        at = dq_tile_index(layout, seq.tile, h, k)
        store = T.Cast("int32", k >= s_lo)
        if tx == consumers + 32:
            T.call_extern(
                "handle",
                "dq_store_or_add",
                store,
                T.access_ptr(dQ_accum[at], "w", dq_tile),
                T.access_ptr(dq_shared[slot, 0], "r", dq_tile),
                dq_tile * 4,
                T.access_ptr(ready[seq.tile, h, k], "rw"),
            )
        T.barrier_arrive(dq_empty[slot])  # the tile is read: the consumers may refill it
        if tx == consumers + 32:
            T.call_extern("handle", "dq_publish", store, T.access_ptr(ready[seq.tile, h, k], "w"))

    @T.macro
    def dq_reduce(i, h, k, tx, seq, dq_full, dq_empty, dq_shared, dQ_accum):
        # Producer warp 1, step i: add the dQ tile of query head h, query block k into
        # dQ_accum. Waiting until the reduce-add has read the tile, then arriving on dq_empty,
        # hands the buffer back.
        slot = i % dq_stages
        T.mbarrier_wait_parity(dq_full[slot], (i // dq_stages) & 1)
        if tx == consumers + 32:
            at = dq_tile_index(layout, seq.tile, h, k)
            if first_store:  # the tile's only store of this launch: no zeroing needed
                bulk_store(dQ_accum[at], dq_shared[slot, 0], dq_tile)
            else:
                bulk_reduce_add(dQ_accum[at], dq_shared[slot, 0], dq_tile)
            T.tma_store_arrive()
            T.tma_store_wait(0)
        T.barrier_arrive(dq_empty[slot])

    @T.macro
    def step(wg, i, k, bx, seq, shared, barriers, frags, with_step_dq):
        # One step of consumer warpgroup wg: query block k (of its head) against its 64 keys;
        # ``with_step_dq``: this warpgroup computes the step's dQ (never without ``with_dq``).
        K_shared, V_shared, Q_shared, dO_shared, lse_shared, delta_shared, ds_shared, dq_shared = (
            shared
        )
        q_full, do_full, q_empty, do_empty, dq_full, dq_empty = barriers[1:]
        acc_s, acc_dp, acc_s_cast, ds_cast, dk, dv, dq = frags
        r0 = wg * wg_keys
        stage = i % num_stages
        phase = (i // num_stages) & 1
        ds_buf = i % 2  # dSᵀ is double-buffered in shared memory (module docstring)
        # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, issued back to back, each once its tile has landed.
        T.mbarrier_wait_parity(q_full[stage], phase)
        scores(r0, stage, K_shared, Q_shared, acc_s)
        T.mbarrier_wait_parity(do_full[stage], phase)
        dp(r0, stage, V_shared, dO_shared, acc_dp)
        T.wait_wgmma(1)  # Sᵀ is ready; dPᵀ may still run
        probabilities(wg, k, bx, stage, acc_s, lse_shared, seq)
        T.wait_wgmma(0)  # dPᵀ is ready
        ds(r0, stage, ds_buf, acc_s, acc_dp, delta_shared, acc_s_cast, ds_cast, ds_shared)
        dv_update(stage, acc_s_cast, dO_shared, dv)
        if with_dq:
            # dSᵀ was written by ordinary stores and is read by WGMMA (the async proxy): fence,
            # then wait for the other warpgroup's half.
            T.fence_proxy_async()
            T.sync_threads(DS_READY, consumers)
        dk_update(stage, ds_cast, Q_shared, dk)  # dK right behind dV
        T.wait_wgmma(1)  # dV is done: dO is free
        T.barrier_arrive(do_empty[stage])
        T.wait_wgmma(0)  # dK is done: Q is free
        T.barrier_arrive(q_empty[stage])
        if with_step_dq:
            # On this warpgroup's turn, the step's dQ: its accumulator takes the registers Pᵀ
            # and dSᵀ held, and no GEMM is in flight across the branch (ptxas would serialise
            # every WGMMA).
            dq_step(i, ds_buf, K_shared, ds_shared, dq_shared, dq_full, dq_empty, dq)

    @T.macro
    def idle_step(wg, i, shared, barriers, dq, with_step_dq):
        # A step whose queries see none of this warpgroup's keys (a window's edge): its part of
        # dSᵀ is 0, so it zeroes that part and skips its four GEMMs (half the tensor-core work
        # of the step is left to the other warpgroup); on its turn it still computes the step's
        # dQ, which the other warpgroup's keys feed. It needs no Q or dO, and frees them at once.
        # (``with_dq=False``: it only frees them.)
        K_shared, ds_shared, dq_shared = shared[0], shared[6], shared[7]
        q_empty, do_empty, dq_full, dq_empty = barriers[3:]
        r0 = wg * wg_keys
        ds_buf = i % 2
        if not with_dq:
            # No named barrier keeps the warpgroups in step here: wait until this step's Q and
            # dO have landed before freeing them, or a run of idle steps would arrive for a
            # later step of the same buffer and complete the other warpgroup's phase for it.
            q_full, do_full = barriers[1:3]
            T.mbarrier_wait_parity(q_full[i % num_stages], (i // num_stages) & 1)
            T.mbarrier_wait_parity(do_full[i % num_stages], (i // num_stages) & 1)
        T.barrier_arrive(do_empty[i % num_stages])
        T.barrier_arrive(q_empty[i % num_stages])
        if with_dq:
            for r, c in T.Parallel(wg_keys, block_N):
                ds_shared[ds_buf, r0 + r, c] = T.cast(0, dtype)
            T.fence_proxy_async()
            T.sync_threads(DS_READY, consumers)
            if with_step_dq:
                dq_step(i, ds_buf, K_shared, ds_shared, dq_shared, dq_full, dq_empty, dq)

    @T.macro
    def epilogue(wg, by, seq, first_key, K_shared, V_shared, dk, dv, dK, dV):
        r0 = wg * wg_keys
        # Epilogue through shared memory: from registers each thread holds pairs of 16-bit
        # values scattered over rows, which would fill half of every 32-byte sector it writes;
        # staged in K and V's buffers, the rows leave as 16-byte vectors. V's rows are this
        # warpgroup's alone; K's are free once both warpgroups' last dQ GEMM (it reads every
        # row of K) is done, which the named barrier says. Keys past Sk (packed: the next
        # sequence's) are not written.
        T.copy(dv, V_shared[r0 : r0 + wg_keys, :])
        T.sync_threads(DS_READY, consumers)
        T.copy(dk, K_shared[r0 : r0 + wg_keys, :])
        T.sync_threads(EPILOGUE + wg, 128)  # this warpgroup's rows are all in shared memory
        for r, c in T.Parallel(wg_keys, dim):
            if first_key + r < seq.kv_len:
                at = seq_index(layout, seq.k_row, by, first_key + r, c)
                dV[at] = V_shared[r0 + r, c]
                dK[at] = K_shared[r0 + r, c]

    @T.macro
    def walk_step(
        wg, bx, by, seq, q_start, n_blocks, shared, barriers, frags, i, with_step_dq, k=None
    ):
        # Step i of consumer warpgroup wg's walk; ``with_step_dq``: it computes the step's dQ.
        # k: the step's query block, where the caller knows it without ``step_coords``.
        if k is None:
            _, k = step_coords(by, q_start, n_blocks, i)
        if skip_idle:
            # At a window's edges a step's queries may see none of this warpgroup's keys
            # (query_block_range's edges, per warpgroup), or its keys may lie past Sk.
            first_key = bx * block_M + wg * wg_keys
            seen = first_key < seq.kv_len and first_key + wg_keys - 1 >= k * block_N + seq.lo
            if right >= 0:
                seen = seen and first_key <= k * block_N + block_N - 1 + seq.hi
            if seen:
                step(wg, i, k, bx, seq, shared, barriers, frags, with_step_dq)
            else:
                idle_step(wg, i, shared, barriers, frags[-1], with_step_dq)
        else:
            step(wg, i, k, bx, seq, shared, barriers, frags, with_step_dq)

    @T.macro
    def consumer_warpgroup(wg, bx, by, seq, q_start, n_blocks, shared, barriers, dK, dV, part=None):
        # Consumer warpgroup wg: keys wg·64 … wg·64+63 of the block. Each warpgroup is its own
        # code path, so every shared-memory offset in its WGMMA descriptors is a constant.
        # ``shared`` and ``barriers``: thread_block's buffers and mbarriers, in its order.
        K_shared, V_shared, kv_full = shared[0], shared[1], barriers[0]
        acc_s = T.alloc_fragment([wg_keys, block_N], accum_dtype)
        acc_dp = T.alloc_fragment([wg_keys, block_N], accum_dtype)
        acc_s_cast = T.alloc_fragment([wg_keys, block_N], dtype)
        ds_cast = T.alloc_fragment([wg_keys, block_N], dtype)
        dk = T.alloc_fragment([wg_keys, dim], accum_dtype)
        dv = T.alloc_fragment([wg_keys, dim], accum_dtype)
        dq = T.alloc_fragment([dq_rows, dq_cols], accum_dtype) if with_dq else None
        T.clear(dk)
        T.clear(dv)
        T.mbarrier_wait_parity(kv_full, 0)
        frags = (acc_s, acc_dp, acc_s_cast, ds_cast, dk, dv, dq)
        walk = (wg, bx, by, seq, q_start, n_blocks, shared, barriers, frags)
        n_steps = step_count(n_blocks)
        if consumers == 128 or not with_dq:  # one warpgroup computes every step's dQ, or none
            if may_run(n_steps, most_steps):
                for i in T.serial(n_steps):
                    walk_step(*walk, i, with_dq)
        elif (packed and not mask_every_step) or branch_turns:
            # The warpgroups take turns at the step's dQ, warpgroup 0 on even steps and 1 on odd
            # ones, here as a branch on the step. Packed at D = 64, where each step also picks
            # a masked or a plain copy, two copies a turn (below) spill with a causal walk of
            # one head (ptxas: 4 bytes stored, 32 loaded) and are not measured on the others.
            # Dense: ``branch_turns`` (above).
            if may_run(n_steps, most_steps):
                for i in T.serial(n_steps):
                    walk_step(*walk, i, i % 2 == wg)
        elif packed:
            # The same turns, two steps a turn of the loop (as the dense loop below); the step
            # count is known at run time only, so the second step of a turn is guarded.
            for i2 in T.serial((n_steps + 1) // 2):
                walk_step(*walk, 2 * i2, wg == 0)
                if 2 * i2 + 1 < n_steps:
                    walk_step(*walk, 2 * i2 + 1, wg == 1)
        elif walked > 1 and even_walks and (left >= 0 or right >= 0) and not ordered_store:
            # A walk over several heads with a diagonal or a window, each head of an even number
            # of query blocks: heads, then turns, as two loops. A step's query block (which the
            # mask reads) is then q_start + 2·i2 (+1), where one loop over the whole walk
            # divides by its length on every step to find it (and cannot prove the second step
            # of a turn clear of the diagonal for warpgroup 0).
            half = n_blocks // 2
            if may_run(half, most_steps // walked // 2):
                for h in T.serial(walked):
                    for i2 in T.serial(half):
                        i = 2 * (h * half + i2)  # the step's place in the walk
                        walk_step(*walk, i, wg == 0, q_start + 2 * i2)
                        walk_step(*walk, i + 1, wg == 1, q_start + 2 * i2 + 1)
        else:
            # The same turns, two steps a turn of the loop, so that each call's role is a
            # constant: the branch on the step measured 2-10% slower at D = 128
            # (benchmarks/results/bwd_schedule_trials.md, last sections).
            turns = n_steps // 2
            if most_steps % 2 == 1 and (
                isinstance(n_steps, int) or part is not None or grid_x == 1
            ):
                # Walks of an odd step count known at compile time: without a diagonal or a
                # window (e.g. Sq = 4000, 63 steps, whole or, with parts, the whole walks), or
                # in a launch of one key block a row, whose one block fixes the count
                # (``first_store``'s of a short causal grid). Given the count, ptxas spilled
                # 88-220 bytes at D = 128. Read through a warp shuffle, which makes it no
                # constant, it spills nothing, as with a causal walk's count.
                turns = T.shfl_sync(T.int32(turns), 0)
            if may_run(n_steps // 2, most_steps // 2):
                for i2 in T.serial(turns):
                    walk_step(*walk, 2 * i2, wg == 0)
                    walk_step(*walk, 2 * i2 + 1, wg == 1)
            # An even number of walked heads makes n_steps even (stated here: TileLang 0.1.15
            # fails to build the provably empty branch when n_blocks is a run-time value).
            if walked % 2 == 1 and n_steps % 2 == 1:
                walk_step(*walk, n_steps - 1, wg == 0)
        for r, c in T.Parallel(wg_keys, dim):
            dk[r, c] = dk[r, c] * softmax_scale
        first_key = bx * block_M + wg * wg_keys
        if part is not None:
            u, is_part, dK_part, dV_part = part
            if is_part:
                # A part of a walk split across thread blocks (``tail_splits``): its share of
                # dK and dV in float32, every row of the key block, for flash_bwd_post_tail.
                for r, c in T.Parallel(wg_keys, dim):
                    dV_part[u, wg * wg_keys + r, c] = dv[r, c]
                    dK_part[u, wg * wg_keys + r, c] = dk[r, c]
            else:
                epilogue(wg, by, seq, first_key, K_shared, V_shared, dk, dv, dK, dV)
        elif head_splits > 1:
            # This part of the group's dK and dV, in float32 (summed over the parts after the
            # kernel), straight from registers: a small grid's epilogue is short.
            part, kv = by % head_splits, by // head_splits
            for r, c in T.Parallel(wg_keys, dim):
                if first_key + r < seq.kv_len:
                    at = seq_index(layout, seq.k_row, kv, first_key + r, c)
                    dV[(part, *at)] = dv[r, c]
                    dK[(part, *at)] = dk[r, c]
        else:
            epilogue(wg, by, seq, first_key, K_shared, V_shared, dk, dv, dK, dV)

    @T.macro
    def load_rows(X, stats, X_shared, stats_shared, empty, full, seq, h, k, i):
        # Producer warp 0, step i: query block k of head h, rows of Q (or dO) with their lse2
        # (or delta), into the ring's stage once the consumers have freed it. A fresh mbarrier
        # counts as having completed the phase before phase 0, so the first wait on an "empty"
        # barrier (parity 1) passes at once.
        stage = i % num_stages
        T.mbarrier_wait_parity(empty[stage], ((i // num_stages) & 1) ^ 1)
        rows = seq_rows(X, layout, seq.q_row, h, k * block_N, block_N)
        T.tma_copy(rows, X_shared[stage, :, :], barrier=full[stage])
        tile = stats_tile(stats, layout, seq.tile, h, k, block_N)
        T.tma_copy(tile, stats_shared[stage, :], barrier=full[stage])
        T.barrier_arrive(full[stage])

    @T.macro
    def thread_block(
        bx, by, seq, Q, K, V, dO, lse2, Delta, dQ_accum, dK, dV, ready=None, part=None,
        q_range=None,
    ):  # fmt: skip
        # One thread block: key block bx of kv head by, in the sequence ``seq`` (a ``Rows``).
        # ``part`` and ``q_range`` (``tail_splits``): (part index, whether this thread block
        # walks a part, the parts' dK, dV) and (first query block, query blocks) of its walk;
        # the index and buffers are used only by thread blocks that walk a part.
        if ctas_per_sm > 1:
            T.annotate_min_blocks_per_sm(ctas_per_sm)
        # Programmatic dependent launch: this grid may be launched before the one ahead of it
        # (the prep) has finished, and waits here, before it reads anything that grid wrote;
        # its trigger lets the postprocess launch while this one's last blocks run.
        T.pdl_trigger()
        T.pdl_sync()
        K_shared = T.alloc_shared([block_M, dim], dtype)
        V_shared = T.alloc_shared([block_M, dim], dtype)
        Q_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
        dO_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
        lse_shared = T.alloc_shared([num_stages, block_N], accum_dtype)
        delta_shared = T.alloc_shared([num_stages, block_N], accum_dtype)
        ds_shared = dq_shared = None  # with_dq=False: neither
        if with_dq:
            ds_shared = T.alloc_shared([2, block_M, block_N], dtype)
            dq_shared = T.alloc_shared([dq_stages, dq_tile], accum_dtype)  # accumulator order

        # mbarriers. "full": producer warp 0 (32 threads) arrives and its TMA loads complete
        # the byte count; "empty": every consumer thread arrives once it no longer reads the
        # buffer. dq_full/dq_empty hand the dQ tile to producer warp 1 and back.
        kv_full = T.alloc_barrier(32)
        q_full = T.alloc_barrier([32] * num_stages)
        do_full = T.alloc_barrier([32] * num_stages)
        q_empty = T.alloc_barrier([consumers] * num_stages)
        do_empty = T.alloc_barrier([consumers] * num_stages)
        dq_full = T.alloc_barrier([128] * dq_stages)  # the threads of the warpgroup computing dQ
        dq_empty = T.alloc_barrier([32] * dq_stages)

        edges = (left, right, seq.hi, seq.lo)
        if q_range is None:
            q_start, n_blocks = query_block_range(bx, block_M, block_N, seq.q_pad, edges)
        else:
            q_start, n_blocks = q_range
        tx = T.get_thread_binding()

        if tx >= consumers:
            # ------------------------------------------------------------ producer warpgroup
            T.set_max_nreg(PRODUCER_REGS, 0)
            if tx < consumers + 32:
                # Warp 0: K, V once; then Q (+ lse2) and dO (+ delta) for every step.
                # Keys past Sk and queries past Sq read as zeros (TMA fills out of bounds;
                # packed: the next sequence's rows, then zeros past the last one).
                kv_rows = (seq.k_row, by // head_splits, bx * block_M, block_M)
                T.tma_copy(seq_rows(K, layout, *kv_rows), K_shared, barrier=kv_full)
                T.tma_copy(seq_rows(V, layout, *kv_rows), V_shared, barrier=kv_full)
                T.barrier_arrive(kv_full)
                if nest_heads:
                    if may_run(n_blocks, most_blocks):
                        for g in T.unroll(walked, annotations=NO_UNROLL):
                            for kk in T.unroll(n_blocks, annotations=NO_UNROLL):
                                i, h, k = g * n_blocks + kk, by * walked + g, q_start + kk
                                load_rows(
                                    Q, lse2, Q_shared, lse_shared, q_empty, q_full, seq, h, k, i
                                )
                                load_rows(
                                    dO, Delta, dO_shared, delta_shared, do_empty, do_full, seq,
                                    h, k, i,
                                )  # fmt: skip
                elif may_run(step_count(n_blocks), most_steps):
                    for i in T.serial(step_count(n_blocks)):
                        h, k = step_coords(by, q_start, n_blocks, i)
                        load_rows(Q, lse2, Q_shared, lse_shared, q_empty, q_full, seq, h, k, i)
                        load_rows(
                            dO, Delta, dO_shared, delta_shared, do_empty, do_full, seq, h, k, i
                        )
            elif with_dq and tx < consumers + 64:
                # Warp 1: add each step's dQ tile into dQ_accum (padded queries add zeros:
                # their P is 0).
                reduce = (tx, seq, dq_full, dq_empty, dq_shared, dQ_accum)
                if (packed and groups > 1) or nest_heads:
                    # Two loops, heads then blocks (``nest_heads``). Packed, they are needed:
                    # the accumulator's index is 64-bit there (its shape is known at run time
                    # only), and a step's head and block by a division and a modulo by the
                    # run-time block count in 64 bits would not fit the producer's registers,
                    # nor would the inner loop unrolled.
                    if may_run(n_blocks, most_blocks):
                        for g in T.serial(walked):
                            for kk in T.unroll(n_blocks, annotations=NO_UNROLL):
                                dq_reduce(g * n_blocks + kk, by * walked + g, q_start + kk, *reduce)
                elif ordered_store:
                    s_lo = first_stored_block(bx, block_M, block_N, seq.q_pad, edges)
                    if may_run(step_count(n_blocks), most_steps):
                        for i in T.serial(step_count(n_blocks)):
                            h, k = step_coords(by, q_start, n_blocks, i)
                            dq_reduce_ordered(i, h, k, *reduce, ready, s_lo)
                elif may_run(step_count(n_blocks), most_steps):
                    for i in T.serial(step_count(n_blocks)):
                        h, k = step_coords(by, q_start, n_blocks, i)
                        dq_reduce(i, h, k, *reduce)
        else:
            # ----------------------------------------------------------- consumer warpgroups
            T.set_max_nreg(consumer_regs, 1)
            shared = (
                K_shared,
                V_shared,
                Q_shared,
                dO_shared,
                lse_shared,
                delta_shared,
                ds_shared,
                dq_shared,
            )
            barriers = (kv_full, q_full, do_full, q_empty, do_empty, dq_full, dq_empty)
            if consumers == 128 or tx < 128:
                consumer_warpgroup(
                    0, bx, by, seq, q_start, n_blocks, shared, barriers, dK, dV, part
                )
            else:
                consumer_warpgroup(
                    1, bx, by, seq, q_start, n_blocks, shared, barriers, dK, dV, part
                )

    if packed:
        total_q, total_k, batch, n_tiles = T.dynamic("total_q, total_k, batch, n_tiles")
        # The walk's query blocks are read from shared memory where the loop takes two steps a
        # turn and the walk depends on the lengths (causal or a window).
        walk_in_info = mask_every_step and (right >= 0 or left >= 0)

        @T.prim_func
        def flash_bwd_varlen(
            Q: T.Tensor([total_q, heads, dim], dtype),
            K: T.Tensor([total_k, heads_kv, dim], dtype),
            V: T.Tensor([total_k, heads_kv, dim], dtype),
            dO: T.Tensor([total_q, heads, dim], dtype),
            lse2: T.Tensor([heads, n_tiles, block_N], accum_dtype),
            Delta: T.Tensor([heads, n_tiles, block_N], accum_dtype),
            cu_seqlens_q: T.Tensor([batch + 1], "int32"),
            cu_seqlens_k: T.Tensor([batch + 1], "int32"),
            seq_order: T.Tensor([batch], "int32"),
            max_seqlen_k: T.int32,
            dQ_accum: T.Tensor([n_tiles, heads, dq_tile], accum_dtype),
            dK: T.Tensor([total_k, heads_kv, dim], dtype),
            dV: T.Tensor([total_k, heads_kv, dim], dtype),
        ):
            with T.Kernel(T.ceildiv(max_seqlen_k, block_M), heads_kv, batch, threads=threads) as (
                bx,
                by,
                bz,
            ):
                b = seq_order[bz]  # the sequence: the grid runs them heaviest first
                q_offset = cu_seqlens_q[b]  # first packed row of this sequence's queries
                seq_len_q = cu_seqlens_q[b + 1] - q_offset
                seq_len_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
                # What the steps read of the sequence, kept in shared memory rather than in
                # registers: the consumers have none to spare for values live across the whole
                # loop (the dense kernel's are constants), and a shared-memory load where one
                # is used costs little. Static shared memory, beside the mbarriers, whose
                # section is padded to 1 KB anyway: the dynamic section of the largest tiles
                # (block_N = 80) has no 16 bytes left. info[5], info[6]: the walk's query blocks
                # (walk_in_info).
                info = T.alloc_shared([7 if walk_in_info else 5], "int32", scope="shared")
                seq = Rows(
                    q_row=info[0],
                    k_row=info[1],
                    tile=tile_start(info[0], info[4], block_N),  # info[4]: the sequence, b
                    q_pad=padded_len(seq_len_q, block_N),
                    kv_len=info[2],
                    hi=info[3] + right,  # info[3]: bottom-right causal alignment, Sk − Sq
                    lo=info[3] - left,
                )
                # The grid is sized for the longest sequence: a key block past this one's keys
                # leaves before anything is loaded or written (the whole thread block: nobody
                # waits on a barrier it would arrive on).
                if bx * block_M < seq_len_k:
                    if T.get_thread_binding() == 0:
                        info[0] = q_offset
                        info[1] = cu_seqlens_k[b]  # first packed row of its keys
                        info[2] = seq_len_k
                        info[3] = seq_len_k - seq_len_q
                        info[4] = b
                        if walk_in_info:
                            # The walk's query blocks (they depend on the lengths), once here:
                            # computed by each thread, their operands stay live in the
                            # consumers' registers, which spills beside the two copies a turn.
                            offset = seq_len_k - seq_len_q
                            edges = (left, right, offset + right, offset - left)
                            q_range = query_block_range(bx, block_M, block_N, seq.q_pad, edges)
                            info[5], info[6] = q_range
                    T.sync_threads()
                    q_range = (info[5], info[6]) if walk_in_info else None
                    thread_block(
                        bx, by, seq, Q, K, V, dO, lse2, Delta, dQ_accum, dK, dV, q_range=q_range
                    )

        return flash_bwd_varlen

    # head_splits > 1: each part's float32 dK and dV, [head_splits] + the kv shape
    dkv_shape = kv_shape if head_splits == 1 else [head_splits, *kv_shape]
    dkv_dtype = dtype if head_splits == 1 else accum_dtype

    def rows(bz):
        """The ``Rows`` of batch entry ``bz``."""
        return Rows(q_row=bz, k_row=bz, tile=bz, q_pad=seq_q_pad, kv_len=seq_kv, hi=hi, lo=lo)

    if not with_dq:  # no dQ accumulator

        @T.prim_func
        def flash_bwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype),
            lse2: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
            Delta: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
            dK: T.Tensor(dkv_shape, dkv_dtype),
            dV: T.Tensor(dkv_shape, dkv_dtype),
        ):
            with T.Kernel(n_key_blocks, heads_kv * head_splits, batch, threads=threads) as (
                bx,
                by,
                bz,
            ):
                thread_block(bx, by, rows(bz), Q, K, V, dO, lse2, Delta, None, dK, dV)

        return flash_bwd

    if ordered_store:  # one more argument: the ready flags, one per dQ tile, zeroed
        grid_rows = heads_kv * head_splits  # grid rows (kv head, head split) of a batch entry
        n_rows = grid_rows * batch
        n_long = n_key_blocks  # (the plain grid: see ``launch_order`` for why D = 64 keeps it)
        if dim >= 128:
            n_long = longest_walks(seq_q, seq_kv, causal, window, block_M, block_N)

        @T.prim_func
        def flash_bwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype),
            lse2: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
            Delta: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
            dQ_accum: T.Tensor([batch, heads, seq_q_pad // block_N, dq_tile], accum_dtype),
            Ready: T.Tensor([batch, heads, seq_q_pad // block_N], "int32"),
            dK: T.Tensor(dkv_shape, dkv_dtype),
            dV: T.Tensor(dkv_shape, dkv_dtype),
        ):
            if n_long == n_key_blocks:
                with T.Kernel(n_key_blocks, heads_kv * head_splits, batch, threads=threads) as (
                    bx,
                    by,
                    bz,
                ):
                    T.import_source(READY_FLAGS_SOURCE)
                    thread_block(
                        bx, by, rows(bz), Q, K, V, dO, lse2, Delta, dQ_accum, dK, dV, Ready
                    )
            else:
                with T.Kernel(n_key_blocks * n_rows, threads=threads) as i:
                    T.import_source(READY_FLAGS_SOURCE)
                    bx, row = launch_order(i, n_long, n_rows)
                    thread_block(
                        bx, row % grid_rows, rows(row // grid_rows), Q, K, V, dO, lse2, Delta,
                        dQ_accum, dK, dV, Ready,
                    )  # fmt: skip

        return flash_bwd

    grid_rows = heads_kv * head_splits  # grid rows (kv head, head split) of one batch entry
    n_rows = grid_rows * batch
    if n_rows % interleave:
        raise ValueError(f"interleave ({interleave}) must divide the {n_rows} grid rows")
    n_q_blocks = seq_q_pad // block_N
    whole, split_items, splits = tail_split_plan(
        grid_x * n_rows, num_sms, n_q_blocks, tail_splits > 1, groups
    )
    if tail_splits > 1 and (
        splits != tail_splits or causal or left >= 0 or right >= 0 or key_stride != 1
        or first_store or interleave != 1 or head_splits != 1
    ):  # fmt: skip
        raise ValueError(f"tail_splits ({tail_splits}) is not this grid's (tail_split_plan)")

    if tail_splits > 1:  # the last wave's walks in parts; two more arguments

        @T.prim_func
        def flash_bwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype),
            lse2: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
            Delta: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
            dQ_accum: T.Tensor([batch, heads, seq_q_pad // block_N, dq_tile], accum_dtype),
            dK: T.Tensor(dkv_shape, dkv_dtype),
            dV: T.Tensor(dkv_shape, dkv_dtype),
            dK_part: T.Tensor([split_items * splits, block_M, dim], accum_dtype),
            dV_part: T.Tensor([split_items * splits, block_M, dim], accum_dtype),
        ):
            # One dimension, in the plain grid's order (key block fastest, then kv head, then
            # batch entry): the whole walks, then the parts of the last ones. One code path for
            # both (two would each allocate the thread block's shared memory).
            with T.Kernel(whole + split_items * splits, threads=threads) as i:
                is_part = i >= whole
                u = T.max(i - whole, 0)  # the part (thread blocks that walk one)
                item = T.if_then_else(is_part, whole + u // splits, i)
                p = u % splits
                first_q_block = p * n_q_blocks // splits
                n_q = T.if_then_else(
                    is_part, (p + 1) * n_q_blocks // splits - first_q_block, n_q_blocks
                )
                thread_block(
                    item % grid_x, item // grid_x % grid_rows, rows(item // (grid_x * grid_rows)),
                    Q, K, V, dO, lse2, Delta, dQ_accum, dK, dV, part=(u, is_part, dK_part, dV_part),
                    q_range=(T.if_then_else(is_part, first_q_block, 0), n_q),
                )  # fmt: skip

        return flash_bwd

    @T.prim_func
    def flash_bwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype),
        lse2: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
        Delta: T.Tensor([batch, heads, seq_q_pad], accum_dtype),
        dQ_accum: T.Tensor([batch, heads, seq_q_pad // block_N, dq_tile], accum_dtype),
        dK: T.Tensor(dkv_shape, dkv_dtype),
        dV: T.Tensor(dkv_shape, dkv_dtype),
    ):
        if interleave == 1:
            with T.Kernel(grid_x, heads_kv * head_splits, batch, threads=threads) as (bx, by, bz):
                thread_block(
                    key_block(bx), by, rows(bz), Q, K, V, dO, lse2, Delta, dQ_accum, dK, dV
                )
        else:  # key block bx of each of ``interleave`` rows in turn, then key block bx + 1
            # by: a row of the set, bz: the set (rows bz·interleave … bz·interleave + by)
            with T.Kernel(interleave, grid_x, n_rows // interleave, threads=threads) as (
                by,
                bx,
                bz,
            ):
                row = bz * interleave + by
                thread_block(
                    key_block(bx), row % grid_rows, rows(row // grid_rows), Q, K, V, dO, lse2,
                    Delta, dQ_accum, dK, dV,
                )  # fmt: skip

    return flash_bwd


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flash_bwd_post(
    batch, heads, seq_q, seq_q_pad, dim, softmax_scale, dtype="float16", block=64, layout="bshd"
):
    """dQ = softmax_scale · dQ_accum, back in [B, Sq, H, D] order: ``dQ_accum`` holds, per query
    block of ``block`` (the backward's ``block_N``), the float32 dQ tile (``dq_form``) in the
    order the backward's consumer warpgroup stored it (``accumulator_index``).

    ``layout="thd"``: packed sequences (``batch``, ``seq_q``, ``seq_q_pad`` None: dynamic), the
    tiles at each sequence's ``tile_start``; only a tile's rows inside its sequence are
    written (the rest of the box would be the next sequence's rows)."""
    accum_dtype = "float32"
    dq_transposed = dq_form(dim, block)[0]

    def tile_index(i, d):
        """Where query i, head dim d sits in its dQ tile (``dq_form``: dQ or dQᵀ)."""
        return accumulator_index(d, i) if dq_transposed else accumulator_index(i, d)

    def tile_coords(t):
        """(query i, head dim d) at position t of a dQ tile: the inverse of ``tile_index``."""
        r, c = accumulator_coords(t)
        return (c, r) if dq_transposed else (r, c)

    if layout == "thd":
        total_q, batch, n_tiles = T.dynamic("total_q, batch, n_tiles")

        @T.prim_func
        def flash_bwd_post(
            dQ_accum: T.Tensor([n_tiles, heads, dim * block], accum_dtype),
            cu_seqlens_q: T.Tensor([batch + 1], "int32"),
            max_seqlen_q: T.int32,
            dQ: T.Tensor([total_q, heads, dim], dtype),
        ):
            with T.Kernel(T.ceildiv(max_seqlen_q, block), heads, batch, threads=128) as (
                bx,
                by,
                bz,
            ):
                T.pdl_sync()  # as the dense postprocess: wait for the dQ tiles
                tile = T.alloc_shared([dim * block], accum_dtype)
                dq_out = T.alloc_shared([block, dim], dtype)
                q_offset = cu_seqlens_q[bz]  # first packed row of this sequence's queries
                seq_len_q = cu_seqlens_q[bz + 1] - q_offset
                if bx * block < seq_len_q:  # blocks past the sequence's end have no tile
                    T.copy(dQ_accum[tile_start(q_offset, bz, block) + bx, by, :], tile)
                    for i, d in T.Parallel(block, dim):
                        at = tile_index(i, d)
                        dq_out[i, d] = tile[at] * softmax_scale
                    for i, d in T.Parallel(block, dim):
                        if bx * block + i < seq_len_q:
                            dQ[q_offset + bx * block + i, by, d] = dq_out[i, d]

        return flash_bwd_post

    @T.prim_func
    def flash_bwd_post(
        dQ_accum: T.Tensor([batch, heads, seq_q_pad // block, dim * block], accum_dtype),
        dQ: T.Tensor(layout_shape(layout, batch, seq_q, heads, dim), dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block), heads, batch, threads=128) as (bx, by, bz):
            T.pdl_sync()  # launched early (programmatic dependent launch): wait for the dQ tiles
            tile = T.alloc_shared([dim * block], accum_dtype)
            dq_out = T.alloc_shared([block, dim], dtype)
            # Swizzled, so that the scattered 16-bit writes below spread over the banks; the
            # TMA store that writes the rows out undoes the swizzle.
            T.annotate_layout({dq_out: tilelang.layout.make_swizzled_layout(dq_out)})
            T.copy(dQ_accum[bz, by, bx, :], tile)  # one contiguous block
            for t in T.Parallel(dim * block):  # in tile order: a warp reads 32 floats in a row
                i, d = tile_coords(t)  # query i, head dim d
                dq_out[i, d] = tile[t] * softmax_scale
            T.copy(dq_out, seq_rows(dQ, layout, bz, by, bx * block, block))

    return flash_bwd_post


MIN_PART_BLOCKS = 8  # query blocks a part of a split walk takes at least
LONG_WALK = 1024  # steps (query blocks times the group's heads) a walk needs for a wide tail
PART_COST = 0.005  # a part's fixed cost (its dK/dV in float32, their sum), in whole walks


def tail_split_plan(n_blocks, num_sms, n_q_blocks, allowed=True, groups=1):
    """How a grid of ``n_blocks`` equal walks over ``n_q_blocks`` query blocks (of ``groups``
    heads each) fills ``num_sms`` SMs, one thread block an SM: ``(whole, split_items,
    splits)``. The walks of a last wave that would leave SMs idle (``n_blocks % num_sms`` of
    them) are split into ``splits`` parts of at least MIN_PART_BLOCKS query blocks; the first
    ``whole`` run whole. ``splits`` 1: no split (or not ``allowed``).

    A short last wave is split into as many parts as the SMs take at once. One that fills more
    than half the SMs cannot be (two parts each would need a second round): it is split only
    when its walks are at least LONG_WALK steps, into the count whose rounds of parts end
    soonest, each part costing PART_COST more (100 walks of 256 query blocks on 132 SMs: 9
    parts, 900 parts in 7 rounds of a ninth of a walk). Measured on an H100 (2026-11-28,
    bf16/fp16, one process, nine rounds), GQA grids of 1024 walks without a mask, split ÷ whole:
    1.023/1.002 at H32/Hkv8 S16384 D128 (walks of 1024 steps), 1.011 at H64/Hkv8 S16384 D64
    (1024); at 512 steps 0.996/0.994 (S8192 D128, 9 parts) and 1.003 (S8192 D64, 5); at 256
    steps 0.979/0.987 (S4096 D128, 5 parts), so shorter walks stay whole: the walks of earlier
    waves end at staggered times, and the parts' fixed costs take what the idle SMs would give
    back."""
    waves, tail = divmod(n_blocks, num_sms)
    splits = 1
    most = n_q_blocks // MIN_PART_BLOCKS
    if allowed and waves and tail and num_sms // tail >= 2:
        splits = max(1, min(num_sms // tail, most))
    elif allowed and waves and tail and n_q_blocks * groups >= LONG_WALK:

        def finish(s):  # when the last wave's parts end, in whole walks
            return -(-tail * s // num_sms) / s + s * PART_COST

        splits = min(range(1, max(1, most) + 1), key=finish)
    if splits == 1:
        return n_blocks, 0, 1
    return waves * num_sms, tail, splits


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flash_bwd_post_tail(
    batch,
    heads,
    seq_kv,
    dim,
    groups,
    whole,
    split_items,
    splits,
    dtype="float16",
    block_M=128,
    layout="bshd",
):
    """dK and dV of the split walks (``tail_split_plan``): each key block's ``splits`` float32
    parts summed and cast. The grid's thread blocks in the plain order (key block fastest, then
    kv head, then batch entry), so item ``whole + j`` is key block ``(whole + j) % n_key_blocks``.
    One thread block per 16 keys of a split item; launched behind the postprocess, whose end
    implies the backward kernel's."""
    accum_dtype = "float32"
    heads_kv = heads // groups
    kv_shape = layout_shape(layout, batch, seq_kv, heads_kv, dim)
    n_key_blocks = (seq_kv + block_M - 1) // block_M
    rows = 16

    @T.prim_func
    def flash_bwd_post_tail(
        dK_part: T.Tensor([split_items * splits, block_M, dim], accum_dtype),
        dV_part: T.Tensor([split_items * splits, block_M, dim], accum_dtype),
        dK: T.Tensor(kv_shape, dtype),
        dV: T.Tensor(kv_shape, dtype),
    ):
        with T.Kernel(split_items * (block_M // rows), threads=128) as bx:
            T.pdl_sync()
            j, r0 = bx // (block_M // rows), bx % (block_M // rows) * rows
            item = whole + j
            key_blk = item % n_key_blocks
            by = item // n_key_blocks % heads_kv
            bz = item // (n_key_blocks * heads_kv)
            dk = T.alloc_fragment([rows, dim], accum_dtype)
            dv = T.alloc_fragment([rows, dim], accum_dtype)
            T.clear(dk)
            T.clear(dv)
            for p in T.serial(splits):
                for r, c in T.Parallel(rows, dim):
                    dk[r, c] += dK_part[j * splits + p, r0 + r, c]
                    dv[r, c] += dV_part[j * splits + p, r0 + r, c]
            for r, c in T.Parallel(rows, dim):
                key = key_blk * block_M + r0 + r
                if key < seq_kv:  # keys past Sk are not written
                    at = seq_index(layout, bz, by, key, c)
                    dK[at] = T.cast(dk[r, c], dtype)
                    dV[at] = T.cast(dv[r, c], dtype)

    return flash_bwd_post_tail


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flash_bwd_post_kv(
    batch, heads, seq_kv, dim, groups, splits, dtype="float16", block=64, layout="bshd"
):
    """dK and dV of a backward with ``head_splits``: each the sum, in float32, of its
    ``splits`` float32 parts (``[splits] + kv shape``), cast once. One launch for both."""
    accum_dtype = "float32"
    heads_kv = heads // groups
    kv_shape = layout_shape(layout, batch, seq_kv, heads_kv, dim)

    @T.macro
    def sum_parts(parts, dX, bx, by, bz):
        part = T.alloc_fragment([block, dim], accum_dtype)
        acc = T.alloc_fragment([block, dim], accum_dtype)
        T.clear(acc)
        rows = seq_index(layout, bz, by, slice(bx * block, (bx + 1) * block), slice(None))
        for s in T.serial(splits):
            T.copy(parts[(s, *rows)], part)
            for i, d in T.Parallel(block, dim):
                acc[i, d] += part[i, d]
        T.copy(acc, seq_rows(dX, layout, bz, by, bx * block, block))

    @T.prim_func
    def flash_bwd_post_kv(
        dK_parts: T.Tensor([splits, *kv_shape], accum_dtype),
        dV_parts: T.Tensor([splits, *kv_shape], accum_dtype),
        dK: T.Tensor(kv_shape, dtype),
        dV: T.Tensor(kv_shape, dtype),
    ):
        with T.Kernel(T.ceildiv(seq_kv, block), heads_kv, batch, threads=128) as (bx, by, bz):
            # Launched while the postprocess ahead of it runs; its end implies the backward
            # kernel's (the postprocess waited for it), so the parts are written once this returns.
            T.pdl_sync()
            sum_parts(dK_parts, dK, bx, by, bz)
            sum_parts(dV_parts, dV, bx, by, bz)

    return flash_bwd_post_kv


# ----------------------------------------------------------------------------- configurations
def default_config(dim, arch="sm_90a", grid=None):
    """Backward tiles: ``block_M`` keys per thread block (two consumer warpgroups of 64, or one
    for 64), ``block_N`` queries per step, ``num_stages`` Q/dO buffers, ``dq_stages`` dQ tiles
    in shared memory, ``head_splits`` thread blocks sharing a GQA group's query heads (1: one
    walks them all), ``interleave`` grid rows whose key blocks launch in turn (1: row by row).

    ``grid`` (a ``Grid``), where the caller knows the shape: a grid too small to fill the GPU
    takes 64 keys a thread block (``small_grid``) and shares a GQA group's heads out over
    ``head_splits`` thread blocks a key block (``grid_head_splits``); a causal grid takes about a
    wave of rows at a time, key block by key block (``grid_interleave``).

    Measured on an H100 (2026-11-22, fp16, the backward as ``attention``'s autograd runs it, one
    process): D=128 takes 64 queries a step (80, FlashAttention-3's choice for non-causal,
    measured level: 529 against 528 TFLOP/s at B4 H32 S4096, 557 against 561 at S8192, causal
    444 against 443); D=64 takes 128. One dQ tile beat two at D=128 (525 against 515 TFLOP/s,
    S8192 547 against 530, causal 435 against 438) and is level at D=64 (462 against 456): the
    second tile frees the consumers from waiting for the reduce-add, but that wait is short.
    With each step's dQ from one warpgroup, two tiles at D=128 measured level again (2026-11-28,
    kernel alone, five rounds in one process: 0.984-1.019x on six rows, e.g. B2 H32 S8192 bf16
    582 against 571 TFLOP/s, B4 S4096 563 against 572).
    Adding dQ with vector atomics straight from registers instead of the reduce-add lost
    clearly (kernel alone, with the earlier transposed dQ tile: D128 423 against 516, causal
    395 against 453, D64 397 against 472), and lost again with the tile in ``dq_form``'s shape,
    where each thread's four adjacent floats go out as one 16-byte ``red.global.add.v4.f32``
    and the tile's trip through shared memory is gone (2026-11-28, bf16, one process: 0.94-0.97x
    on six D64 and D128 rows, e.g. B4 H32 S4096 D128 517 against 547 TFLOP/s). The measured
    choice is the same with and without ``causal``. A third Q/dO stage at D=128 (226 KB of
    shared memory, no spills) measured level or slower on 2026-11-23: 0.99-1.01x at S4096 and
    S8192, 0.97-0.98x at S16384 (bf16, 570 against 579 TFLOP/s); in the shared memory the
    register atomics free it lost to two stages again (2026-11-28: 0.94-0.98x without a mask).
    On the window-1024 sink backward (D128, bf16, H32/Hkv8 B2 S8192 and B4 S4096, ordered
    store; 2026-11-27, five interleaved rounds) two dQ tiles measured
    1.010-1.012x, within the run's noise, and 80 queries a step 0.976-0.984x: both stay off.

    The grid is one thread block per (key block, kv head, batch entry). A persistent grid (one
    thread block per SM walking those tiles, causal ones paired heaviest with lightest as in the
    forward, the next tile's Q and dO loaded under the last one's epilogue) measured level on
    2026-11-23, so the simpler grid stays: 0.98–1.02× this one on nine rows (D128 S4096 fp16 /
    bf16, causal or not, S8192 and S16384; D64 S4096), e.g. B4 H32 S4096 D128 causal fp16 442
    against 448 TFLOP/s. A backward tile runs long enough that launching it costs little.
    Launching the causal grid heaviest key blocks first (chunks of 1, 2, 4 or 8 key blocks
    across every head and batch entry, then the next chunk; ``interleave`` takes a few rows at a
    time instead, ``grid_interleave``) lost on 9 of 10 causal rows
    (2026-11-23; B4 H32 S4096 D128: 424-438 against 456 TFLOP/s with chunks of 4-8, 243 with
    1): thread blocks of one head running side by side share its Q, dO and dQ tiles in L2, and
    this grid's order (every key block of a head, then the next head) keeps them together.
    FlashAttention-3's causal order, sections of as many heads as fit in L2 with key block 0 of
    each, then key block 1 of each, …, measured level on 2026-11-24 (MHA 0.99-1.01x with its
    section sizes; GQA 0.97-1.05x, no size winning on every row; bwd_l2_sections.md).
    Clusters of two key blocks sharing each Q and dO tile by TMA multicast (non-causal) measured
    level on 2026-11-24 (0.985-1.011x against a second timing of this kernel;
    bwd_multicast.md).
    For causal GQA, where a thread block walks every head of its group and the first key blocks
    run longest, one thread block taking two key blocks (bx and the last − bx, so that all walk
    the same number of steps) lost 0.5-7% on ten H32/Hkv8 and H64/Hkv8 rows (2026-11-23; S4096
    D128 bf16: 421 against 444 TFLOP/s): the second block's K and V load waits for the first
    one's epilogue. Starting each thread block's walk over the query blocks at a different one
    (so that the blocks of a head do not reduce-add into the same dQ tile at once) lost too
    (2026-11-23, D128: level at S4096, 1-7% slower at S8192 and S16384): blocks of a head
    reading the same Q and dO tiles together share them in L2. Started in R groups instead
    (thread block bx at query block (bx mod R)·n/R, each group still reading its tiles
    together), it measured level (2026-11-29, H200, bf16 without a mask, R = 2, 4, 8:
    0.995-1.013x at S4096-16384, this kernel timed twice 0.993-1.001x): the blocks' reduce-adds
    into one dQ tile do not queue for it. Converting each dQ tile inside
    this kernel, by the thread block that adds into it last, instead of in ``flash_bwd_post``
    lost on 2026-11-23 (benchmarks/results/bwd_fused_post.md): 4-8% on the dense rows with the
    accumulator still zeroed by the prep, about 20% without zeroing (the first thread block at a
    tile stores, the others wait for it). Handing the dQ tile over in two halves, one per
    consumer warpgroup with its own full/empty barriers, so that each half's reduce-add starts
    as soon as that half is stored (FlashAttention-3's form), measured level (2026-11-23,
    benchmarks/results/bwd_dq_split.md: 0.98-1.01x on twenty D64 and D128 rows, while two copies
    of one kernel in that run differed by up to 2.6%). L2 EVICT_LAST hints on the Q and dO loads
    and on the reduce-add lost at D128 S8192 and S16384 without a mask (up to 7%). Two thread
    blocks an SM (64 keys and 64 queries a step, 232 consumer registers) measured 0.95-0.98x on
    window-128 rows and lost to one thread block with 64 keys on small GQA grids (2026-11-24,
    benchmarks/results/bwd_small_grid.md). Warp-role tests and WGMMA descriptors on a
    warp-uniform thread index (TileLang's generated source rewritten, so ptxas keeps them in
    uniform registers: 2472 instructions of SASS instead of 2744) measured 0.991-0.999x this kernel
    in SM cycles on full rows and 1.015-1.046x on causal ones (2026-11-24,
    benchmarks/results/kernel_cycles.md): not kept. lse2 and delta copied into registers before
    the waits for Sᵀ and dPᵀ (their loads then run under the GEMMs) measured 0.997-1.005x at
    D=128 and 0.76x at D=64 (spills), in cycles, the same day: not kept. On 2026-11-27
    (benchmarks/results/bwd_schedule_trials.md): the step's dK wait moved into the next step,
    behind its Sᵀ and dPᵀ issue, 0.967-1.020x; dQᵀ of each step computed at the start of the next,
    the warpgroups meeting on an mbarrier per dSᵀ buffer instead of the named barrier, 0.93-0.99x
    (with FA3's ping-pong on the Sᵀ/dPᵀ issue 0.89-0.99x, with two dQ tiles 0.92-0.94x): the dQᵀ
    GEMM and store then sit on the warpgroup's own path. Not kept.
    """
    if not arch.startswith("sm_90"):
        raise ValueError(
            f"arch {arch}: this kernel is written for Hopper (sm_90a: TMA, WGMMA, setmaxnreg); "
            "for Blackwell see examples/flash_attention_sm100/"
        )
    block_M = 64 if grid is not None and small_grid(dim, *grid) else 128
    block_N = 128 if dim <= 64 else 64
    splits, interleave = 1, 1
    if grid is not None:
        splits = grid_head_splits(block_M, block_N, *grid)
        interleave = grid_interleave(block_M, splits, *grid)
    return dict(
        block_M=block_M,
        block_N=block_N,
        num_stages=2,
        dq_stages=1,
        head_splits=splits,
        interleave=interleave,
    )


class Grid(typing.NamedTuple):
    """What the default config needs of a dense backward's shape: its kv heads' thread blocks
    (``batch``, ``heads_kv``, ``seq_k``), the query heads each walks (``groups``), whether its
    walks are triangles (``causal``) or a window's band (``windowed``: bounded on the left),
    and the GPU's SMs."""

    batch: int
    heads_kv: int
    groups: int
    seq_k: int
    causal: bool
    windowed: bool
    num_sms: int


def small_grid(dim, batch, heads_kv, groups, seq_k, causal, windowed, num_sms):
    """Whether the backward takes 64 keys a thread block instead of 128 (one consumer
    warpgroup), at D = 64: when the grid of 128-key blocks is at most half the SMs, or, for
    one head a group (MHA) without a window bound on the left, at most two per SM. Twice the
    thread blocks, each step half as long, end the longest walk sooner; a GQA grid above half
    the SMs does better with 128 keys and its heads split (``grid_head_splits``), and a
    window's walks are a few query blocks, so there only SMs left idle are worth filling.
    D = 128 keeps 128 keys (one warpgroup there runs out of registers).

    Measured on an H100 (2026-11-24, bf16, graph replays of the backward, one process;
    benchmarks/results/bwd_small_grid.md, bwd_head_splits.md), 64 keys against 128: MHA 1.34×
    at B1 H8 S1024 (64 blocks), 1.31× at B1 H8 S2048 (128), 1.10× at B1 H16 S2048 (256), level
    at B1 H16 S1024 (128); GQA 2.3-2.9× at B1-2 S2048 (64), 1.91× at H64/Hkv8 S2048 causal
    (128), where 128 keys with 8 head splits is 1.17× faster still, and 0.79× at H32/Hkv8
    S4096 (256); 0.83-0.91× at 1024 blocks and more. Windows: 1.17× at window 128 and 1.53× at
    (64, 64) with 64 blocks, 0.82× at window 128 with 128 and 256 blocks, 0.69× at window 1024
    with 256."""
    blocks = (seq_k + 127) // 128 * heads_kv * batch
    if dim != 64:
        return False
    return blocks <= (2 * num_sms if groups == 1 and not windowed else num_sms // 2)


def grid_head_splits(block_M, block_N, batch, heads_kv, groups, seq_k, causal, windowed, num_sms):
    """``head_splits`` for a dense GQA grid: the most (2, 4 or 8, dividing ``groups``) that
    keep the thread blocks at most eight an SM, for causal walks, or for full walks on a grid of
    at most half the SMs; 1 for windows and for larger full grids. A causal grid's first key
    blocks walk longest; shorter walks on more thread blocks balance the SMs, at the cost of
    writing each part's dK and dV in float32 and summing them. A causal grid past eight thread
    blocks an SM still takes two splits where its longest walk (key block 0: every query block
    of every head of the group) is 1024 steps of ``block_N`` queries or more.

    Measured on an H100 (2026-11-24, bf16, graph replays, one process;
    benchmarks/results/bwd_head_splits.md), this default against the one before it (no splits,
    64 keys at D = 64 up to two blocks an SM): causal D128 3.21× at H32/Hkv4 S2048 (64 blocks,
    8 splits), 1.35× at B2 H32/Hkv8 S1024 (128, 4), 1.15× at H32/Hkv8 S4096 (256, 4), 1.09× at
    H64/Hkv8 S8192 (512, 2); causal D64 1.47× at H16/Hkv2 S4096, 1.22× at H32/Hkv4 S2048, 1.17×
    at H64/Hkv8 S2048, 1.14× at H32/Hkv8 S4096; full walks D128 2.37× at H32/Hkv4 S2048 (64,
    8). Splits lost on full walks over 128 blocks (0.93-0.98× at H32/Hkv4 S4096 D128, so kept
    at 1 there), on windows (0.56-0.81×, window 128, 64 to 512 blocks) and were level at B2
    H32/Hkv8 S2048 D64 causal (0.99× against 64 keys unsplit). On causal grids of 1024 blocks
    (2026-11-24, eager backward, five rounds; the same file), two splits against none: 1.022×
    (bf16) and 1.025× (fp16) at B1 H32/Hkv8 S16384 D128 (walks of 1024 steps), 1.051× at B1
    H64/Hkv8 S16384 D64 (1024); level at B2 S8192 D128 (512 steps: 0.99×, four splits 1.004×)
    and B4 S4096 D128 (256: 0.995×, four 0.97×). On an H200 (2026-11-28, nine rounds) four or
    eight splits against two on the S16384 causal rows: 1.003-1.019× at D128, within the rounds'
    spread (benchmarks/results/bwd_head_splits.md, round 4): the rule stands."""
    blocks = (seq_k + block_M - 1) // block_M * heads_kv * batch
    if windowed or not (causal or blocks <= num_sms // 2):
        return 1
    fits = [n for n in (2, 4, 8) if groups % n == 0 and blocks * n <= 8 * num_sms]
    longest_walk = groups * ((seq_k + block_N - 1) // block_N)  # key block 0's steps
    if not fits and causal and groups % 2 == 0 and longest_walk >= 1024:
        return 2  # past eight an SM, but the longest walk is worth halving
    return max(fits, default=1)


def grid_interleave(
    block_M, head_splits, batch, heads_kv, groups, seq_k, causal, windowed, num_sms
):
    """``interleave`` for a dense grid: for causal walks without a left edge, about one wave of
    thread blocks (the largest divisor of the grid's rows up to ``num_sms`` ÷ key blocks);
    otherwise 1. In the grid's plain order the last row's key block 0, the longest walk, starts
    in the last wave and runs on alone; with its rows interleaved the last wave starts with the
    longest walks of its rows.

    Measured on an H100 (2026-11-24, benchmarks/results/bwd_interleave.md), against no
    interleaving. SM cycles of the main kernel under Nsight Compute (bf16, D = 128 unless said):
    causal B4 H32 S4096 1.022× fewer (SMs active 95.6% → 97.8%), B2 S8192 1.023×, B1 S16384
    level (one wave is one row there); GQA H32/Hkv8 B4 S4096 1.099× (4 of 32 rows; active
    86.7% → 97.5%), B2 S8192 1.091× (2 of 16); GQA H64/Hkv8 D = 64 B4 S4096 1.127×, B2 S8192
    1.110×; MHA D = 64, H64: 0.997–1.005×. Interleaving more rows than a wave holds gained no
    more on MHA and less on GQA (S8192: 1.058× with 4, 1.050× with 8): the rows walked at once
    share their Q, dO and dQ tiles in L2 while they are few. Without a mask (every walk equal)
    it measured 0.995–0.997× (B2 S8192, 2 to 8 rows), so full walks keep the plain order.
    Timed (the whole backward, one process, bf16 / fp16, against cuDNN): MHA B4 S4096 1.068 /
    1.086× against 1.042 / 1.051× without, B2 S8192 1.071 / 1.051× against 1.042 / 1.041×; GQA
    B4 S4096 1.089 / 1.068× against 1.030 / 1.005×, B2 S8192 1.045 / 1.045× against 1.019 /
    1.002×. The adding launch of a store stride (S ≤ 2048) takes it too (2026-11-25): GQA
    H32/Hkv8 D = 128 B8 S2048 and B16 S1024 1.089× and 1.115× fewer cycles (the whole backward),
    H64/Hkv8 D = 64 1.080× and 1.078×; timed against cuDNN, bf16 D = 128, 1.068× and 1.185×
    against 1.012× and 1.068× without; MHA level (0.993–1.006×)."""
    if not causal or windowed:
        return 1
    rows = heads_kv * head_splits * batch
    target = max(1, num_sms // ((seq_k + block_M - 1) // block_M))
    return max(n for n in range(1, min(rows, target) + 1) if rows % n == 0)


def tune_configs(dim):
    """The space ``--tune`` compares: one or two dQ tiles in shared memory. (80 queries a step
    at D = 128, FlashAttention-3's choice for non-causal, measured level with the earlier
    two-part dQ; with dQ in one warpgroup its tile has no 64-row side for ``dq_form``.)"""
    pairs = ((128, 1), (128, 2)) if dim <= 64 else ((64, 1), (64, 2))
    return [
        dict(block_M=128, block_N=bn, num_stages=2, dq_stages=n, head_splits=1, interleave=1)
        for bn, n in pairs
    ]


# ----------------------------------------------------------------------------- torch-facing
def dtype_name(t):
    return "float16" if t.dtype == torch.float16 else "bfloat16"


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


def attention_forward(q, k, v, causal, softmax_scale):
    """example_mha_fwd_bshd.py's persistent forward, on checked, contiguous input: ``out
    [B, Sq, H, D]`` and ``lse [B, H, Sq]`` (float32, natural log). The sibling's plain function,
    not its ``attention``: that would check the input again and call its operator,
    tl_attn::mha_fwd_bshd, inside this script's forward operator — a second dispatch that adds
    nothing, since torch.compile and autograd see only the outer operator."""
    return fwd.attention_forward(q, k, v, causal, softmax_scale)


def attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, config=None):
    """The backward kernels: returns ``dq, dk, dv`` in the input dtype. ``k, v`` may have
    fewer heads than ``q`` (``[B, Sk, Hkv, D]``, H a multiple of Hkv): example_gqa_bwd.py runs
    this backward for grouped-query attention."""
    return run_backward(dout, q, k, v, out, lse, causal, softmax_scale, config)[:3]


def dense_grid(batch, heads, heads_kv, seq_k, causal, window, num_sms):
    """The ``Grid`` of a dense backward. A window of (-1, 0) walks the causal triangle, as
    ``causal`` does: example_gqa_sink_bwd_bhsd.py passes causal so, with ``causal=False``."""
    causal = causal or tuple(window) == (-1, 0)
    return Grid(batch, heads_kv, heads // heads_kv, seq_k, causal, window[0] >= 0, num_sms)


def grid_config(dim, batch, heads, heads_kv, seq_k, causal, window, device):
    """``default_config`` for a dense backward's grid on ``device`` (its SM count)."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = dense_grid(batch, heads, heads_kv, seq_k, causal, window, num_sms)
    return default_config(dim, fwd.device_arch(device), grid)


def run_backward(
    dout, q, k, v, out, lse, causal, softmax_scale, config=None, window=(-1, -1), layout="bshd"
):
    """``attention_backward`` with ``flash_bwd``'s window and layout, for
    example_gqa_sink_bwd_bhsd.py: returns ``dq, dk, dv`` and ``delta`` (float32, Σ_d O ∘ dO per
    query row, which that script turns into the sinks' gradient): ``[B, H, Sq']`` with Sq'
    padded to whole query blocks (rows past Sq are 0)."""
    if layout == "bshd":
        (B, Sq, H, D), (Sk, Hkv) = q.shape, k.shape[1:3]
    else:
        (B, H, Sq, D), (Hkv, Sk) = q.shape, k.shape[1:3]
    if q.numel() == 0 or k.numel() == 0:  # an empty sum: every gradient is 0
        delta = torch.zeros(B, H, Sq, dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), delta
    config = tuple(sorted(config.items())) if config else None
    cfg, seq_q_pad, tail, entries = backward_plan(
        B, H, Hkv, Sq, Sk, D, bool(causal), float(softmax_scale), dtype_name(q), config,
        tuple(window), layout, q.device,
    )  # fmt: skip
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    delta = torch.empty(B, H, seq_q_pad, dtype=torch.float32, device=q.device)
    lse2 = torch.empty(B, H, seq_q_pad, dtype=torch.float32, device=q.device)
    # dQ tiles, float32, one per query block: the backward kernel's reduce-adds land here,
    # after the prep has zeroed them or a first launch has stored them (store_stride).
    n_blocks = seq_q_pad // cfg["block_N"]
    dq_accum = torch.empty(B, H, n_blocks, D * cfg["block_N"], dtype=torch.float32, device=q.device)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    splits = cfg.get("head_splits", 1)
    dk_parts = dv_parts = None
    if splits > 1:  # each part's float32 dK, dV, which flash_bwd_post_kv sums into dk, dv
        dk_parts = torch.empty(splits, *k.shape, dtype=torch.float32, device=q.device)
        dv_parts = torch.empty(splits, *v.shape, dtype=torch.float32, device=q.device)
    dk_out, dv_out = (dk, dv) if splits == 1 else (dk_parts, dv_parts)  # the kernel's
    dk_part = dv_part = None
    flash_bwd_tensors = (q, k, v, dout, lse2, delta, dq_accum, dk_out, dv_out)
    if "flash_bwd_post_tail" in entries:  # the split walks' float32 dK, dV parts
        n_parts = tail[2] * tail[3]
        dk_part = torch.empty(n_parts, cfg["block_M"], D, dtype=torch.float32, device=q.device)
        dv_part = torch.empty_like(dk_part)
        flash_bwd_tensors += (dk_part, dv_part)
    ready = None
    if "flash_bwd_ordered" in entries:  # ordered_store's flags, one per dQ tile
        ready = torch.zeros(B, H, n_blocks, dtype=torch.int32, device=q.device)
    launches = {
        "flash_bwd_prep": (out, dout, lse, delta, lse2, dq_accum.view(B, H, -1)),
        "flash_bwd_ordered": (q, k, v, dout, lse2, delta, dq_accum, ready, dk_out, dv_out),
        "flash_bwd_store": (q, k, v, dout, lse2, delta, dq_accum, dk_out, dv_out),
        "flash_bwd": flash_bwd_tensors,
        "flash_bwd_post": (dq_accum, dq),
        "flash_bwd_post_kv": (dk_parts, dv_parts, dk, dv),
        "flash_bwd_post_tail": (dk_part, dv_part, dk, dv),
    }
    for name, tensors in launches.items():  # in this order; flash_bwd_store only if chosen
        if name in entries:
            entries[name](*tensors)
    return dq, dk, dv, delta


@functools.lru_cache(maxsize=256)
def backward_plan(B, H, Hkv, Sq, Sk, D, causal, softmax_scale, dtype, config, window, layout,
                  device):  # fmt: skip
    """What every backward of one shape launches, settled on its first call: ``(cfg, seq_q_pad,
    tail, entries)`` — the tiles (``config``: the caller's as sorted (key, value) pairs, or None
    for ``grid_config``'s), the query length padded to whole blocks, the plain launch's last
    wave in parts (``tail_split_plan``, or None) and the kernels of ``backward_kernels`` as
    compiled entry points (example_mha_fwd_bshd.py's ``entry``), by name. Host work that only
    the shape decides, which a training step of small shapes would otherwise pay every time
    (docs/CONVENTIONS.md, "Eager calls")."""
    cfg = dict(config) if config else grid_config(D, B, H, Hkv, Sk, causal, window, device)
    seq_q_pad = padded_len(Sq, cfg["block_N"])
    tail = None
    plain = not causal and window == (-1, -1)
    if plain and cfg.get("head_splits", 1) == 1 and cfg.get("interleave", 1) == 1:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        n_thread_blocks = -(-Sk // cfg["block_M"]) * Hkv * B
        plan = tail_split_plan(
            n_thread_blocks, num_sms, seq_q_pad // cfg["block_N"], groups=H // Hkv
        )
        tail = (num_sms, *plan) if plan[2] > 1 else None
    kernels = backward_kernels(
        Sq, Sk, D, causal, softmax_scale, dtype, cfg, H // Hkv, window, layout, tail
    )
    entries = {
        name: fwd.entry(factory(B, H, *args, **kw)) for name, (factory, args, kw) in kernels.items()
    }
    return cfg, seq_q_pad, tail, entries


def sequence_order(cu_seqlens_q, cu_seqlens_k, causal, block_M, block_N):
    """The packed backward's sequences, heaviest first, from the cumulative lengths (Python
    ints): a list of sequence indices for ``flash_bwd_varlen``'s ``seq_order``. A sequence's
    weight is the steps its key blocks walk (``walked_ranges``) plus one per key block (its K/V
    load and epilogue); ties keep their order.

    The grid launches its thread blocks sequence by sequence (each kv head's key blocks
    together, which keeps that head's Q, dO and dQ tiles shared in L2). In the given order a
    long sequence may come last, and its key blocks then run on after every other has finished;
    heaviest first, the light ones fill in at the end. Measured on an H100 (2026-11-23, H32
    D128, 16384 tokens, the backward's three kernels, seven rounds in one process), heaviest
    first against the given order: 8 sequences of 1 to 4096 (bench_varlen's batch) 1.014x
    (bf16), 1.003x (fp16) and causal 1.021x, 1.030x; 32 sequences of 1 to 1024 (bf16) 1.010x,
    causal 1.023x. A model of the grid as a queue of thread blocks on 132 SMs predicted 6-8%
    on the first batch; the measured gain is smaller."""
    weights = []
    for b in range(len(cu_seqlens_q) - 1):
        len_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        len_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
        ranges = walked_ranges(len_q, len_k, causal, (-1, -1), block_M, block_N)
        weights.append(sum(n + 1 for _, n in ranges))
    return sorted(range(len(weights)), key=lambda b: -weights[b])


def run_backward_varlen(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
    softmax_scale, config=None, seq_order=None,
):  # fmt: skip
    """The backward on packed sequences (``layout="thd"``), for
    example_gqa_bwd_tma_reduce_varlen.py: ``q [total_q, H, D]``, ``k, v [total_k, Hkv, D]``,
    ``cu_seqlens_q/k`` int32 ``[B + 1]``, ``max_seqlen_q/k`` at least the longest sequence,
    ``lse`` the forward's ``[H, total_q]`` (natural log, +inf for a row that sees no key),
    ``seq_order`` int32 ``[B]`` on the device, the order the grid takes the sequences in
    (``sequence_order``; None: as given). Returns ``dq, dk, dv``."""
    (total_q, H, D), (total_k, Hkv, _) = q.shape, k.shape
    if total_q == 0 or total_k == 0:  # nothing attends to anything: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    config = tuple(sorted(config.items())) if config else None
    cfg, (prep, kernel, post) = varlen_backward_plan(
        H, Hkv, D, bool(causal), float(softmax_scale), dtype_name(q), config, q.device
    )
    block_N = cfg["block_N"]
    batch = cu_seqlens_q.shape[0] - 1
    n_tiles = tile_start(total_q, batch, block_N)  # every sequence's query tiles (tile_start)
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    # lse2 and delta: the prep writes every row of every sequence's tiles (padding included);
    # the tiles between sequences are never read.
    delta = torch.empty(H, n_tiles, block_N, dtype=torch.float32, device=q.device)
    lse2 = torch.empty(H, n_tiles, block_N, dtype=torch.float32, device=q.device)
    # dQ tiles, float32, one per query tile: a sum of reduce-adds, zeroed by the prep (every
    # sequence's tiles; the tiles between sequences are never read).
    dq_accum = torch.empty(n_tiles, H, D * block_N, dtype=torch.float32, device=q.device)
    prep(out, dout, lse, cu_seqlens_q, max_seqlen_q, delta, lse2, dq_accum)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if seq_order is None:
        seq_order = torch.arange(batch, dtype=torch.int32, device=q.device)
    kernel(
        q, k, v, dout, lse2, delta, cu_seqlens_q, cu_seqlens_k, seq_order, max_seqlen_k, dq_accum,
        dk, dv,
    )  # fmt: skip
    dq = torch.empty_like(q)
    post(dq_accum, cu_seqlens_q, max_seqlen_q, dq)
    return dq, dk, dv


@functools.lru_cache(maxsize=64)
def varlen_backward_plan(heads, heads_kv, dim, causal, softmax_scale, dtype, config, device):
    """``run_backward_varlen``'s tiles (``config``: the caller's as sorted (key, value) pairs, or
    None for ``default_config``) and its three kernels (prep, backward, post) as compiled entry
    points, settled on the first call: the packed kernels take every batch (their lengths are
    dynamic), so only the heads, head dim, mask, scale, dtype and tiles pick them."""
    cfg = dict(config) if config else default_config(dim, fwd.device_arch(device))
    block_N = cfg["block_N"]
    prep = flash_bwd_prep(None, heads, None, None, dim, dtype, block_N, "thd")
    kernel = flash_bwd(
        None, heads, None, None, dim, causal, softmax_scale, dtype, **cfg,
        groups=heads // heads_kv, layout="thd",
    )  # fmt: skip
    post = flash_bwd_post(None, heads, None, None, dim, softmax_scale, dtype, block_N, "thd")
    return cfg, tuple(fwd.entry(k) for k in (prep, kernel, post))


# torch.compile: the kernels as custom operators (docs/CONVENTIONS.md, "torch.compile"), as in
# example_mha_bwd_bshd.py: the forward operator's autograd formula saves q, k, v, out, lse and
# calls the backward operator, which gets the config (backward tiles) in CONFIG_KEYS order.
CONFIG_KEYS = ("block_M", "block_N", "num_stages", "dq_stages", "head_splits", "interleave")


def config_values(config):
    """A caller's config (a dict; None: the default) as the operators take it, its values in
    CONFIG_KEYS order. The grid-shaped choices it may leave out take their plain values: no head
    split, rows launched in order."""
    if not config:
        return None
    config = {"head_splits": 1, "interleave": 1, **config}
    return [config[key] for key in CONFIG_KEYS]


@torch.library.custom_op("tl_attn::mha_bwd_wgmma_pipelined_forward", mutates_args=())
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


@torch.library.custom_op("tl_attn::mha_bwd_wgmma_pipelined_backward", mutates_args=())
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
    tiles = config_values(config)
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
    parser = _harness().base_parser(__doc__.splitlines()[0], archs=("sm_90a",), dims=HEAD_DIMS)
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
    """Out and dq, dk, dv against autograd through ``ref_program``."""
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
    fwd_flops = harness.attention_flops(batch, heads, seq_q, seq_k, dim, dim, causal)
    bwd_flops = harness.attention_flops(batch, heads, seq_q, seq_k, dim, dim, causal, True)
    shape = f"B{batch} H{heads} Sq{seq_q} Sk{seq_k} D{dim} causal={causal}"
    shape += " " + str(dtype).removeprefix("torch.")
    return {
        "fwd+bwd": harness.report(
            f"forward+backward {shape}", fwd_bwd, peers_fwd_bwd, fwd_flops + bwd_flops
        ),
        "bwd": harness.report(f"backward {shape}", bwd, peers_bwd, bwd_flops),
    }


def backward_kernels(
    seq_q, seq_k, dim, causal, softmax_scale, dtype, config, groups=1, window=(-1, -1),
    layout="bshd", tail=None,
):  # fmt: skip
    """The backward's three kernel factories and their arguments after ``(batch, heads)``:
    name → (factory, args, kwargs). ``compile_all`` builds them, here, in example_gqa_bwd.py
    (``groups`` query heads a kv head), in example_gqa_sink_bwd_bhsd.py (a window, BHSD) and
    in example_gqa_bwd_tma_reduce_varlen.py (``layout="thd"``: packed sequences, the lengths
    and the batch None, as they are dynamic). ``tail``: ``(num_sms, whole, split_items,
    splits)`` from ``tail_split_plan`` for the caller's batch and heads, used by the single
    plain launch (its last wave's walks in parts, summed by ``flash_bwd_post_tail``)."""
    packed = layout == "thd"
    seq_q_pad = None if packed else padded_len(seq_q, config["block_N"])
    bwd_args = (seq_q, seq_k, dim, causal, softmax_scale, dtype)
    # ``interleave`` orders the grid of the launch that adds (the single plain one, or the second
    # of ``key_stride``'s); the storing and ordered launches keep theirs.
    interleave = config.get("interleave", 1)
    bwd_kw = {**config, "groups": groups, "window": window, "layout": layout, "interleave": 1}
    prep_kw = {"layout": layout}
    if packed:  # one thread block a query tile, lse in the forward's layout
        prep_kw.update(block=config["block_N"])
    kernels = {"flash_bwd_prep": (flash_bwd_prep, (seq_q, seq_q_pad, dim, dtype), prep_kw)}
    stride, ordered = None, False
    if not packed:
        tiles = (config["block_M"], config["block_N"])
        stride = store_stride(seq_q, seq_k, causal, tuple(window), *tiles)
        ordered = stride != 1 and ordered_store_pays(seq_q, seq_k, causal, window, *tiles)
    if ordered:  # one launch; each tile's lowest key block stores it
        prep_kw.update(zero_dq=False)
        kernels["flash_bwd_ordered"] = (flash_bwd, bwd_args, {**bwd_kw, "ordered_store": True})
    elif packed:
        kernels["flash_bwd_varlen"] = (flash_bwd, bwd_args, bwd_kw)
    elif stride is None:
        kernels["flash_bwd"] = (flash_bwd, bwd_args, {**bwd_kw, "interleave": interleave})
        if tail is not None:  # the last wave's walks in parts
            num_sms, whole, split_items, splits = tail
            kernels["flash_bwd"][2].update(tail_splits=splits, num_sms=num_sms)
            kernels["flash_bwd_post_tail"] = (
                flash_bwd_post_tail,
                (seq_k, dim, groups, whole, split_items, splits, dtype),
                {"block_M": config["block_M"], "layout": layout},
            )
    else:  # two launches (flash_bwd's key_stride): no zeroing in the prep
        prep_kw.update(zero_dq=False)
        bwd_kw.update(key_stride=stride)
        kernels["flash_bwd_store"] = (flash_bwd, bwd_args, {**bwd_kw, "first_store": True})
        if stride > 1:  # key blocks left to add (p = 1: the first launch stored from all)
            kernels["flash_bwd"] = (flash_bwd, bwd_args, {**bwd_kw, "interleave": interleave})
    kernels["flash_bwd_post"] = (
        flash_bwd_post,
        (seq_q, seq_q_pad, dim, softmax_scale, dtype),
        {"block": config["block_N"], "layout": layout},
    )
    splits = config.get("head_splits", 1)
    if splits > 1:  # the float32 dK, dV parts, summed
        post_kv_args = (seq_k, dim, groups, splits, dtype)
        kernels["flash_bwd_post_kv"] = (flash_bwd_post_kv, post_kv_args, {"layout": layout})
    return kernels


def compile_all(batch, heads, seq_q, seq_k, dim, causal, dtype, arch, config=None):
    """Build the forward's and the backward's kernels for ``arch`` without a GPU; returns
    name → CUDA source."""
    harness = _harness()
    scale = 1.0 / math.sqrt(dim)
    fwd_cfg = fwd.default_config(dim, causal, arch, seq_k)
    kernels = {
        "flash_fwd": (fwd.flashattn_fwd, (seq_q, seq_k, dim, causal, scale, dtype), fwd_cfg),
        **backward_kernels(
            seq_q, seq_k, dim, causal, scale, dtype, config or default_config(dim, arch)
        ),
    }
    return {
        name: harness.compile_for(fn, arch, batch, heads, *args, **kw).get_kernel_source()
        for name, (fn, args, kw) in kernels.items()
    }


def _config_name(cfg):
    name = f"{cfg['block_M']}x{cfg['block_N']}/{cfg['num_stages']}st"
    return name + f"/{cfg['dq_stages']}dq"


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Sk = args.seq_len_k or Sq
    script = pathlib.Path(__file__).name
    if args.compile_only:
        cfg = default_config(D, args.arch)
        sources = compile_all(B, H, Sq, Sk, D, args.causal, args.dtype, args.arch)
        print(f"{script}: built for {args.arch} with {cfg}")
        for name, src in sources.items():
            print(harness.describe_source(name, src))
        return

    harness.require_gpu(script, capability=(9, 0))
    dtype = harness.DTYPES[args.dtype]
    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest backward is checked.
        named = {"tilelang " + _config_name(c): c for c in tune_configs(D)}
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
