"""FlashAttention forward, grouped-query attention (GQA), BSHD layout, TileLang on Hopper (SM90).

Computes ``O = softmax(Q Kᵀ · scale) V`` for ``q [B, Sq, H, D]`` and ``k, v [B, Sk, Hkv, D]``,
where each group of ``H / Hkv`` consecutive query heads shares one key/value head (query head
``h`` reads kv head ``h // groups``; ``Hkv = H`` is plain MHA, ``Hkv = 1`` is multi-query)
without ever materialising the Sq×Sk score matrix: each tile of ``block_M`` query rows streams K
and V through shared memory ``block_N`` keys at a time and keeps a running (online) softmax — the
row maximum ``scores_max`` and the row sum ``logsum`` — so the output is rescaled as larger scores
arrive. It also returns the log-sum-exp ``lse`` of each row, which the backward pass needs.

What it shows on Hopper (the schedule FlashAttention-3 uses, written out by hand):

- warp specialization: the last warpgroup is the producer, one warp of it issuing TMA loads of Q
  and of K and V into a ``num_stages``-deep ring in shared memory, with few registers
  (``setmaxnreg``); the other warpgroups are consumers, 64 query rows each, running WGMMA and
  the softmax with many;
- mbarriers ("full" / "empty" per buffer) are the only handshake between them;
- intra-warpgroup overlap: a consumer issues S = Q K(k)ᵀ and O += P(k-1) V(k-1) back to back as
  asynchronous WGMMA and runs the softmax of block k while the second one still runs; where
  tiles are short (``CROSS_TILE_BLOCKS``), across tiles as well: Q has two shared-memory
  slots, and the next tile's first S = Q Kᵀ is issued and its softmax run under this tile's
  last P V (``next_tile_under_last_pv``);
- turns at the tensor cores (FlashAttention-3's ping-pong, 192-row tiles at D=64): the three
  consumer warpgroups issue their GEMMs one after another, each waiting on its own named
  barrier and arriving on the next one's, so that one's GEMMs run under the others' softmax
  (``turn_wait``, ``turn_pass``);
- a persistent grid (one thread block per SM looping over tiles), so the next tile's loads run
  under the current tile's last GEMM and epilogue instead of waiting for a new block to start;
  causal tiles come from a global tile counter (an atomic add, as FlashAttention-3's
  scheduler): a thread block's producer takes its next tile, heaviest first, as it issues the
  last loads of the one before, and hands the index to the consumers beside that tile's Q
  (``counter_section``); at D=256, where the rounds come out even, they go in pairs of equal
  cost instead, a head's heaviest query block with its lightest (with an odd count, two heads
  together where the deal would keep handing the dear pair to the same SMs: ``tile_of``,
  ``heads_together``);
- thread-block clusters and TMA multicast (D=128 without causal): thread blocks go in pairs, a
  cluster of two walking neighbouring query blocks of one head, and each K/V block is loaded
  once into both by one multicast; the pair's own mbarrier (rank 1 arrives on rank 0's from
  across the cluster) says when both have freed the stage;
- split-KV where tiles would leave SMs idle (without causal the last round's, and every tile
  when there are fewer tiles than SMs, causal too): each such tile is walked as several parts
  over its key blocks, one a thread block, and a second kernel (``flashattn_fwd_combine``)
  merges a row's parts by their log-sum-exp;
- a tile's key blocks in two loops, those no query of the tile can mask out first, then those
  on the causal diagonal or past Sk, so that neither loop branches on the mask;
- the output leaves through shared memory and one TMA store; at D=256, where Q and the K/V ring
  fill shared memory, it is staged in V's ring, whose next load waits for the store to have
  read it (an mbarrier the consumers arrive on after the store).

Causal masking is aligned bottom-right (as FlashAttention ≥ 2.1): query ``i`` sees key ``j`` when
``j <= i + Sk - Sq``. A query row that sees no key at all gives ``O = 0`` and ``lse = +inf``.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, config=None)

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device;
        headdim 64, 128 or 256.
    k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device;
        nheads a multiple of nheads_k.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    return_lse: bool. Also return lse: (batch, nheads, seqlen_q), float32, the log-sum-exp
        (natural log) of each row of QKᵀ · softmax_scale.
    config: dict. Tile configuration (block_M, block_N, num_stages); default ``default_config``.
    Returns out: (batch, seqlen_q, nheads, headdim), or (out, lse) when return_lse.

Underneath, ``attention`` calls the custom operator ``tl_attn::gqa_fwd_bshd`` (``torch.library``),
so ``torch.compile(model, fullgraph=True)`` compiles a model around it without a graph break.

Run:
    python examples/flash_attention/example_gqa_fwd_bshd.py --groups 8 --causal
    python examples/flash_attention/example_gqa_fwd_bshd.py --compile-only --arch sm_90a  # no GPU
"""

import functools
import heapq
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
    # Every shared-memory sync is written in the kernel (the two of the epilogue; mbarriers do
    # the rest). Left to TileLang 0.1.15's ThreadSync pass, the D=256 epilogue, which stages O
    # in V's ring, fails to build on some grids ("a divergent region with 23 participating
    # threads" at B1 H33 S640 causal).
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
}
HEAD_DIMS = (64, 128, 256)
ARCHS = ("sm_90a",)  # --arch: Hopper only (TMA, WGMMA and setmaxnreg throughout)
PRODUCER_REGS = 24
O_STAGE = 8  # named barrier of the consumer warpgroups around the output's staging
TURNS = 9  # named barriers 9, 10, 11: the consumer warpgroups' turns at the tensor cores


# ----------------------------------------------------------------------------- kernel
MIN_PART_BLOCKS = 4  # key blocks a part walks at least (its Q load and epilogue are fixed costs)
MIN_SPLIT_WALK = 32  # key blocks the busiest thread block walks whole, at least, to take parts
PAIR_GAIN = 1.075  # heads_together: the busiest thread block's gain that pays for two heads
CROSS_TILE_BLOCKS = 16  # key blocks a tile has at most for Q's two slots (flashattn_fwd)
COUNTER_GAIN = 1.05  # counter_section at D=256: the modelled gain over the pair deal that pays
SECTION_BYTES = 16 << 20  # counter_section: K and V of a section's heads, to stay in L2


