"""Dense forward scripts: references, command lines, sm_90a builds, bad input (CPU) and the
correctness matrix of docs/CONVENTIONS.md ("Correctness") on a GPU (marker ``gpu``)."""

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_one_producer_warp, fresh_plans, load_script, record_launches

BSHD = "flash_attention/example_mha_fwd_bshd.py"
BHSD = "flash_attention/example_mha_fwd_bhsd.py"
GQA = "flash_attention/example_gqa_fwd_bshd.py"
SCRIPTS = [BSHD, BHSD, GQA]


def make_inputs(script, B, Sq, Sk, H, Hkv, D, dtype=torch.float32, device="cpu", scale=1.0):
    """q, k, v in the script's layout, normal random values times ``scale``."""
    g = torch.Generator(device=device).manual_seed(B * 1000 + Sq * 7 + Sk + D)
    if script == BHSD:
        shapes = [(B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)]
    else:
        shapes = [(B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)]
    return [(torch.randn(s, generator=g, device=device) * scale).to(dtype) for s in shapes]


def sdpa_math(q, k, v, causal, layout):
    """Torch's math SDPA with an explicit bottom-right causal mask, in the script's layout."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    mask = None
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2) if layout == "bshd" else out


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(33, 33), (17, 40), (5, 5)])
def test_reference_matches_sdpa_math(script, causal, Sq, Sk):
    mod = load_script(script)
    Hkv = 2 if script == GQA else 4
    q, k, v = make_inputs(script, 2, Sq, Sk, 4, Hkv, 32, dtype=torch.float64)
    out = mod.ref_program(q, k, v, causal=causal)
    ref = sdpa_math(q, k, v, causal, "bhsd" if script == BHSD else "bshd")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_lse_and_rows_without_keys(script):
    """Causal with Sq > Sk: the first Sq-Sk rows see no key → out 0, lse +inf (FA convention)."""
    mod = load_script(script)
    Sq, Sk = 9, 4
    q, k, v = make_inputs(script, 1, Sq, Sk, 2, 2, 16, dtype=torch.float64)
    out, lse = mod.ref_program(q, k, v, causal=True, return_lse=True)
    rows = out[:, :, : Sq - Sk] if script == BHSD else out[:, : Sq - Sk]
    assert torch.all(rows == 0)
    assert torch.all(torch.isposinf(lse[:, :, : Sq - Sk]))
    assert torch.all(torch.isfinite(lse[:, :, Sq - Sk :]))
    # the rest of lse is the log-sum-exp of the scaled, masked scores
    qh, kh = (t if script == BHSD else t.transpose(1, 2) for t in (q, k))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(16)
    mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    expect = scores.masked_fill(~mask, -math.inf).logsumexp(-1)
    torch.testing.assert_close(lse[:, :, Sq - Sk :], expect[:, :, Sq - Sk :])


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_softmax_scale(script):
    mod = load_script(script)
    q, k, v = make_inputs(script, 1, 8, 8, 2, 2, 16, dtype=torch.float64)
    a = mod.ref_program(q, k, v, softmax_scale=0.5)
    b = mod.ref_program(q * (0.5 * 4.0), k, v)  # default scale is 1/sqrt(16) = 1/4
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("script", SCRIPTS)
def test_causal_flag(script):
    parser = load_script(script).build_parser()
    assert parser.parse_args([]).causal is False
    assert parser.parse_args(["--causal"]).causal is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--causal", "False"])  # a store_true flag takes no value
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float32"])


def test_gqa_groups_must_divide_heads(capsys):
    mod = load_script(GQA)
    with pytest.raises(SystemExit):
        mod.main(["--heads", "32", "--groups", "5", "--compile-only"])
    assert "--groups" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script", SCRIPTS)
def test_main_without_gpu_says_so(script):
    with pytest.raises(SystemExit) as exc:
        load_script(script).main(["--seq_len", "128"])
    assert "--compile-only" in str(exc.value.code)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_default_config_builds_for_sm90_with_wgmma_and_tma(script, dim, causal):
    import harness

    mod = load_script(script)
    cfg = mod.default_config(dim, causal, "sm_90a")
    heads = (8, 2) if script == GQA else (8,)
    args = (2, *heads, 1000, 1000, dim, causal, 1 / math.sqrt(dim), "bfloat16")
    src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert "wgmma" in src, "T.gemm on shared operands should lower to WGMMA on sm_90a"
    assert "tma_load" in src, "T.copy of global tiles should lower to TMA loads on sm_90a"


@pytest.mark.parametrize("batch,heads,seq_len", [(2, 4, 1000), (2, 2, 4096)])
def test_causal_key_loops_build(batch, heads, seq_len):
    """The causal forward's two key loops (blocks without the mask, then with it) build on the
    shapes where their shared bound, written as an expression, made TileLang's ThreadSync pass
    reject the epilogue's shared-memory sync (grids of 64 and 128 tiles, one a thread block)."""
    import harness

    mod = load_script(BSHD)
    cfg = mod.default_config(128, True, "sm_90a", seq_len)
    args = (batch, heads, seq_len, seq_len, 128, True, 128**-0.5, "bfloat16")
    src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert src.count("wgmma_ss") >= 3  # S of the first block, then of each loop


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
def test_d256_output_staged_in_v_ring(script, causal):
    """At D=256, Q and the K/V ring fill shared memory, so O is staged in V's ring and leaves by
    TMA: the consumers wait for each other's last P V (a named barrier) before writing it there,
    arrive on ``o_free`` after the store has read it, and the producer waits on ``o_free``
    before a tile's first V load. No separate O buffer."""
    import harness

    mod = load_script(script)
    cfg = mod.default_config(256, causal, "sm_90a")
    heads = (16, 4) if script == GQA else (16,)
    args = (4, *heads, 1000, 1000, 256, causal, 256**-0.5, "bfloat16")
    kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
    src = kernel.get_kernel_source()
    q_kv_bytes = 2 * 256 * (cfg["block_M"] + 2 * cfg["num_stages"] * cfg["block_N"])
    assert harness.dynamic_smem_bytes(kernel) < q_kv_bytes + 2 * 256 * cfg["block_M"]
    producer_wait = src.index("o_free[0].wait(")
    assert producer_wait < src.index("tma_load(V_desc")  # the producer comes first
    ring_read = src.index(f"__sync_thread_partial({mod.O_STAGE}, 256)")
    stage = src.index("ptx_stmatrix", ring_read)
    store_wait = src.index("tma_store_wait<0, true>()", stage)
    assert src.index("o_free[0].arrive()", ring_read) > store_wait