def kv_split_plan(num_tiles, num_sms, n_kv_blocks, causal):
    """How the persistent forward deals its tiles: ``(whole_tiles, split_tiles, kv_splits)``.

    Without causal every tile costs the same, so when ``num_tiles`` is not a multiple of the SMs
    the last round's ``num_tiles % num_sms`` tiles run while the other SMs idle (the one round,
    when there are fewer tiles than SMs). Those tiles are split over their keys instead: each
    into ``kv_splits`` parts of at least MIN_PART_BLOCKS key blocks (of the longest tile), one a
    thread block, as many as the SMs take. The first ``whole_tiles`` tiles are walked whole.
    Causal tiles differ in cost: with more tiles than SMs they are paired instead (see
    flashattn_fwd); with fewer, each is split the same way over its own key blocks.
    ``kv_splits`` 1: no split, also when the busiest thread block would walk fewer than
    MIN_SPLIT_WALK key blocks without parts.

    MIN_SPLIT_WALK, measured on an H200 (2026-11-29, bf16, one process): parts always shorten
    the GPU's time, but their buffers and second launch add about 25 µs of host time a call.
    A walk shorter than 32 key blocks (about 55 µs at D128) leaves the call host-bound, and
    parts made it slower: 2.2x at B1 H8 S1000 D128, 1.2-1.4x at B1 H17 S1000 and B1 H4 S2048;
    level at 32 blocks (B1 H2 S4096). Measured again once ``forward_plan`` had cut the call's
    host time by about half (same day and GPU): parts at a bound of 8 still lost, 0.64x, 0.70x
    and 0.97x on those three rows, their buffers and launch now adding 13-20 µs.

    MIN_PART_BLOCKS, measured on an H100 (2026-11-27, bf16 D128, one process): 2 and 8 against 4
    within 1% on the non-causal rows of 16k tokens (S1024 to S16384; two builds with the same
    plan differed by 1.1%); 8 lost 20% at Sq17 Sk4096 (4 parts a tile against 8), 2 gained 2%
    there (16 parts).
    """
    rounds, tail = divmod(num_tiles, num_sms)
    splits = 1
    if tail and not (causal and rounds) and (rounds + 1) * n_kv_blocks >= MIN_SPLIT_WALK:
        splits = max(1, min(num_sms // tail, n_kv_blocks // MIN_PART_BLOCKS))
    if splits == 1:
        return num_tiles, 0, 1
    return rounds * num_sms, tail, splits


def tile_of(t, num_m_blocks, heads, batch, causal, two_heads):
    """(query block, head, batch) of tile t, in flashattn_fwd's order (and its combine's).
    Tiles of one head are consecutive, so thread blocks running side by side share K/V in L2;
    causal, a head's query blocks alternate heaviest and lightest (7, 0, 6, 1, ... of 8), so
    that consecutive tiles pair up into equal costs. An odd count leaves each head's middle
    block unpaired (5 of 11); with ``two_heads`` (``heads_together``) two heads go together,
    the first's paired blocks, the second's, and the two middle blocks last, a pair of the
    same cost. (Without it the middle block pairs with the next head's first.)"""
    nm, flat = num_m_blocks, batch * heads

    def alternate(r):
        # r even: nm - 1 - r // 2, r odd: r // 2. Written as arithmetic: a select
        # (T.if_then_else) here trips TileLang 0.1.15's ThreadSync pass on some shapes.
        return r // 2 + (1 - r % 2) * (nm - 1 - r // 2 * 2)

    if not causal:
        m_blk, f = t % nm, t // nm
    elif not two_heads:
        m_blk, f = alternate(t % nm), t // nm
    else:
        pair, s = t // (2 * nm), t % (2 * nm)
        middle = s // (2 * nm - 2)  # 1 for the two middle blocks
        s_paired = s % (2 * nm - 2)
        second = (1 - middle) * (s_paired // (nm - 1)) + middle * s_paired
        m_pair = (1 - middle) * alternate(s_paired % (nm - 1)) + middle * (nm // 2)
        # An odd number of heads leaves the last one alone, in the plain order (its middle
        # block comes last there too).
        alone = t // ((flat - 1) * nm) if flat % 2 else 0
        m_blk = alone * alternate(t % nm) + (1 - alone) * m_pair
        f = alone * (t // nm) + (1 - alone) * (2 * pair + second)
    return m_blk, f % heads, f // heads


def causal_costs(seq_q, seq_kv, block_M, block_N):
    """Each query block's cost under the causal mask, for the models of the deal: the key
    blocks it walks (at least one, as ``key_blocks`` in flashattn_fwd), plus one for the
    tile's own work."""
    n_kv_blocks = -(-seq_kv // block_N)
    last_keys = [(m + 1) * block_M + seq_kv - seq_q for m in range(-(-seq_q // block_M))]
    return [max(1, min(n_kv_blocks, -(-key // block_N))) + 1 for key in last_keys]


def pair_deal_busiest(num_m_blocks, flat, grid, costs, two_heads):
    """The busiest thread block's cost when ``flat`` heads' causal tiles go in ``tile_of``'s
    order a pair at a time round-robin over ``grid`` thread blocks."""
    loads = [0] * grid
    for t in range(num_m_blocks * flat):
        loads[t // 2 % grid] += costs[tile_of(t, num_m_blocks, flat, 1, True, two_heads)[0]]
    return max(loads)


def heads_together(num_m_blocks, flat, grid, costs):
    """Whether the pairs of an odd block count go two heads at a time (``tile_of``), for
    ``flat`` heads (batch × heads) dealt a pair at a time round-robin over ``grid`` thread
    blocks; ``costs[m]``: query block m's cost (its key blocks, plus one for the tile's own
    work). Each head's middle block otherwise pairs with the next head's first, one dearer (or
    cheaper) pair every ``num_m_blocks``; where the deal brings those pairs to the same thread
    blocks round after round (11 or 33 blocks on 132 SMs) the slowest carries about 1.4× the
    mean. The two orders are weighed by the busiest thread block's cost, and two heads go
    together only where that gains ``PAIR_GAIN`` or more: below it the measured effect went
    both ways (``benchmarks/results/fwd_tile_order.md``)."""
    nm = num_m_blocks
    if nm % 2 == 0 or nm == 1 or flat == 1:
        return False
    busiest = pair_deal_busiest(nm, flat, grid, costs, False)
    return busiest >= PAIR_GAIN * pair_deal_busiest(nm, flat, grid, costs, True)


@functools.cache
def counter_section(batch, heads, heads_kv, seq_q, seq_kv, dim, causal, block_M, block_N, num_sms):
    """Heads a section of the tile counter's order holds, or 0 for the static pair deal.

    A causal grid of more tiles than SMs deals its tiles in pairs of equal cost round-robin;
    when the pairs do not fill the last round (B3 H45 S1000: 4.1 pairs a thread block), or an
    odd block count makes them unequal, the busiest thread block carries much more than the
    mean. A global counter hands out the tiles one at a time instead, to whichever thread block
    is free, heaviest first (longest processing time first) within sections of heads whose K and
    V fit ``SECTION_BYTES`` (they stay in L2 while the section runs; a group's query heads share
    theirs). At D=64 and D=128 every causal grid of more tiles than SMs takes the counter. At
    D=256 the two are weighed by a model of the busiest thread block (a tile's cost: its key
    blocks plus one), and the counter is taken where it gains ``COUNTER_GAIN`` or more.

    Measured on example_mha_fwd_bshd.py, the same kernel in BSHD (2026-11-28, H200, one process
    against the pairs; benchmarks/results/fwd_schedule_trials.md): 1.07-1.13x on six causal
    D=128 grids it takes (B3 H45 S1000 1.127, B2 H24 S6000 1.067, B1 H28 S3000 1.104, B3 H8
    S1000 1.069, B1 H33 S640 1.105, B2 H40 S3000 1.067). Where the pairs fill their rounds (16k
    tokens and 32 heads, 1.02-1.03 in the model) it measured 0.96-1.04x with 32 MB sections
    (FlashAttention-3's), 16 MB or 8 MB, no size better on every row; in SM cycles under Nsight
    Compute (2026-11-29, H200, launches repeating to 0.3%; benchmarks/results/kernel_cycles.md)
    the counter finished those grids in 2.2-3.5% fewer cycles at S=1024-4096 and 0.4% fewer at
    S=8192. At D=64 it measured 1.06-1.17x on six ragged grids (B3 H45 S1000 1.160, B1 H28 S3000
    1.132, B1 H20 S10000 1.168, B2 H36 S5000 1.064, fp16 B3 H8 S1000 1.068 and B2 H24 S4500
    1.091), and on the sweep's grids (16k tokens, 64 heads) 1.01-1.04x at S=2048-16384, level at
    S=1024 (0.998).

    At D=256 (2026-11-29, H200; the rows in example_mha_fwd_bshd.py's ``counter_section`` and
    benchmarks/results/fwd_d256.md): 1.14x where the model gives 1.18, 1.03-1.04x at 1.08,
    0.978-1.023x where the pairs fill their rounds (1.01-1.03 in the model): the pairs stay
    there."""
    nm, flat = -(-seq_q // block_M), batch * heads
    num_tiles = nm * flat
    if not causal or num_tiles <= num_sms:
        return 0
    cap = max(1, SECTION_BYTES * heads // (seq_kv * dim * 2 * 2 * heads_kv))
    section = max(d for d in range(1, min(cap, flat) + 1) if flat % d == 0)
    if dim in (64, 128):
        return section
    costs = causal_costs(seq_q, seq_kv, block_M, block_N)
    grid = min(num_sms, (num_tiles + 1) // 2)
    pairs = pair_deal_busiest(nm, flat, grid, costs, heads_together(nm, flat, grid, costs))
    free = [0] * num_sms  # when each thread block is next free (a heap)
    for _ in range(flat // section):
        for m in range(nm - 1, -1, -1):  # a section's tiles, heaviest query blocks first
            for _ in range(section):
                heapq.heapreplace(free, free[0] + costs[m])
    return section if pairs >= COUNTER_GAIN * max(free) else 0


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=128,
    num_stages=2,
    num_sms=132,  # an H100 SXM's; attention() passes the device's own count
):
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    offset = seq_kv - seq_q  # bottom-right causal alignment
    neg_inf = -T.infinity(accum_dtype)
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads_kv, dim]
    consumers = 2 * block_M  # one consumer warpgroup (128 threads) per 64 query rows
    # A thread block is given the 64K-register file at launch, a thread's share rounded down to
    # a multiple of 8; setmaxnreg only moves registers among its warps (a request beyond that
    # allocation waits forever). The producer keeps 24 a thread; the consumers share the rest
    # (multiples of 8, at most 240): 240 for two consumer warpgroups, 160 for three, 112 for four.
    regs = 65536 // (consumers + 128) // 8 * 8 * (consumers + 128)
    consumer_regs = min(240, (regs - 128 * PRODUCER_REGS) // consumers // 8 * 8)
    # O leaves through shared memory and one TMA store: its own buffer when Q, the K/V ring and
    # O all fit in the 227 KiB an SM gives a block (D ≤ 128); at D=256 the V ring, when it holds
    # exactly block_M rows (two stages of 64 keys); otherwise straight from registers, whose
    # pairs of 16-bit values fill half of each 32-byte sector they write.
    q_bytes = 2 * dim * block_M  # 16-bit elements; O's tile is as large
    q_kv_bytes = q_bytes + 2 * dim * 2 * num_stages * block_N
    o_via_smem = q_kv_bytes + q_bytes <= 227 * 1024
    o_in_v = not o_via_smem and num_stages * block_N == block_M
    # Short tiles (few key blocks) in a row: Q in two slots, so that the next tile's Q loads
    # while this tile runs and its first Q Kᵀ is issued under this tile's last P V
    # (``next_tile_under_last_pv``); where it fits beside O's buffer, and only for short key
    # ranges: with longer ones the tile boundary is rare and the second slot cost more than it
    # saved (``default_config``).
    n_kv_blocks = (seq_kv + block_N - 1) // block_N
    fits = q_kv_bytes + 2 * q_bytes <= 227 * 1024  # a second Q slot beside O's buffer
    q_slots = 2 if fits and n_kv_blocks <= CROSS_TILE_BLOCKS else 1

    # Persistent schedule: one thread block per SM walks a list of tiles (a tile = block_M query
    # rows of one head), so the producer loads the next tile's Q and K while the consumers
    # finish the last one. Causal tiles differ in cost; when there are more tiles than SMs they
    # go in pairs, the heaviest and the lightest query block of a head together (7+0, 6+1, ... of
    # 8): every pair costs the same and the round-robin deal of pairs stays balanced.
    num_m_blocks = (seq_q + block_M - 1) // block_M
    num_tiles = num_m_blocks * heads * batch
    # Causal grids of more tiles than SMs at D=64 and D=128, and at D=256 where the pairs would
    # leave a ragged last round, take their tiles one at a time from a global counter
    # (``counter_section``): ``dynamic``.
    section = counter_section(
        batch, heads, heads_kv, seq_q, seq_kv, dim, causal, block_M, block_N, num_sms
    )  # fmt: skip
    dynamic = section > 0
    tiles_per_unit = 2 if causal and num_tiles > num_sms and not dynamic else 1
    # Without causal every tile costs the same, and the tiles of a last round that leaves SMs
    # idle are split over their keys instead (``kv_split_plan``; causal too when there are fewer
    # tiles than SMs, each over its own key blocks): the first ``whole_tiles`` go
    # round-robin as whole tiles; each of the others is walked as ``kv_splits`` parts, one a
    # thread block, each over its share of the key blocks, leaving its normalised output and
    # lse in float32 (``O_part``, ``lse_part``) for ``flashattn_fwd_combine``.
    whole_tiles, split_tiles, kv_splits = kv_split_plan(num_tiles, num_sms, n_kv_blocks, causal)
    n_parts = split_tiles * kv_splits
    num_units = (whole_tiles + tiles_per_unit - 1) // tiles_per_unit
    grid = min(num_sms, max(num_units, n_parts))

    # D=128 without causal: thread blocks go in pairs (a cluster of two), and the two whole
    # tiles a pair walks at once are neighbouring query blocks of one head, so they read the
    # same K/V blocks: one TMA multicast loads each into both (``load_tile``), halving the K/V
    # traffic out of L2. Even counts keep every pair's two tiles whole and of one head (the
    # parts load their own). Not at D=64, whose 192-row tiles were slower so
    # (``default_config``), nor causal, where neighbouring query blocks see different keys.
    pairs = (
        not causal and dim == 128 and num_m_blocks % 2 == 0 and whole_tiles % 2 == 0
        and grid % 2 == 0 and n_parts % 2 == 0
    )  # fmt: skip

    def tile_index(cta, it):
        # The it-th tile of thread block cta: units dealt round-robin, a unit's tiles in a row.
        # Only the very last unit can be short (t >= num_tiles: no tile).
        return (cta + it // tiles_per_unit * grid) * tiles_per_unit + it % tiles_per_unit

    def key_blocks(m_blk):
        # Key blocks query block m_blk visits. At least one, even when no row sees a key
        # (causal, Sq > Sk): the consumers then write O = 0 and lse = +inf as for any empty row.
        if causal:
            last_key = (m_blk + 1) * block_M + offset  # one past the last key this block sees
            return T.max(1, T.min(T.ceildiv(seq_kv, block_N), T.ceildiv(last_key, block_N)))
        return T.ceildiv(seq_kv, block_N)

    # Odd block counts, in pairs: two heads together where the model of the deal says it pays
    # (``heads_together``; never with parts, which causal grids take only as single tiles).
    costs = causal_costs(seq_q, seq_kv, block_M, block_N)
    two_heads = tiles_per_unit == 2 and heads_together(num_m_blocks, heads * batch, grid, costs)

    def tile_coords(t):
        if dynamic:  # sections of heads, in each the heaviest query blocks first
            r = t % (section * num_m_blocks)
            f = t // (section * num_m_blocks) * section + r % section
            return num_m_blocks - 1 - r // section, f % heads, f // heads
        return tile_of(t, num_m_blocks, heads, batch, causal, two_heads)

    def first_masked_block(m_blk):
        # Only the ragged tail block (Sk % block_N) and, when causal, the blocks crossing the
        # diagonal need a mask; every key block before this one is used unmasked.
        if causal:
            return T.min(seq_kv // block_N, T.max(0, (m_blk * block_M + offset) // block_N))
        return seq_kv // block_N

    def key_bound():
        # Sk for the mask. Where keys are ragged, a constant Sk lets nvcc prove whole 16-column
        # slices of P zero in a masked block whose index is known too (a whole tile's last
        # block without causal), and skip their exponentials; but in a kernel that also walks
        # tiles in parts, or holds Q in two slots (short tiles), ptxas then serialises every
        # WGMMA of the kernel (warning C7511). There Sk is read through a warp shuffle, which
        # makes it no constant to either.
        if seq_kv % block_N == 0 or (kv_splits == 1 and q_slots == 1):
            return seq_kv
        return T.alloc_var("int32", init=T.shfl_sync(T.int32(seq_kv), 0))

    @T.macro
    def online_softmax(
        k, m_blk, masked, acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum
    ):
        # acc_s holds S = Q Kᵀ of key block k: mask it (``masked``), fold it into the running
        # row max and row sum, and turn it into P = exp2(S·scale - max·scale).
        if causal:
            if masked:
                # A row below Sq sees keys up to its index + offset <= Sk - 1: the causal
                # bound alone keeps every key past Sk out (rows past Sq are never stored).
                for i, j in T.Parallel(block_M, block_N):
                    visible = k * block_N + j <= m_blk * block_M + i + offset
                    acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], neg_inf)
        elif masked:
            kv_end = key_bound()
            for i, j in T.Parallel(block_M, block_N):
                visible = k * block_N + j < kv_end
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

    # Three consumer warpgroups (192-row tiles, D=64) take turns issuing their GEMMs, as
    # FlashAttention-3's: each waits for its turn on its own named barrier, issues, and hands
    # the turn to the next, so that one's GEMMs run under the others' softmax instead of all
    # three contending at once (``default_config`` has the measurements).
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
    def issue_scores(q, g, Q_shared, K_shared, k_full, acc_s):
        # S = Q Kᵀ for the key block at place g of the K/V stream (stage g % num_stages, Q in
        # slot q), issued asynchronously once its K has landed; the caller waits for it.
        stage = g % num_stages
        T.mbarrier_wait_parity(k_full[stage], (g // num_stages) & 1)
        T.wgmma_gemm(
            Q_shared[q, :, :],
            K_shared[stage, :, :],
            acc_s,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )

    @T.macro
    def issue_pv(g, V_shared, v_full, acc_s_cast, acc_o):
        # O += P V for the key block at place g, issued asynchronously once its V has landed.
        stage = g % num_stages
        T.mbarrier_wait_parity(v_full[stage], (g // num_stages) & 1)
        T.wgmma_gemm(acc_s_cast, V_shared[stage, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def key_block_step(
        k, g, m_blk, masked, q, Q_shared, K_shared, V_shared, k_full, v_full, k_empty, v_empty,
        acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale, scores_sum, logsum,
    ):  # fmt: skip
        # Key block k: issue S(k) = Q K(k)ᵀ and O += P(k-1) V(k-1) back to back
        # (asynchronous WGMMA), wait for S(k) only, and run its softmax while
        # P(k-1) V(k-1) still occupies the tensor cores.
        # g: key block k's place in the stream of K/V stages (kv_count + k)
        turn_wait()
        issue_scores(q, g, Q_shared, K_shared, k_full, acc_s)
        # V(k-1)'s wait comes after S(k)'s issue, under that GEMM: even a
        # landed load's wait costs cycles, idle tensor cores if spent first.
        issue_pv(g - 1, V_shared, v_full, acc_s_cast, acc_o)
        turn_pass()
        T.wait_wgmma(1)  # S(k) is ready; P(k-1) V(k-1) may still run
        T.barrier_arrive(k_empty[g % num_stages])
        online_softmax(
            k, m_blk, masked, acc_s, scores_max, scores_max_prev,
            scores_scale, scores_sum, logsum,
        )  # fmt: skip
        T.wait_wgmma(0)  # acc_o and acc_s_cast are free again
        T.barrier_arrive(v_empty[(g - 1) % num_stages])
        # Rescale what was accumulated under the old row max.
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]
        T.copy(acc_s, acc_s_cast)

    def part_coords(cta):
        # (query block, head, batch, first key block, key blocks) of the part thread block cta
        # walks: its share of its tile's key blocks, none when a causal tile has fewer blocks
        # than parts.
        m_blk, by, bz = tile_coords(whole_tiles + cta // kv_splits)
        n_blocks, p = key_blocks(m_blk), cta % kv_splits
        first = p * n_blocks // kv_splits
        return m_blk, by, bz, first, (p + 1) * n_blocks // kv_splits - first

    @T.macro
    def stage_free_in_pair(peer, stage, phase):
        # Before the multicast into both thread blocks of a pair: rank 1's consumers are done
        # with the stage (its producer has waited for that), and rank 1 says so on rank 0's
        # ``peer`` mbarrier; rank 0, whose own consumers are done too, waits for it.
        if T.block_rank_in_cluster() == 1:
            T.mbarrier_arrive(peer[stage], 0)
        else:
            T.mbarrier_wait_parity(peer[stage], phase)

    @T.macro
    def load_tile(
        m_blk, by, bz, first, n_blocks, kv_count, tile_count, Q, K, V, Q_shared, K_shared,
        V_shared, q_full, q_empty, k_full, v_full, k_empty, v_empty, o_free, peers=None,
        tile_ids=None, t=None,
    ):  # fmt: skip
        # Producer: the tile's Q, then K and V of key blocks first … first + n_blocks - 1;
        # ``peers``: with the other thread block of a pair, rank 0 issuing each K/V load as a
        # multicast into both (``cluster_mask``; rank 1 only posts the bytes it expects).
        # ``tile_ids``: with the counter, the tile's index t goes beside its Q, for the
        # consumers to read once Q has landed (the mbarrier's arrival publishes it).
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first
        # wait on an "empty" barrier (parity 1) passes at once.
        q = tile_count % q_slots
        T.mbarrier_wait_parity(q_empty[q], (tile_count // q_slots & 1) ^ 1)
        if tile_ids is not None and T.get_thread_binding() == consumers:
            tile_ids[q] = t
        # Rows past Sq read as zeros (TMA fills out-of-bounds), never stored.
        T.tma_copy(
            Q[bz, m_blk * block_M : (m_blk + 1) * block_M, by, :],
            Q_shared[q, :, :],
            barrier=q_full[q],
        )
        T.barrier_arrive(q_full[q])
        for k in T.serial(n_blocks):
            g = kv_count + k
            stage = g % num_stages
            phase = (g // num_stages) & 1
            key_block = first + k
            T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
            if peers is not None:
                stage_free_in_pair(peers[0], stage, phase)
            T.tma_copy(
                K[bz, key_block * block_N : (key_block + 1) * block_N, by // groups, :],
                K_shared[stage, :, :],
                barrier=k_full[stage],
                cluster_mask=None if peers is None else 0b11,
            )
            T.barrier_arrive(k_full[stage])
            if o_in_v and k == 0:
                # The last tile's O is staged in V's ring: its TMA store must have read it.
                T.mbarrier_wait_parity(o_free, (tile_count & 1) ^ 1)
            T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
            if peers is not None:
                stage_free_in_pair(peers[1], stage, phase)
            T.tma_copy(
                V[bz, key_block * block_N : (key_block + 1) * block_N, by // groups, :],
                V_shared[stage, :, :],
                barrier=v_full[stage],
                cluster_mask=None if peers is None else 0b11,
            )
            T.barrier_arrive(v_full[stage])

    @T.macro
    def start_tile(
        m_blk, first, first_is_masked, kv_count, tile_count, Q_shared, K_shared, q_full, k_full,
        k_empty, acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale, scores_sum,
        logsum,
    ):  # fmt: skip
        # A tile's first key block on its own: S = Q Kᵀ, its softmax; P waits in registers.
        T.fill(acc_o, 0)
        T.fill(logsum, 0)
        T.fill(scores_max, neg_inf)
        q = tile_count % q_slots
        T.mbarrier_wait_parity(q_full[q], tile_count // q_slots & 1)
        turn_wait()
        issue_scores(q, kv_count, Q_shared, K_shared, k_full, acc_s)
        turn_pass()
        T.wait_wgmma(0)
        T.barrier_arrive(k_empty[kv_count % num_stages])
        online_softmax(
            first, m_blk, first_is_masked, acc_s, scores_max, scores_max_prev,
            scores_scale, scores_sum, logsum,
        )  # fmt: skip
        T.copy(acc_s, acc_s_cast)  # P in 16 bits: the A operand of P V

    @T.macro
    def key_loops(
        m_blk, first, split, end, kv_count, tile_count, Q_shared, K_shared, V_shared, q_empty,
        k_full, v_full, k_empty, v_empty, acc_s, acc_s_cast, acc_o, scores_max,
        scores_max_prev, scores_scale, scores_sum, logsum,
    ):  # fmt: skip
        # Consumers: key blocks first + 1 … end - 1 of a tile, after its first; those from
        # ``split`` on take the mask: a constant, or a one-element local buffer (read in the
        # loop bounds themselves; see the kernel's ``split``). Two loops, so that neither
        # branches on the mask inside. Without causal a whole tile's bounds are constants, and
        # aligned keys need no masked loop.
        q = tile_count % q_slots
        for k in T.serial(first + 1, split if isinstance(split, int) else split[0]):
            key_block_step(
                k, kv_count + k - first, m_blk, False, q, Q_shared, K_shared, V_shared, k_full,
                v_full, k_empty, v_empty, acc_s, acc_s_cast, acc_o, scores_max,
                scores_max_prev, scores_scale, scores_sum, logsum,
            )  # fmt: skip
        if not isinstance(split, int) or split < end:  # a run-time bound, or blocks left
            for k in T.serial(split if isinstance(split, int) else split[0], end):
                key_block_step(
                    k, kv_count + k - first, m_blk, True, q, Q_shared, K_shared, V_shared,
                    k_full, v_full, k_empty, v_empty, acc_s, acc_s_cast, acc_o, scores_max,
                    scores_max_prev, scores_scale, scores_sum, logsum,
                )  # fmt: skip
        # Every Q Kᵀ of this tile is done: the producer may load a later tile's Q here.
        T.barrier_arrive(q_empty[q])

    @T.macro
    def last_pv(g, V_shared, v_full, v_empty, acc_s_cast, acc_o):
        # The tile's last P V on its own (g: its key block's place in the K/V stream).
        turn_wait()
        issue_pv(g, V_shared, v_full, acc_s_cast, acc_o)
        turn_pass()
        T.wait_wgmma(0)
        T.barrier_arrive(v_empty[g % num_stages])

    @T.macro
    def next_tile_under_last_pv(
        m_next, g, next_count, Q_shared, K_shared, V_shared, q_full, k_full, v_full, k_empty,
        v_empty, acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale,
        scores_sum, logsum,
    ):  # fmt: skip
        # Across tiles, as across key blocks: the next tile's first S = Q K(0)ᵀ is issued, then
        # this tile's last P V (g: its key block's place in the K/V stream), and the next
        # tile's first softmax runs while P V still occupies the tensor cores. The next tile's
        # Q is already in its slot. The row statistics start afresh (this tile's lse is out and
        # its row sums kept).
        q = next_count % q_slots
        T.fill(logsum, 0)
        T.fill(scores_max, neg_inf)
        T.mbarrier_wait_parity(q_full[q], next_count // q_slots & 1)
        turn_wait()
        issue_scores(q, g + 1, Q_shared, K_shared, k_full, acc_s)
        issue_pv(g, V_shared, v_full, acc_s_cast, acc_o)
        turn_pass()
        T.wait_wgmma(1)  # S is ready; P V may still run
        T.barrier_arrive(k_empty[(g + 1) % num_stages])
        online_softmax(
            0, m_next, first_masked_block(m_next) == 0, acc_s, scores_max, scores_max_prev,
            scores_scale, scores_sum, logsum,
        )  # fmt: skip
        T.wait_wgmma(0)
        T.barrier_arrive(v_empty[g % num_stages])
        # P in 16 bits now, so that S's registers are free again for this tile's epilogue.
        T.copy(acc_s, acc_s_cast)

    @T.macro
    def kernel_body(Q, K, V, Output, lse, O_part, lse_part, counter=None):
        with T.Kernel(
            grid, threads=consumers + 128, cluster_dims=(2, 1, 1) if pairs else None
        ) as cta:
            Q_shared = T.alloc_shared([q_slots, block_M, dim], dtype)
            K_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            if o_via_smem:
                O_shared = T.alloc_shared([block_M, dim], dtype)
            elif o_in_v:
                O_shared = T.view(V_shared, [block_M, dim])  # the ring's stages, row after row
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)
            row_sum = T.alloc_fragment([block_M], accum_dtype)  # a finished tile's, for its O

            # mbarriers between producer and consumers. "full": the producer warp's 32 threads
            # arrive and its TMA load completes the byte count; "empty": every consumer thread
            # arrives when it no longer reads the buffer. K and V stages have a pair each.
            q_full = T.alloc_barrier([32] * q_slots)
            q_empty = T.alloc_barrier([consumers] * q_slots)
            k_full = T.alloc_barrier([32] * num_stages)
            v_full = T.alloc_barrier([32] * num_stages)
            k_empty = T.alloc_barrier([consumers] * num_stages)
            v_empty = T.alloc_barrier([consumers] * num_stages)
            # o_in_v: every consumer thread arrives once O's store has read the V ring (the
            # thread that issued the store after waiting for it).
            o_free = T.alloc_barrier(consumers) if o_in_v else None
            tile_ids = None
            if dynamic:  # the index of the tile whose Q is in each slot
                tile_ids = T.alloc_shared([q_slots], "int32")
            peers = None
            if pairs:  # rank 1's producer warp arrives on rank 0's, one per K and V stage
                k_peer = T.alloc_cluster_barrier([32] * num_stages)
                v_peer = T.alloc_cluster_barrier([32] * num_stages)
                peers = (k_peer, v_peer)
            # Both sides count the key blocks and tiles they have been through, so each knows
            # which stage (g % num_stages) and barrier phase (g // num_stages) comes next.
            kv_count = T.alloc_var("int32")
            tile_count = T.alloc_var("int32")
            if causal:
                # The tile's first masked key block, held in a variable: as an expression in
                # the loop bounds, TileLang 0.1.15's ThreadSync pass rejects the epilogue's
                # shared-memory sync on some shapes ("a divergent region with 249
                # participating threads"). A part's, likewise.
                split = T.alloc_local([1], "int32")
            if kv_splits > 1:
                part_split = T.alloc_local([1], "int32")
            kv_count = 0
            tile_count = 0
            n_iter = T.ceildiv(num_units - cta, grid) * tiles_per_unit
            if dynamic:
                # With the counter, a side's tile and the next: the loops below run until the
                # counter has passed the last tile (``whole_tiles`` only bounds them).
                n_iter = whole_tiles
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
                        if t < whole_tiles:
                            m_blk, by, bz = tile_coords(t)
                            n_blocks = key_blocks(m_blk)
                            load_tile(
                                m_blk, by, bz, 0, n_blocks, kv_count, tile_count, Q, K, V,
                                Q_shared, K_shared, V_shared, q_full, q_empty, k_full, v_full,
                                k_empty, v_empty, o_free, peers, tile_ids, t,
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
                            if t_dyn >= whole_tiles:
                                T.loop_break()
                    if dynamic:
                        # None left: the consumers find an index past the last beside no Q.
                        q = tile_count % q_slots
                        T.mbarrier_wait_parity(q_empty[q], (tile_count // q_slots & 1) ^ 1)
                        if tx == consumers:
                            tile_ids[q] = t_dyn
                        T.barrier_arrive(q_full[q])
                    if kv_splits > 1 and cta < n_parts:
                        m_blk, by, bz, first, part_blocks = part_coords(cta)
                        if part_blocks > 0:
                            load_tile(
                                m_blk, by, bz, first, part_blocks, kv_count, tile_count, Q, K, V,
                                Q_shared, K_shared, V_shared, q_full, q_empty, k_full, v_full,
                                k_empty, v_empty, o_free,
                            )  # fmt: skip
            else:
                # ---------------------------------------------------------- consumer warpgroups
                T.set_max_nreg(consumer_regs, 1)
                if turns and tx < 128:  # the first warpgroup takes the first turn
                    T.named_barrier_arrive(TURNS, 256)
                if q_slots > 1 and n_iter > 0 and tile_index(cta, 0) < whole_tiles:
                    # The first tile's first key block on its own; every later tile's starts
                    # under the tile before it (``next_tile_under_last_pv``).
                    m_first = tile_coords(tile_index(cta, 0))[0]
                    start_tile(
                        m_first, 0, first_masked_block(m_first) == 0, kv_count, tile_count,
                        Q_shared, K_shared, q_full, k_full, k_empty, acc_s, acc_s_cast, acc_o,
                        scores_max, scores_max_prev, scores_scale, scores_sum, logsum,
                    )  # fmt: skip
                for it in T.serial(n_iter):
                    t = t_dyn if dynamic else tile_index(cta, it)
                    if t < whole_tiles:
                        m_blk, by, bz = tile_coords(t)
                        n_blocks = key_blocks(m_blk)
                        first_masked = first_masked_block(m_blk)
                        # Key blocks 1 … n_blocks - 1 from ``split`` on take the mask.
                        if causal:
                            split[0] = T.max(1, T.min(first_masked, n_blocks))
                        else:
                            split = max(1, min(first_masked, n_blocks))
                        if q_slots == 1:  # one Q slot: every tile starts on its own
                            start_tile(
                                m_blk, 0, first_masked == 0, kv_count, tile_count, Q_shared,
                                K_shared, q_full, k_full, k_empty, acc_s, acc_s_cast, acc_o,
                                scores_max, scores_max_prev, scores_scale, scores_sum, logsum,
                            )  # fmt: skip
                        key_loops(
                            m_blk, 0, split, n_blocks, kv_count, tile_count, Q_shared, K_shared,
                            V_shared, q_empty, k_full, v_full, k_empty, v_empty, acc_s,
                            acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale,
                            scores_sum, logsum,
                        )  # fmt: skip
                        # The tile's row statistics are final: its lse leaves now, its row
                        # sums wait for O.
                        for i in T.Parallel(block_M):
                            row_sum[i] = logsum[i]
                            if m_blk * block_M + i < seq_q:
                                lse[bz, by, m_blk * block_M + i] = T.if_then_else(
                                    logsum[i] > 0,
                                    (T.log2(logsum[i]) + scores_max[i] * scale) / LOG2E,
                                    T.infinity(accum_dtype),
                                )
                        g = kv_count + n_blocks - 1  # the last key block's place in the stream
                        if not dynamic:
                            t_next = tile_index(cta, it + 1)
                        elif q_slots > 1:  # the next tile's index, beside its Q (needed now)
                            qn = (tile_count + 1) % q_slots
                            T.mbarrier_wait_parity(q_full[qn], (tile_count + 1) // q_slots & 1)
                            t_next = tile_ids[qn]
                        if q_slots > 1 and it + 1 < n_iter and t_next < whole_tiles:
                            next_tile_under_last_pv(
                                tile_coords(t_next)[0], g, tile_count + 1, Q_shared, K_shared,
                                V_shared, q_full, k_full, v_full, k_empty, v_empty, acc_s,
                                acc_s_cast, acc_o, scores_max, scores_max_prev, scores_scale,
                                scores_sum, logsum,
                            )  # fmt: skip
                        else:
                            last_pv(g, V_shared, v_full, v_empty, acc_s_cast, acc_o)

                        # Normalise; rows with no visible key (row sum 0) give O = 0.
                        for i, j in T.Parallel(block_M, dim):
                            acc_o[i, j] = T.if_then_else(
                                row_sum[i] > 0, acc_o[i, j] / row_sum[i], 0
                            )
                        if o_via_smem or o_in_v:
                            # The last tile's store has read O_shared (its issuing thread
                            # waited for that); in V's ring, both warpgroups' last P V are done.
                            T.sync_threads(O_STAGE, consumers)
                            T.copy(acc_o, O_shared)
                            T.sync_threads(O_STAGE, consumers)  # every row is staged
                            T.copy(
                                O_shared, Output[bz, m_blk * block_M : (m_blk + 1) * block_M, by, :]
                            )
                            if o_in_v:
                                T.barrier_arrive(o_free)
                        else:  # guarded stores: rows past Sq are not written
                            T.copy(
                                acc_o, Output[bz, m_blk * block_M : (m_blk + 1) * block_M, by, :]
                            )
                        if q_slots > 1:
                            T.fill(acc_o, 0)  # the next tile's P V accumulates from zero
                        kv_count = kv_count + n_blocks
                        tile_count = tile_count + 1
                    if dynamic:
                        if q_slots == 1:
                            # The next tile's index, beside its Q: waited for only now, so
                            # that its load delays nothing of this tile's.
                            T.mbarrier_wait_parity(q_full[0], tile_count & 1)
                            t_next = tile_ids[0]
                        t_dyn = t_next
                        if t_dyn >= whole_tiles:
                            T.loop_break()
                if kv_splits > 1 and cta < n_parts:
                    # A part: its key blocks, then its output normalised by its own row sums
                    # and its lse (log2 units) in float32, every row of the tile. A row that
                    # sees none of the part's keys (or a part without key blocks) leaves
                    # O = 0 and lse = -inf: no weight in the merge.
                    m_blk, by, bz, first, part_blocks = part_coords(cta)
                    T.fill(logsum, 0)
                    if part_blocks > 0:
                        first_masked = first_masked_block(m_blk)
                        part_split[0] = T.max(first + 1, T.min(first_masked, first + part_blocks))
                        start_tile(
                            m_blk, first, first_masked <= first, kv_count, tile_count, Q_shared,
                            K_shared, q_full, k_full, k_empty, acc_s, acc_s_cast, acc_o,
                            scores_max, scores_max_prev, scores_scale, scores_sum, logsum,
                        )  # fmt: skip
                        key_loops(
                            m_blk, first, part_split, first + part_blocks, kv_count, tile_count,
                            Q_shared, K_shared, V_shared, q_empty, k_full, v_full, k_empty,
                            v_empty, acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev,
                            scores_scale, scores_sum, logsum,
                        )  # fmt: skip
                        last_pv(
                            kv_count + part_blocks - 1, V_shared, v_full, v_empty, acc_s_cast,
                            acc_o,
                        )  # fmt: skip
                    for i, j in T.Parallel(block_M, dim):
                        O_part[cta, i, j] = T.if_then_else(
                            logsum[i] > 0, acc_o[i, j] / logsum[i], 0
                        )
                    for i in T.Parallel(block_M):
                        lse_part[cta, i] = T.if_then_else(
                            logsum[i] > 0, T.log2(logsum[i]) + scores_max[i] * scale, neg_inf
                        )
            if pairs:
                # Neither thread block leaves while the other may still arrive on its barriers.
                T.cluster_sync()

    if dynamic:  # one more argument: the tile counter, zero at launch

        @T.prim_func
        def flash_fwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            Output: T.Tensor(q_shape, dtype),
            lse: T.Tensor([batch, heads, seq_q], accum_dtype),
            counter: T.Tensor([1], "int32"),
        ):
            kernel_body(Q, K, V, Output, lse, None, None, counter)

    elif kv_splits == 1:

        @T.prim_func
        def flash_fwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            Output: T.Tensor(q_shape, dtype),
            lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        ):
            kernel_body(Q, K, V, Output, lse, None, None)

    else:  # two more arguments: the parts' outputs and lse, for flashattn_fwd_combine

        @T.prim_func
        def flash_fwd(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype),
            Output: T.Tensor(q_shape, dtype),
            lse: T.Tensor([batch, heads, seq_q], accum_dtype),
            O_part: T.Tensor([n_parts, block_M, dim], accum_dtype),
            lse_part: T.Tensor([n_parts, block_M], accum_dtype),
        ):
            kernel_body(Q, K, V, Output, lse, O_part, lse_part)

    return flash_fwd


@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd_combine(
    batch, heads, seq_q, dim, causal, dtype, block_M, whole_tiles, split_tiles, kv_splits, rows=16
):
    """The split tiles' rows (``kv_split_plan``), each merged from its ``kv_splits`` parts.

    Part p of a row holds O_p, normalised by its own row sum, and lse_p, the log2 of that sum
    plus its row max (log2 units). With M = max_p lse_p and w_p = 2^(lse_p − M) the row is
    O = Σ w_p O_p / Σ w_p and lse = (M + log2 Σ w_p) / log2 e; a row no part saw (every lse_p
    −inf) gets O = 0 and lse = +inf. One thread block per ``rows`` rows of a split tile.
    """
    accum_dtype = "float32"
    num_m_blocks = (seq_q + block_M - 1) // block_M
    n_parts = split_tiles * kv_splits

    @T.prim_func
    def flash_fwd_combine(
        O_part: T.Tensor([n_parts, block_M, dim], accum_dtype),
        lse_part: T.Tensor([n_parts, block_M], accum_dtype),
        Output: T.Tensor([batch, seq_q, heads, dim], dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(split_tiles * (block_M // rows), threads=128) as bx:
            j, rb = bx // (block_M // rows), bx % (block_M // rows)  # split tile, rows in it
            # (never two heads together: causal tiles go in parts only when fewer than the SMs)
            m_blk, by, bz = tile_of(whole_tiles + j, num_m_blocks, heads, batch, causal, False)
            row0 = m_blk * block_M + rb * rows
            lse_max = T.alloc_fragment([rows], accum_dtype)
            weights = T.alloc_fragment([rows], accum_dtype)
            acc_o = T.alloc_fragment([rows, dim], accum_dtype)
            T.fill(lse_max, -T.infinity(accum_dtype))
            T.fill(weights, 0)
            T.fill(acc_o, 0)
            for p in T.serial(kv_splits):
                for i in T.Parallel(rows):
                    lse_max[i] = T.max(lse_max[i], lse_part[j * kv_splits + p, rb * rows + i])
            for i in T.Parallel(rows):  # a row no part saw: weights 0, out 0, lse +inf
                lse_max[i] = T.if_then_else(lse_max[i] == -T.infinity(accum_dtype), 0, lse_max[i])
            for p in T.serial(kv_splits):
                u = j * kv_splits + p
                for i, d in T.Parallel(rows, dim):
                    w = T.exp2(lse_part[u, rb * rows + i] - lse_max[i])
                    acc_o[i, d] += w * O_part[u, rb * rows + i, d]
                for i in T.Parallel(rows):
                    weights[i] += T.exp2(lse_part[u, rb * rows + i] - lse_max[i])
            for i, d in T.Parallel(rows, dim):
                if row0 + i < seq_q:  # rows past Sq are not written
                    Output[bz, row0 + i, by, d] = T.cast(
                        T.if_then_else(weights[i] > 0, acc_o[i, d] / weights[i], 0), dtype
                    )
            for i in T.Parallel(rows):
                if row0 + i < seq_q:
                    lse[bz, by, row0 + i] = T.if_then_else(
                        weights[i] > 0,
                        (lse_max[i] + T.log2(weights[i])) / LOG2E,
                        T.infinity(accum_dtype),
                    )

    return flash_fwd_combine


def default_config(dim, causal, arch="sm_90a", seq_len=None):
    """Tile configuration for a (head dim, causal, arch, key length ``seq_len``): the choices
    of example_mha_fwd_bshd.py's ``default_config``, whose docstring gives the measurements
    behind them (H100; this layout measured alike where it was timed).

    D=128: 128×128 tiles (two consumer warpgroups), two K/V stages; without causal and with
    Sk ≥ 8192, 160 keys a block; without causal, thread blocks in pairs that share each K/V
    block by TMA multicast (``pairs`` in flashattn_fwd). D=64: 192-row tiles (three consumer
    warpgroups at 160 registers, taking turns at the tensor cores: ``turns`` in flashattn_fwd,
    timed in the BSHD script), except causal with Sk ≤ 2048 (128 rows). D=256: 64 keys a block,
    two stages, O staged in the V ring and stored by TMA.
    """
    if not arch.startswith("sm_90"):
        raise ValueError(
            f"arch {arch}: this kernel is written for Hopper (sm_90a: TMA, WGMMA, setmaxnreg); "
            "for Blackwell see examples/flash_attention_sm100/"
        )
    if dim <= 64:
        if causal and seq_len is not None and seq_len <= 2048:
            return dict(block_M=128, block_N=128, num_stages=2)
        return dict(block_M=192, block_N=128, num_stages=2)
    if dim <= 128:
        wide = dim == 128 and not causal and seq_len is not None and seq_len >= 8192
        return dict(block_M=128, block_N=160 if wide else 128, num_stages=2)
    return dict(block_M=128, block_N=64, num_stages=2)


def tune_configs(dim):
    """The small space ``--tune`` compares (64 query rows per consumer warpgroup). D=256 keeps
    to two consumer warpgroups and 64 or 80 keys (shared memory); D=128 to two warpgroups (with
    a third, 512 threads, 192x128 tiles spill 324 bytes; 192x64 builds and measured slower,
    example_mha_fwd_bshd.py's ``default_config``)."""
    if dim > 128:
        return [
            dict(block_M=128, block_N=bn, num_stages=st) for bn, st in ((64, 1), (64, 2), (80, 2))
        ]
    rows = (64, 128, 192) if dim <= 64 else (64, 128)
    space = [
        dict(block_M=bm, block_N=bn, num_stages=st)
        for bm in rows
        for bn in (64, 128)
        for st in (1, 2)
    ]
    if dim == 128:  # the long-key default (O still in its own shared-memory buffer)
        space.append(dict(block_M=128, block_N=160, num_stages=2))
    return space


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
    if k.shape[0] != B or k.shape[3] != D:
        got = tuple(k.shape)
        raise ValueError(f"k must be [{B}, seqlen_k, heads_kv, {D}] to match q, got {got}")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv}): H % Hkv != 0")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


def attention_forward(q, k, v, causal, softmax_scale, config=None):
    """The kernel on checked, contiguous input: ``out`` and ``lse`` (what the operator runs)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to launch
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        dtype = "float16" if q.dtype == torch.float16 else "bfloat16"
        tiles = tuple(sorted(config.items())) if config else None
        launch = forward_plan(
            B, H, Hkv, Sq, Sk, D, bool(causal), float(softmax_scale), dtype, tiles, q.device
        )
        launch(q, k, v, out, lse)
    return out, lse


@functools.lru_cache(maxsize=256)
def forward_plan(B, H, Hkv, Sq, Sk, D, causal, softmax_scale, dtype, config, device):
    """``launch(q, k, v, out, lse)`` for one shape, settled on its first call: the tiles
    (``config``: the caller's as sorted (key, value) pairs, or None for ``default_config``), the
    device's SM count, how the tiles are dealt (``kv_split_plan``, ``counter_section``) and the
    builds as compiled entry points (``entry``): host work that only the shape decides, which a
    call of less GPU work than host work would otherwise pay every time."""
    measured = default_config(D, causal, device_arch(device), Sk)  # raises off Hopper
    cfg = dict(config) if config else measured
    block_M, block_N = cfg["block_M"], cfg["block_N"]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    kernel = entry(
        flashattn_fwd(B, H, Hkv, Sq, Sk, D, causal, softmax_scale, dtype, **cfg, num_sms=num_sms)
    )
    plan = kv_split_plan(-(-Sq // block_M) * H * B, num_sms, -(-Sk // block_N), causal)
    split_tiles, kv_splits = plan[1:]
    if counter_section(B, H, Hkv, Sq, Sk, D, causal, block_M, block_N, num_sms):

        def launch_counted(q, k, v, out, lse):  # the tiles from a counter, which starts at zero
            kernel(q, k, v, out, lse, torch.zeros(1, dtype=torch.int32, device=q.device))

        return launch_counted
    if kv_splits == 1:
        return kernel
    combine = entry(flashattn_fwd_combine(B, H, Sq, D, causal, dtype, block_M, *plan))
    n_parts = split_tiles * kv_splits

    def launch_in_parts(q, k, v, out, lse):  # the last round's tiles in parts, then merged
        o_part = q.new_empty(n_parts, block_M, D, dtype=torch.float32)
        lse_part = q.new_empty(n_parts, block_M, dtype=torch.float32)
        kernel(q, k, v, out, lse, o_part, lse_part)
        combine(o_part, lse_part, out, lse)

    return launch_in_parts


def entry(kernel):
    """A built kernel's compiled entry point, called with every argument in order (none of these
    kernels allocates an output). TileLang's call wrapper, which counts the arguments and builds
    the output list, costs host time on every launch; the entry point still checks each
    argument's shape, dtype and device."""
    executable = getattr(kernel.adapter, "get_exportable_executable", None)
    if executable is None:  # another execution backend: its own call
        return kernel
    module = executable()  # a built module, or (built in this process) one still to link
    if isinstance(module, tvm.runtime.Executable):
        module = module.jit()
    return module.main


# torch.compile: the kernel as a custom operator (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls it as one opaque node, without a graph break, and learns its outputs'
# shapes, dtypes and strides from the fake implementation. A config travels as its values in
# CONFIG_KEYS order (an operator takes no dicts; None: the default), so tuned tiles compile too.
CONFIG_KEYS = ("block_M", "block_N", "num_stages")


def operator_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    return attention_forward(q, k, v, causal, softmax_scale, cfg)


attention_forward_op = torch.library.custom_op(
    "tl_attn::gqa_fwd_bshd", operator_forward, mutates_args=()
)


@attention_forward_op.register_fake
def _(q, k, v, causal, softmax_scale, config):
    B, Sq, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, config=None):
    """GQA FlashAttention forward: ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` (fp16/bf16, CUDA).

    Returns ``out [B, Sq, H, D]``, and ``lse [B, H, Sq]`` (float32, natural log) when
    ``return_lse``. ``config`` overrides the tile configuration (see ``default_config``).
    """
    _check_inputs(q, k, v, causal, softmax_scale)
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
    out, lse = forward(q, k, v, causal, float(softmax_scale), tiles)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, causal=False, softmax_scale=None, return_lse=False):
    """Plain PyTorch in float32 (float64 inputs stay float64; runs on CPU too), same conventions
    as ``attention``."""
    acc = torch.promote_types(q.dtype, torch.float32)
    D = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    groups = q.shape[2] // k.shape[2]
    # Each kv head serves `groups` consecutive query heads.
    kf, vf = (einops.repeat(t.to(acc), "b s h d -> b s (h g) d", g=groups) for t in (k, v))
    qf = q.to(acc)
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
    parser = _harness().base_parser(__doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS)
    parser.add_argument("--groups", type=int, default=4, help="query heads per kv head")
    return parser


def _config_name(cfg):
    return "{block_M}x{block_N}/{num_stages}st".format(**cfg)


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
    script = pathlib.Path(__file__).name

    if args.compile_only:
        cfg = default_config(D, args.causal, args.arch, Sk)
        kernel = harness.compile_for(
            flashattn_fwd, args.arch, B, H, Hkv, Sq, Sk, D, args.causal, scale, args.dtype, **cfg
        )
        print(f"{script}: built for {args.arch} with {cfg}")
        print(harness.describe_source("flashattn_fwd", kernel.get_kernel_source()))
        return

    harness.require_gpu(script, capability=(9, 0))
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)

    def benchmark(configs):
        """Ours, one row per entry of ``configs`` (name → config), beside the peers."""
        ours = {
            name: lambda c=cfg: attention(q, k, v, args.causal, scale, config=c)
            for name, cfg in configs.items()
        }
        flops = harness.attention_flops(B, H, Sq, Sk, D, D, args.causal)
        peers = harness.sdpa_peers(q, k, v, args.causal, scale)
        title = f"forward B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} causal={args.causal} {args.dtype}"
        return harness.report(title, ours, peers, flops)

    config = None
    if args.tune:
        # Every tune_configs entry side by side in one report; the fastest is checked.
        named = {"tilelang " + _config_name(c): c for c in tune_configs(D)}
        config = named[harness.fastest(benchmark(named))]
        print(f"tuned: {config}")

    if args.check:
        out, lse = attention(q, k, v, args.causal, scale, return_lse=True, config=config)
        ref_out, ref_lse = ref_program(q, k, v, args.causal, scale, return_lse=True)
        print(f"check B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} causal={args.causal} {args.dtype}")
        harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
        harness.check_close("lse", lse, ref_lse, rtol=1e-3)  # fp32 statistics: tighter

    if args.bench and not args.tune:
        benchmark({"tilelang": config})


if __name__ == "__main__":
    main()