def _grid_size(tir) -> int:
    return int(re.search(r'thread_binding\((\d+), thread="blockIdx.x"\)', tir.script()).group(1))


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "dim,causal,seq_len,threads,consumer_regs",
    [
        (64, False, 1024, 512, 160),  # three consumer warpgroups (192 rows) + the producer
        (64, True, 4096, 512, 160),
        (64, True, 2048, 384, 240),  # causal, Sk <= 2048: 128 rows (see default_config)
        (128, True, 4096, 384, 240),
        (256, False, 4096, 384, 240),
    ],
)
def test_warp_specialized_layout(script, dim, causal, seq_len, threads, consumer_regs):
    """Producer warpgroup with 24 registers, one warp of it issuing the loads (the "full"
    mbarriers count its 32 threads), consumers with what is left of the thread block's launch
    allocation (at most 240; tests/test_register_split.py), one thread block per SM, shared
    memory within an SM's 227 KB."""
    import harness

    mod = load_script(script)
    cfg = mod.default_config(dim, causal, "sm_90a", seq_len)
    heads = (8, 2) if script == GQA else (8,)
    args = (2, *heads, 1000, 1000, dim, causal, 0.125, "float16")
    kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
    src = kernel.get_kernel_source()
    assert f"__launch_bounds__({threads}, 1)" in src
    assert "warpgroup_reg_dealloc<24>" in src
    assert_one_producer_warp(src, threads - 128, ("q_full", "k_full", "v_full"))
    assert f"warpgroup_reg_alloc<{consumer_regs}>" in src
    assert (threads - 128) * consumer_regs + 128 * 24 <= 65536 // threads // 8 * 8 * threads
    assert harness.dynamic_smem_bytes(kernel) <= 227 * 1024
    assert src.count("wait_wgmma<1>") >= 1, "QKᵀ of block k overlaps PV of block k-1"


@pytest.mark.parametrize("script", SCRIPTS)
def test_persistent_grid(script):
    """One thread block per SM, fewer when there are fewer work units: tiles, or (causal, more
    tiles than SMs) pairs of tiles."""
    mod = load_script(script)
    heads = (8, 2) if script == GQA else (8,)
    cfg = dict(block_M=128, block_N=128, num_stages=2)

    def grid(B, S, causal, num_sms, Sk=None):
        tir = mod.flashattn_fwd.get_tir(
            B, *heads, S, Sk or S, 128, causal, 0.125, "float16", **cfg, num_sms=num_sms
        )
        return _grid_size(tir)

    assert grid(4, 4096, False, 132) == 132  # 1024 tiles
    assert grid(4, 4096, True, 114) == 114  # 1024 tiles from the counter; an H100 PCIe: 114 SMs
    # 8 heads x 4 query blocks over 32 key blocks: each tile in four parts, causal too (fewer
    # tiles than SMs: no pairs); over 8 key blocks the walk is too short for parts
    assert grid(1, 512, False, 132, 4096) == 8 * 4 * 4
    assert grid(1, 512, True, 132, 4096) == 8 * 4 * 4
    assert grid(1, 1000, False, 132) == 8 * 8
    # 192 tiles: not 96 pairs but all 132 SMs taking tiles from the counter (counter_section)
    assert grid(3, 1000, True, 132) == 132


@pytest.mark.parametrize("script", SCRIPTS)
def test_tile_order(script):
    """tile_of lists every (query block, head, batch) once, a head's blocks together (two
    heads' with two_heads, the count odd and causal); causal, every two consecutive tiles cost
    the same with two_heads: their query blocks add up to num_m_blocks - 1 (heaviest with
    lightest, middle with middle), but for a last head left alone. Without it a head's middle
    block pairs with the next head's first."""
    tile_of = load_script(script).tile_of
    for nm, heads, batch in itertools.product((1, 2, 3, 8, 11, 17), (1, 3, 4), (1, 2, 3)):
        flat = heads * batch
        for causal, two_heads in ((False, False), (True, False), (True, True)):
            two_heads = two_heads and nm % 2 == 1 and nm > 1 and flat > 1
            tiles = [tile_of(t, nm, heads, batch, causal, two_heads) for t in range(nm * flat)]
            assert sorted(tiles) == sorted(itertools.product(range(nm), range(heads), range(batch)))
            for t, (_, h, b) in enumerate(tiles):
                if two_heads and t < flat // 2 * 2 * nm:
                    assert (b * heads + h) // 2 == t // (2 * nm)
                else:
                    assert b * heads + h == t // nm
            if not causal or nm == 1:
                continue
            # tiles before a lone head (two_heads) or every head's own (plain, even count)
            alone = nm * flat - (nm if flat % 2 else 0) if two_heads else nm * flat
            if two_heads or nm % 2 == 0:
                for t in range(0, alone - 1, 2):
                    assert tiles[t][0] + tiles[t + 1][0] == nm - 1, (nm, heads, batch, t)
    # 11 query blocks: head 0's 10 paired blocks, head 1's, then both middle blocks (5);
    # without two_heads, head 0's middle block pairs with head 1's heaviest
    order = [tile_of(t, 11, 2, 1, True, True)[:2] for t in range(22)]
    assert order[:2] == [(10, 0), (0, 0)] and order[10:12] == [(10, 1), (0, 1)]
    assert order[20:] == [(5, 0), (5, 1)]
    plain = [tile_of(t, 11, 2, 1, True, False)[:2] for t in range(22)]
    assert plain[10:12] == [(5, 0), (10, 1)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_heads_together(script):
    """Two heads go together where the model of the deal gains PAIR_GAIN or more on the busiest
    thread block: 11 and 33 query blocks a head on 132 SMs (the middle pairs land on the same
    thread blocks every round), 9 blocks at B16 H32; not 63 blocks at B1 H32 (1.055 by the
    model), nor even counts, one block or one head."""
    module = load_script(script)

    def together(batch, heads, seq, block_M=128, sms=132):
        nm = -(-seq // block_M)
        costs = [min(-(-seq // 128), -(-(m + 1) * block_M // 128)) + 1 for m in range(nm)]
        grid = min(sms, -(-nm * batch * heads // 2))
        return module.heads_together(nm, batch * heads, grid, costs)

    assert together(12, 32, 1408) and together(4, 32, 4224) and together(16, 32, 1100)
    assert together(8, 64, 2048, block_M=192)
    assert not together(1, 32, 8000) and not together(2, 32, 3968)
    assert not together(4, 32, 4096) and not together(64, 1, 128) and not together(1, 1, 1408)


@pytest.mark.parametrize("script", SCRIPTS)
def test_kv_split_plan(script):
    """Which tiles go whole and which in parts over their keys (kv_split_plan): only without
    causal, only tiles of a last round that leaves SMs idle, parts of at least MIN_PART_BLOCKS
    key blocks, no more parts than SMs."""
    plan = load_script(script).kv_split_plan
    assert plan(4096, 132, 32, False) == (4092, 4, 8)  # 31 rounds, then 4 tiles in 8 parts
    assert plan(4096, 132, 128, False) == (4092, 4, 32)  # parts of 4 key blocks
    assert plan(4096, 132, 256, False) == (4092, 4, 33)  # no more parts than 132 SMs take
    assert plan(4096, 132, 32, True) == (4096, 0, 1)  # causal with more tiles than SMs: pairs
    assert plan(64, 132, 32, True) == (0, 64, 2)  # causal with fewer: parts of each tile's keys
    assert plan(1056, 132, 32, False) == (1056, 0, 1)  # whole rounds only
    assert plan(1024, 132, 32, False) == (1024, 0, 1)  # 100 tiles in the last round: no room
    assert plan(4096, 132, 7, False) == (4096, 0, 1)  # parts would have fewer than 4 blocks
    assert plan(4, 132, 32, False) == (0, 4, 8)  # fewer tiles than SMs: every tile in parts
    assert plan(32, 132, 32, False) == (0, 32, 4)
    # walks shorter than MIN_SPLIT_WALK: the call would be host-bound, parts would slow it
    assert plan(32, 132, 8, False) == (32, 0, 1)
    assert plan(136, 132, 8, False) == (136, 0, 1)  # two rounds of 8 key blocks
    assert plan(136, 132, 16, False) == (132, 4, 4)  # two rounds of 16


@pytest.mark.parametrize("script", SCRIPTS)
def test_split_tiles_build(script):
    """A grid with parts: the forward takes the parts' float32 outputs and lse, writes them from
    registers and spills nothing; the combine kernel builds for the same shape."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(script)
    heads = (4, 2) if script == GQA else (4,)
    cfg = mod.default_config(128, False, "sm_90a", 4000)
    args = (1, *heads, 17, 4000, 128, False, 128**-0.5, "bfloat16")
    kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
    src = kernel.get_kernel_source()
    assert "float* __restrict__ O_part" in src and "float* __restrict__ lse_part" in src
    report = ptxas_report(src)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    # 4 tiles (one query block of 4 heads), 32 key blocks: 8 parts each, 32 thread blocks
    assert mod.kv_split_plan(4, 132, 32, False) == (0, 4, 8)
    assert _grid_size(mod.flashattn_fwd.get_tir(*args, **cfg)) == 32
    combine = (1, 4, 17, 128, False, "bfloat16", cfg["block_M"], 0, 4, 8)
    src = harness.compile_for(mod.flashattn_fwd_combine, "sm_90a", *combine).get_kernel_source()
    assert "exp2" in src and "lse_part" in src


@pytest.mark.parametrize("script", SCRIPTS)
def test_ragged_keys_keep_the_wgmma_pipeline(script):
    """Sk not a multiple of block_N, without causal, on a grid that also walks tiles in parts
    (B4 H32 S4000: 4096 tiles, the last 4 in parts): Sk reaches the mask through a warp shuffle,
    and ptxas keeps the WGMMAs asynchronous. With Sk a constant there, nvcc proved P's last
    k-slices zero in each whole tile's last block and ptxas serialised every WGMMA (C7511)."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(script)
    heads = (32, 8) if script == GQA else (32,)
    cfg = mod.default_config(128, False, "sm_90a", 4000)
    assert mod.kv_split_plan(4096, 132, 32, False)[2] > 1
    args = (4, *heads, 4000, 4000, 128, False, 128**-0.5, "bfloat16")
    src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert re.search(r"__shfl_sync\([^;]*\b4000\b", src)
    report = ptxas_report(src)
    assert "Potential Performance Loss" not in report, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


@pytest.mark.parametrize("script", SCRIPTS)
def test_long_keys_take_160_key_blocks(script):
    """D=128 without causal and Sk >= 8192: 128x160 tiles (default_config); O keeps its own
    shared-memory buffer and TMA store, and ptxas keeps the WGMMAs asynchronous, no spills."""
    from test_flash_bwd_fast import SMEM_LIMIT, ptxas_report

    import harness

    mod = load_script(script)
    assert mod.default_config(128, False, "sm_90a", 8192)["block_N"] == 160
    assert mod.default_config(128, False, "sm_90a", 4096)["block_N"] == 128
    assert mod.default_config(128, True, "sm_90a", 16384)["block_N"] == 128
    assert mod.default_config(64, False, "sm_90a", 16384)["block_N"] == 128
    cfg = mod.default_config(128, False, "sm_90a", 8192)
    heads = (32, 8) if script == GQA else (32,)
    args = (2, *heads, 8192, 8192, 128, False, 128**-0.5, "bfloat16")
    kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
    src = kernel.get_kernel_source()
    assert "tma_store" in src
    report = ptxas_report(src)
    assert "Potential Performance Loss" not in report, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    static = int(re.search(r"(\d+) bytes smem", report).group(1))
    assert harness.dynamic_smem_bytes(kernel) + static <= SMEM_LIMIT


@pytest.mark.parametrize("script", SCRIPTS)
def test_d128_pairs_share_kv_by_multicast(script):
    """D=128 without causal: thread blocks in clusters of two, each K/V block loaded once
    into both by a TMA multicast after the pair's own mbarrier handshake, a cluster sync before
    leaving; ptxas keeps the WGMMAs asynchronous, no spills. Not causal, not at D=64, not with
    an odd number of query blocks a head."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(script)
    heads = (32, 8) if script == GQA else (32,)

    def build(B, S, D, causal):
        cfg = mod.default_config(D, causal, "sm_90a", S)
        return (B, *heads, S, S, D, causal, D**-0.5, "bfloat16"), cfg

    for B, S, D, causal in [(4, 4096, 128, True), (4, 4096, 64, False), (2, 1100, 128, False)]:
        args, cfg = build(B, S, D, causal)
        tir = mod.flashattn_fwd.get_tir(*args, **cfg).script()
        assert "cluster_mask" not in tir and "cluster_dims" not in tir, (B, S, D, causal)
    args, cfg = build(4, 4096, 128, False)
    src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert src.count("tma_load_multicast") == 2  # K and V, by rank 0
    assert src.count("block_rank_in_cluster() == 1") == 2  # rank 1 arrives on rank 0's mbarrier
    assert src.count("cluster_sync()") == 2  # after the mbarriers' init, before leaving
    report = ptxas_report(src)
    assert "Potential Performance Loss" not in report, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


@pytest.mark.parametrize("script", SCRIPTS)
def test_counter_section(script):
    """Causal D=64 and D=128: the tile counter on every grid of more tiles than SMs (ragged
    ones, B3 H45 S1000, B2 H24 S6000, Sq != Sk, and the sweep's), in sections of heads whose
    K/V fit SECTION_BYTES (dividing the heads; in GQA a group's query heads share theirs).
    At D=256 only where the model of the pair deal leaves a ragged last round (COUNTER_GAIN).
    Never without causal, or with fewer tiles than SMs."""
    mod = load_script(script)

    def section(B, H, Sq, Sk, D=128, causal=True, groups=1):
        cfg = mod.default_config(D, causal, "sm_90a", Sk)
        heads = (H, H // groups) if script == GQA else (H,)
        blocks = cfg["block_M"], cfg["block_N"]
        return mod.counter_section(B, *heads, Sq, Sk, D, causal, *blocks, 132)

    assert section(3, 45, 1000, 1000) == 27  # 135 heads of 0.5 MB: the largest divisor ≤ 32
    assert section(2, 24, 6000, 6000) == 4  # 3 MB a head: ≤ 5 heads, dividing 48
    assert section(2, 45, 700, 1000) > 0 and section(2, 45, 1000, 700) > 0
    for S in (1024, 2048, 4096, 8192, 16384):
        # K and V of a head are S * 512 bytes at D=128 (S * 256 at D=64); 16 MB hold 32768 // S
        # (65536 // S) of the 2^19 // S (2^20 // S) heads
        assert section(16384 // S, 32, S, S) == 32768 // S, S
        assert section(16384 // S, 64, S, S, D=64) == 65536 // S, S
    assert section(3, 45, 1000, 1000, D=64) == 45  # 0.25 MB a head: the largest divisor ≤ 65
    # D=256, 128 x 64 tiles: 45 heads of 8 blocks, 1.8 pairs a thread block (1.18 in the
    # model), and 20 heads of 24 (1.08) take the counter; 16k tokens and 16 heads (1.01-1.03),
    # and two heads' pairs of 5 blocks (B1 H99 S640), keep the pairs
    assert section(3, 15, 1000, 1000, D=256) == 15
    assert section(1, 20, 3000, 3000, D=256) > 0
    for S in (1024, 2048, 4096):
        assert section(16384 // S, 16, S, S, D=256) == 0, S
    assert section(1, 99, 640, 640, D=256) == 0
    for D in (64, 128):
        assert section(3, 45, 1000, 1000, D=D, causal=False) == 0
        assert section(1, 4, 1000, 1000, D=D) == 0
    if script == GQA:  # five query heads share a kv head: 0.1 MB a query head, all 135 fit
        assert section(3, 45, 1000, 1000, groups=5) == 135


@pytest.mark.parametrize("script", SCRIPTS)
def test_counter_builds(script):
    """The counter's kernel: one atomic add a tile (the producer's, its result shuffled to the
    warp), the tile's index written beside its Q, the loops left by a break and bounded by the
    tile count (a thread block may take more than its share of the pairs); a sixth argument;
    no spills, the WGMMAs asynchronous; with one Q slot (S=3000, S=16384) and two (S=1000,
    S=1024), at D=128 and D=64."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(script)
    for B, H, S, D in [
        (3, 45, 1000, 128),
        (1, 28, 3000, 128),
        (16, 64, 1024, 64),
        (1, 64, 16384, 64),
    ]:
        cfg = mod.default_config(D, True, "sm_90a", S)
        heads = (H, H // (5 if H == 45 else 4)) if script == GQA else (H,)
        args = (B, *heads, S, S, D, True, D**-0.5, "bfloat16")
        kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
        src = kernel.get_kernel_source()
        assert src.count("AtomicAddRet(") == 1 and "__shfl_sync" in src, S
        assert src.count("tile_ids)[") == 3, S  # written (a tile's, none left), read once
        assert src.count("break;") == 2, S
        num_tiles = B * H * -(-S // cfg["block_M"])
        assert src.count(f"it < {num_tiles};") == 1 and src.count(f"it_1 < {num_tiles};") == 1, S
        assert len(mod.flashattn_fwd.get_tir(*args, **cfg).params) == 6
        report = ptxas_report(src)
        assert "Potential Performance Loss" not in report, report
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("dim, causal", [(128, True), (64, False)])
def test_short_tiles_start_under_the_last_pv(script, dim, causal):
    """With few key blocks a tile (Sk 1024), Q has two shared-memory slots and the next tile's
    first Q Kᵀ is issued under this tile's last P V: one more WGMMA wait that leaves a GEMM in
    flight than with long tiles (Sk 4096, one slot, every tile started on its own); both build
    without spills or serialised WGMMAs."""
    from test_flash_bwd_fast import assert_clean_build

    import harness

    mod = load_script(script)
    heads = (32, 8) if script == GQA else (32,)
    built = {}
    for S in (1024, 4096):
        cfg = mod.default_config(dim, causal, "sm_90a", S)
        args = (16384 // S, *heads, S, S, dim, causal, dim**-0.5, "bfloat16")
        kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
        src = kernel.get_kernel_source()
        regs = int(re.search(r"warpgroup_reg_alloc<(\d+)>", src).group(1))
        assert_clean_build(kernel, 2 * cfg["block_M"] + 128, 24, regs)
        built[S] = (src.count("wait_wgmma<1>"), harness.dynamic_smem_bytes(kernel))
    assert cfg["block_M"] == mod.default_config(dim, causal, "sm_90a", 1024)["block_M"]
    q_bytes = 2 * dim * cfg["block_M"]
    assert built[1024] == (built[4096][0] + 1, built[4096][1] + q_bytes)


@pytest.mark.parametrize("script", SCRIPTS)
def test_d64_warpgroups_take_turns(script):
    """192-row tiles (D=64, three consumer warpgroups) issue their GEMMs in turns: each GEMM
    issue sits between a wait on the warpgroup's own named barrier (9, 10, 11) and an arrival
    on the next one's, the first warpgroup arriving once on its own to start; 128-row tiles
    (D=64 causal at S <= 2048, and D=128) have no turns. Both build without spills."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(script)
    heads = (32, 8) if script == GQA else (32,)
    for D, S, causal, turns in [
        (64, 4096, False, True),
        (64, 1024, True, False),
        (128, 4096, True, False),
    ]:
        cfg = mod.default_config(D, causal, "sm_90a", S)
        assert (cfg["block_M"] == 192) == turns
        args = (16384 // S, *heads, S, S, D, causal, D**-0.5, "bfloat16")
        src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
        waits = src.count("__sync_thread_partial(((((int)threadIdx.x) >> 7) + 9), 256);")
        passes = src.count(
            "__named_barrier_arrive(((((((int)threadIdx.x) >> 7) + 1) % 3) + 9), 256);"
        )
        assert waits == passes and (waits > 0) == turns, (D, S, causal)
        assert src.count("__named_barrier_arrive(9, 256);") == int(turns)
        report = ptxas_report(src)
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
        assert "Potential Performance Loss" not in report, report


@pytest.mark.parametrize(
    "dim,seq_q,seq_k,shuffled",
    [(128, 3000, 3000, False), (64, 1000, 777, True), (128, 1000, 1500, True)],
    ids=["D128-S3000-one-slot", "D64-Sk777-two-slots", "D128-Sk1500-two-slots"],
)
def test_ragged_keys_without_parts_keep_the_wgmma_pipeline(dim, seq_q, seq_k, shuffled):
    """Ragged keys, no split (B2 H32). With one Q slot (S3000: 24 key blocks a tile) Sk stays a
    constant, so nvcc skips the exponentials of the last block's masked columns. Short tiles (at
    most ``CROSS_TILE_BLOCKS`` key blocks) hold Q in two slots, and there a constant Sk made
    ptxas serialise every WGMMA (C7511): Sk reaches the mask through a warp shuffle. Either way
    the WGMMAs stay asynchronous and nothing spills."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(BSHD)
    cfg = mod.default_config(dim, False, "sm_90a", seq_k)
    n_tiles = -(-seq_q // cfg["block_M"]) * 32 * 2
    assert mod.kv_split_plan(n_tiles, 132, -(-seq_k // cfg["block_N"]), False)[2] == 1
    args = (2, 32, seq_q, seq_k, dim, False, dim**-0.5, "bfloat16")
    src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert bool(re.search(rf"__shfl_sync\([^;]*\b{seq_k}\b", src)) == shuffled
    report = ptxas_report(src)
    assert "Potential Performance Loss" not in report, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


@pytest.mark.parametrize("script", SCRIPTS)
def test_odd_count_builds(script):
    """Causal grids of an odd block count build for sm_90a without spills: at D=256 in pairs of
    two heads (B1 H99 S640: 5 blocks a head, a last head alone: heads_together says so, and the
    program holds tile_of's two-head order, the only one with a lone last head) and, with fewer
    tiles than SMs, in parts with the plain order (D=128 B1 H2 Sq1100 Sk4100: 9 blocks a head
    over 33 key blocks; two heads together there failed to build in TileLang 0.1.15)."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(script)
    for dim, heads, seq, seq_k in ((256, 99, 640, 640), (128, 2, 1100, 4100)):
        heads = (heads, 1 if heads % 2 else heads // 2) if script == GQA else (heads,)
        cfg = mod.default_config(dim, True, "sm_90a", seq_k)
        args = (1, *heads, seq, seq_k, dim, True, dim**-0.5, "bfloat16")
        kernel = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg)
        src = kernel.get_kernel_source()
        report = ptxas_report(src)
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
        assert ("float* __restrict__ O_part" in src) == (seq == 1100)
        # the lone head starts after 98 heads of 5 blocks: tile t // 490 (two heads only)
        program = mod.flashattn_fwd.get_tir(*args, **cfg).script()
        assert ("// 490" in program) == (seq == 640)


def test_hopper_only():
    """Another arch: a clear error from default_config and from --compile-only."""
    mod = load_script(BSHD)
    with pytest.raises(ValueError, match="Hopper"):
        mod.default_config(128, False, "sm_100a")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--compile-only", "--arch", "sm_100a"])
    assert exc.value.code == 2  # argparse's usage error


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_tune_space_builds_for_sm90(dim):
    import harness

    mod = load_script(BSHD)
    for cfg in mod.tune_configs(dim):
        args = (1, 4, 512, 512, dim, True, 1 / math.sqrt(dim), "float16")
        src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
        assert "wgmma" in src, cfg


@pytest.mark.parametrize("script", SCRIPTS)
def test_compile_only_main(script, capsys):
    load_script(script).main(["--compile-only", "--seq_len", "255", "--dim", "64"])
    out = capsys.readouterr().out
    assert "built for sm_90a" in out and "wgmma" in out


def _bad_inputs(script):
    """(description, q, k, v, expected message fragment) for every rejected input."""
    q, k, v = make_inputs(script, 1, 16, 16, 4, 2 if script == GQA else 4, 64, torch.float16)
    seq_dim = 2 if script == BHSD else 1
    cases = [
        ("float32", q.float(), k, v, "float16 or bfloat16"),
        ("mixed dtypes", q, k.bfloat16(), v, "share a dtype"),
        ("rank 3", q[0], k, v, "q must be"),
        ("k/v shapes differ", q, k, v.narrow(seq_dim, 0, 8), "same shape"),
        ("head dim 48", q[..., :48], k[..., :48], v[..., :48], "head dim"),
        ("head dim mismatch", q, k[..., :32], v[..., :32], "k must be"),
        (
            "strided last dim",
            q,
            k.transpose(-1, -2).contiguous().transpose(-1, -2),
            v,
            "last dimension",
        ),
        ("CPU tensors", q, k, v, "CUDA tensor"),
    ]
    if script == GQA:
        q3 = make_inputs(script, 1, 16, 16, 3, 2, 64, torch.float16)[0]
        cases.append(("H % Hkv", q3, k, v, "H % Hkv"))
    else:
        head_dim = 1 if script == BHSD else 2
        k2, v2 = (t.narrow(head_dim, 0, 2) for t in (k, v))
        cases.append(("MHA given fewer kv heads", q, k2, v2, "heads"))
    return cases


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_raises_value_error_naming_argument(script):
    mod = load_script(script)
    for what, q, k, v, fragment in _bad_inputs(script):
        with pytest.raises(ValueError, match=fragment):
            mod.attention(q, k, v)
            pytest.fail(f"accepted bad input: {what}")


def test_poisoned_empty_fixture_poisons(poisoned_empty):
    """The GPU tests rely on this: an output element the kernel never writes reads NaN."""
    assert torch.isnan(torch.empty(64)).all()


@pytest.mark.parametrize("script", SCRIPTS)
def test_forward_plan_is_settled_once_a_shape(script, monkeypatch):
    """attention_forward's plan (``forward_plan``): a shape's first call builds its kernels and
    deals its tiles, later calls of the shape only launch; a caller's tiles build again. Its
    launches: whole tiles (q, k, v, out, lse); tiles in parts (the parts' float32 outputs
    after them, then the combine over those); tiles from a counter (a zero int32 counter after
    them). The kernels are recorded stand-ins on CPU tensors, the device an H100's."""
    mod = load_script(script)
    factories = (mod, "flashattn_fwd"), (mod, "flashattn_fwd_combine")
    builds, launches = record_launches(monkeypatch, *factories)
    with fresh_plans(mod.forward_plan):
        check_forward_plan(script, mod, builds, launches)


def check_forward_plan(script, mod, builds, launches):
    """The body of the test above, with its stand-ins in place."""

    def call(B, Sq, Sk, H, Hkv, causal=False, config=None):
        q, k, v = make_inputs(script, B, Sq, Sk, H, Hkv, 128, dtype=torch.bfloat16)
        out, lse = mod.attention_forward(q, k, v, causal, 128**-0.5, config)
        return (q, k, v, out, lse), launches[-1]

    Hkv = 2 if script == GQA else 8
    # 128 tiles of 8 key blocks: one round, whole (a walk too short for parts)
    for _ in range(2):
        tensors, (name, launched) = call(2, 1000, 1000, 8, Hkv)
        assert name == "flashattn_fwd" and all(
            a is b for a, b in zip(launched, tensors, strict=True)
        )
        assert len(launched) == 5
    assert len(builds) == 1 and builds[0][2]["num_sms"] == 132
    cfg = dict(builds[0][2], block_N=64)
    del cfg["num_sms"]
    call(2, 1000, 1000, 8, Hkv, config=cfg)
    assert len(builds) == 2 and builds[1][2]["block_N"] == 64
    # 4 tiles of 32 key blocks: 8 parts each, then the combine over the 32 parts
    tensors, _ = call(1, 17, 4000, 4, 2 if script == GQA else 4)
    (name, launched), (merge, merged) = launches[-2:]
    assert (name, merge) == ("flashattn_fwd", "flashattn_fwd_combine")
    o_part, lse_part = launched[5:]
    assert o_part.shape == (32, 128, 128) and lse_part.shape == (32, 128)
    assert o_part.dtype == lse_part.dtype == torch.float32
    assert all(a is b for a, b in zip(merged, (o_part, lse_part, *tensors[3:]), strict=True))
    assert builds[-1][0] == "flashattn_fwd_combine" and builds[-1][1][-3:] == (0, 4, 8)
    # causal, 3 x 45 heads of 8 query blocks: tiles from a counter that starts at zero
    _, (name, launched) = call(3, 1000, 1000, 45, 45, causal=True)
    assert name == "flashattn_fwd" and len(launched) == 6
    assert launched[5].dtype == torch.int32 and launched[5].tolist() == [0]


# ----------------------------------------------------------------------------- GPU
def _gpu_cases():
    """A covering set of the shapes docs/CONVENTIONS.md requires: every S, D, causal, dtype,
    group count and Sq != Sk appear, without the full cartesian product (each case compiles its
    own kernel)."""
    f16, bf16 = torch.float16, torch.bfloat16
    cases = []  # (script, B, Sq, Sk, H, Hkv, D, causal, dtype, input scale)
    for D in (64, 128, 256):
        for S in (1, 17, 255, 1000):
            for causal in (False, True):
                dtype = (f16, bf16)[(S + D // 64 + causal) % 2]
                cases.append((BSHD, 1 if S in (1, 1000) else 2, S, S, 4, 4, D, causal, dtype, 1))
    for causal in (False, True):
        for dtype in (f16, bf16):
            cases.append((BSHD, 2, 4096, 4096, 2, 2, 128, causal, dtype, 1))
    cases += [
        (BSHD, 2, 255, 1000, 4, 4, 128, True, f16, 1),  # fewer queries: all see the prefix
        (BSHD, 1, 1000, 255, 4, 4, 64, True, bf16, 1),  # more queries: 745 rows see no key
        (BSHD, 1, 17, 4096, 4, 4, 128, False, bf16, 1),
        (BSHD, 2, 1000, 17, 2, 2, 256, True, f16, 1),
        (BSHD, 2, 1000, 1000, 4, 4, 128, True, bf16, 10),  # large logits
        (BSHD, 2, 1000, 1000, 4, 4, 64, False, f16, 10),
    ]
    for D in (64, 128, 256):
        for S in (17, 1000):
            for causal in (False, True):
                dtype = (f16, bf16)[(S + D // 64 + causal) % 2]
                cases.append((BHSD, 2 if S == 17 else 1, S, S, 4, 4, D, causal, dtype, 1))
    cases += [
        (BHSD, 2, 255, 1000, 4, 4, 128, True, bf16, 1),
        (BHSD, 1, 1000, 255, 4, 4, 128, True, f16, 1),
    ]
    for groups in (1, 2, 4, 8, 16):
        for causal in (False, True):
            S = 1000 if causal else 255
            dtype = (f16, bf16)[(groups + causal) % 2]
            cases.append((GQA, 2, S, S, 16, 16 // groups, 128, causal, dtype, 1))
    cases += [
        (GQA, 1, 4096, 4096, 16, 2, 64, True, bf16, 1),
        (GQA, 2, 17, 17, 8, 4, 256, False, f16, 1),
        (GQA, 2, 255, 1000, 8, 2, 128, True, f16, 1),
        (GQA, 1, 1000, 255, 8, 1, 64, True, bf16, 1),
        (GQA, 2, 1000, 1000, 8, 2, 128, True, bf16, 10),
    ]
    # Tiles in parts over their keys (kv_split_plan): a last round of 24 tiles in two parts
    # after eight whole rounds; every tile in parts, with ragged keys, at each head dim and
    # with large logits; causal grids with fewer tiles than SMs (a chunk of queries against a
    # long context; Sq > Sk, whose first rows see no key; parts without key blocks).
    cases += [
        (BSHD, 1, 500, 9000, 4, 4, 128, True, bf16, 1),
        (BSHD, 1, 4200, 4100, 1, 1, 64, True, f16, 1),
        (BSHD, 1, 1100, 4100, 2, 2, 128, True, f16, 10),
        (GQA, 1, 300, 5000, 8, 2, 128, True, bf16, 1),
        (BSHD, 3, 1000, 1000, 45, 45, 128, False, bf16, 1),
        (BSHD, 2, 1000, 4000, 5, 5, 64, False, f16, 1),
        (BSHD, 1, 300, 5000, 3, 3, 256, False, bf16, 1),
        (BSHD, 1, 17, 4100, 4, 4, 128, False, f16, 10),
        (BHSD, 1, 200, 4100, 4, 4, 128, False, bf16, 1),
        (GQA, 1, 100, 4100, 8, 2, 128, False, f16, 1),
    ]
    # Persistent schedule: many tiles per thread block; an odd number of query blocks a head,
    # causal (from the counter at D=64 and D=128; at D=256 in pairs, where two heads' middle
    # blocks pair up and an odd head count leaves a last head alone, and from the counter at B2
    # H40 S1000, where the pairs leave a ragged last round), at 128 and 192 query rows
    # a tile; Sq < Sk; each head dim.
    cases += [
        (BSHD, 1, 640, 640, 99, 99, 256, True, bf16, 1),
        (BHSD, 3, 640, 640, 33, 33, 256, True, f16, 1),
        (BSHD, 3, 640, 640, 33, 33, 128, True, bf16, 1),
        (BSHD, 1, 2100, 2100, 16, 16, 64, True, f16, 1),
        (BHSD, 2, 1400, 1400, 24, 24, 128, True, bf16, 1),
        (GQA, 3, 1400, 1400, 9, 3, 128, True, f16, 1),
        (BSHD, 2, 1000, 1000, 40, 40, 64, False, f16, 1),
        (BSHD, 2, 1000, 1000, 40, 40, 256, True, f16, 1),
        # D=256 stages O in V's ring: many tiles a thread block, each tile's V load waits for
        # the last one's store; whole tiles then parts; ragged rows at large logits
        (BHSD, 2, 1000, 1000, 40, 40, 256, False, bf16, 1),
        (GQA, 2, 1000, 1000, 32, 8, 256, True, bf16, 1),
        (BSHD, 2, 777, 777, 16, 16, 256, False, bf16, 1),
        (BSHD, 1, 4100, 4100, 8, 8, 256, False, f16, 10),
        (BHSD, 2, 700, 1000, 24, 24, 128, True, f16, 1),
        (GQA, 2, 1000, 1000, 32, 4, 64, True, bf16, 1),
        # causal D=256 where the pairs would leave a ragged last round: from the counter
        (GQA, 3, 1000, 1000, 15, 5, 256, True, bf16, 1),
        (BHSD, 1, 3000, 3000, 20, 20, 256, True, f16, 1),
        # causal D=128 where pairs would leave a ragged last round: the tiles from the counter,
        # with two Q slots (S=1000) and one (S=3000); Sq < Sk, and Sq > Sk (rows without keys)
        (BSHD, 3, 1000, 1000, 45, 45, 128, True, bf16, 1),
        (BSHD, 1, 3000, 3000, 28, 28, 128, True, f16, 10),
        (BSHD, 2, 700, 1000, 45, 45, 128, True, f16, 1),
        (BSHD, 2, 1000, 700, 45, 45, 128, True, bf16, 1),
        (BHSD, 3, 1000, 1000, 45, 45, 128, True, f16, 1),
        (BHSD, 2, 1000, 700, 45, 45, 128, True, bf16, 10),
        (GQA, 3, 1000, 1000, 45, 9, 128, True, bf16, 1),
        (GQA, 1, 3000, 3000, 28, 4, 128, True, f16, 1),
        # causal D=64 with more tiles than SMs: always the counter (and GQA B2 H32 S1000 above)
        (BSHD, 3, 1000, 1000, 45, 45, 64, True, bf16, 1),
        (BSHD, 1, 3000, 3000, 28, 28, 64, True, f16, 10),
        (BSHD, 2, 1000, 700, 45, 45, 64, True, f16, 1),
        (BHSD, 2, 700, 1000, 45, 45, 64, True, bf16, 1),
        (GQA, 1, 3000, 3000, 28, 4, 64, True, bf16, 1),
        # ragged keys without causal, whole tiles then parts: the mask reads Sk through a
        # shuffle (as in BSHD B3 H45 S1000 above)
        (BHSD, 1, 1000, 2100, 35, 35, 128, False, f16, 1),
        (GQA, 1, 1000, 2100, 36, 9, 128, False, bf16, 10),
        # without causal, Sk >= 8192 takes 160 keys a block at D=128 (a ragged last block too)
        (BSHD, 1, 1000, 8200, 4, 4, 128, False, f16, 1),
        (BHSD, 1, 700, 8192, 4, 4, 128, False, bf16, 10),
        (GQA, 1, 500, 9000, 8, 2, 128, False, bf16, 1),
    ]
    return cases


def _case_id(case):
    script, B, Sq, Sk, H, Hkv, D, causal, dtype, scale = case
    name = script.split("example_")[1].removesuffix(".py")
    dt = "f16" if dtype == torch.float16 else "bf16"
    c = "causal" if causal else "full"
    return f"{name}-B{B}-Sq{Sq}-Sk{Sk}-H{H}/{Hkv}-D{D}-{c}-{dt}" + ("-x10" if scale != 1 else "")


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=_case_id)
def test_forward_matches_reference(case, poisoned_empty):
    from helpers import rel_err

    script, B, Sq, Sk, H, Hkv, D, causal, dtype, scale = case
    mod = load_script(script)
    q, k, v = make_inputs(script, B, Sq, Sk, H, Hkv, D, dtype, "cuda", scale)
    out, lse = mod.attention(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = mod.ref_program(q, k, v, causal=causal, return_lse=True)
    assert rel_err(out, ref_out) < 1e-2  # fp16/bf16 output
    assert rel_err(lse, ref_lse) < 1e-4  # lse comes from fp32 scores: much tighter
    if causal and Sq > Sk:  # rows that see no key: exactly 0 and +inf, never NaN
        rows = out[:, :, : Sq - Sk] if script == BHSD else out[:, : Sq - Sk]
        assert torch.all(rows == 0) and torch.all(torch.isposinf(lse[:, :, : Sq - Sk]))


def _tune_cases():
    mod = load_script(BSHD)
    return [(dim, cfg) for dim in (64, 128, 256) for cfg in mod.tune_configs(dim)]


@pytest.mark.gpu
@pytest.mark.parametrize("dim,cfg", _tune_cases(), ids=lambda x: str(x))
def test_tune_space_is_correct(dim, cfg):
    """Every configuration --tune may pick gives the right answer (ragged, causal, Sq != Sk)."""
    from helpers import rel_err

    mod = load_script(BSHD)
    q, k, v = make_inputs(BSHD, 2, 300, 333, 3, 3, dim, torch.float16, "cuda")
    out, lse = mod.attention(q, k, v, causal=True, return_lse=True, config=cfg)
    ref_out, ref_lse = mod.ref_program(q, k, v, causal=True, return_lse=True)
    assert rel_err(out, ref_out) < 1e-2  # fp16 output
    assert rel_err(lse, ref_lse) < 1e-4


@pytest.mark.gpu
def test_forward_softmax_scale_and_strided_input():
    """A non-default scale, and q that is a strided view (made contiguous by the wrapper)."""
    from helpers import rel_err

    mod = load_script(BSHD)
    q, k, v = make_inputs(BSHD, 2, 300, 300, 4, 4, 128, torch.bfloat16, "cuda")
    q_view = torch.cat([q, q], dim=2)[:, :, :4]  # heads view: not contiguous
    out = mod.attention(q_view, k, v, causal=True, softmax_scale=0.05)
    ref = mod.ref_program(q, k, v, causal=True, softmax_scale=0.05)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("extra", [[], ["--causal", "--dtype", "bfloat16", "--seq_len_k", "700"]])
def test_main_small(script, extra, capsys):
    argv = ["--batch", "1", "--heads", "4", "--seq_len", "300", "--dim", "64", *extra]
    if script == GQA:
        argv += ["--groups", "2"]
    load_script(script).main(argv)
    out = capsys.readouterr().out
    assert "out " in out and "lse " in out and "tilelang" in out


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
def test_empty_sequences(script):
    """Sk = 0: every row is empty (out 0, lse +inf); Sq = 0: empty output, no launch."""
    mod = load_script(script)
    q, k, v = make_inputs(script, 2, 5, 0, 4, 2 if script == GQA else 4, 64, torch.float16, "cuda")
    out, lse = mod.attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    q, k, v = make_inputs(script, 2, 0, 7, 4, 2 if script == GQA else 4, 64, torch.float16, "cuda")
    assert mod.attention(q, k, v).shape == q.shape
