"""Attention with sinks and a sliding window (examples/attention_sink/): the reference against a
direct float64 computation, the window's block ranges and the kernel's tile loop (emulated on the
CPU), command line, sm_90a builds with their generated code and ptxas report, bad input (CPU);
the correctness matrix of docs/CONVENTIONS.md ("Correctness") on a GPU (marker ``gpu``)."""

import inspect
import itertools
import math
import re
import sys

import pytest
import torch
from helpers import (
    EXAMPLES,
    assert_one_producer_warp,
    fresh_plans,
    load_script,
    record_launches,
    rel_err,
)

FWD = "attention_sink/example_gqa_sink_fwd_bhsd.py"
FAST_BWD = "flash_attention/example_mha_bwd_wgmma_pipelined.py"
WINDOWS = [(-1, -1), (128, 0), (64, 64), (3, 0)]


def make_inputs(B, Sq, Sk, H, Hkv, D, dtype=torch.float32, device="cpu", scale=1.0, sinks=True):
    """q, k, v (BHSD, normal random values times ``scale``) and sinks (float32 [H] or None)."""
    g = torch.Generator(device=device).manual_seed(B * 1000 + Sq * 7 + Sk + D + H)
    q, k, v = (
        (torch.randn(s, generator=g, device=device) * scale).to(dtype)
        for s in ((B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D))
    )
    s = torch.randn(H, generator=g, device=device, dtype=torch.float32) * 2 if sinks else None
    return q, k, v, s


def seeded_dout(q):
    """The output gradient, drawn from its own seed: a draw from the global generator would
    depend on which tests ran before in the process, so a check near its tolerance (dsinks sums
    rows of both signs) could pass or fail from run to run."""
    g = torch.Generator(device=q.device).manual_seed(q.numel() % 10007)
    return torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)


def direct(q, k, v, sinks, window_size, causal, scale):
    """Float64, written differently from ref_program: the window as an explicit loop-built
    boolean mask, the sink as an extra logit column concatenated to the scores and dropped after
    the softmax. Rows that see no key: out 0, lse +inf."""
    q, k, v = (t.double() for t in (q, k, v))
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    groups = H // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    left, right = window_size
    if causal:
        right = 0
    mask = torch.zeros(Sq, Sk, dtype=torch.bool)
    for i in range(Sq):
        for j in range(Sk):
            centre = i + Sk - Sq
            mask[i, j] = (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
    if sinks is not None:
        column = sinks.double()[None, :, None, None].expand(B, H, Sq, 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = scores.logsumexp(-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :Sk]
    empty = ~mask.any(-1)
    out = (probs @ v).masked_fill(empty[:, None], 0.0)
    return out, lse.masked_fill(empty, math.inf)


# ----------------------------------------------------------------------------- reference (CPU)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(150, 150), (40, 200), (200, 40), (7, 7)])
def test_reference_matches_direct_float64(window, causal, Sq, Sk):
    mod = load_script(FWD)
    groups = 8 if Sq == Sk else 2
    q, k, v, sinks = make_inputs(2, Sq, Sk, 8, 8 // groups, 16, dtype=torch.float64)
    for s in (sinks, None):
        out, lse = mod.ref_program(q, k, v, s, window, causal, 0.3, return_lse=True)
        ref_out, ref_lse = direct(q, k, v, s, window, causal, 0.3)
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


def test_reference_rows_without_keys():
    """Sq > Sk, causal: the first Sq − Sk rows see no key; a window (0, 0) with Sq > Sk likewise,
    and a window whose right edge ends before key 0. Out 0 and lse +inf, sink or not."""
    mod = load_script(FWD)
    q, k, v, sinks = make_inputs(1, 9, 4, 4, 2, 16, dtype=torch.float64)
    for window, causal in (((-1, -1), True), ((3, 0), False), ((0, 0), True)):
        for s in (sinks, None):
            out, lse = mod.ref_program(q, k, v, s, window, causal, return_lse=True)
            assert torch.all(out[:, :, :5] == 0) and torch.all(torch.isposinf(lse[:, :, :5]))
            assert torch.all(torch.isfinite(lse[:, :, 5:]))
    # (2, 1) with Sq = 9, Sk = 4: row i sees keys i − 7 … i − 4, the first four rows see none
    out, lse = mod.ref_program(q, k, v, sinks, (3, -1), False, return_lse=True)
    assert torch.all(torch.isfinite(lse))
    out, lse = mod.ref_program(q, k, v, sinks, (1, 0), False, return_lse=True)
    assert torch.all(torch.isposinf(lse[:, :, :5])) and torch.all(out[:, :, :5] == 0)


def test_reference_sink_semantics():
    """The sink only joins the denominator: out = out_without_sink · sigmoid(lse_keys − sink), a
    sink of -inf is no sink, and lse includes the sink."""
    mod = load_script(FWD)
    q, k, v, sinks = make_inputs(2, 33, 50, 4, 4, 16, dtype=torch.float64)
    sinks = sinks.double()
    plain, lse_keys = mod.ref_program(q, k, v, None, (5, 2), False, return_lse=True)
    out, lse = mod.ref_program(q, k, v, sinks, (5, 2), False, return_lse=True)
    keep = torch.sigmoid(lse_keys - sinks[None, :, None])
    torch.testing.assert_close(out, plain * keep[..., None])
    torch.testing.assert_close(lse, torch.logaddexp(lse_keys, sinks[None, :, None]))
    no_sink = torch.full_like(sinks, -math.inf)
    torch.testing.assert_close(mod.ref_program(q, k, v, no_sink, (5, 2)), plain)


def test_causal_sets_right_to_zero():
    """FlashAttention's rule: causal=True makes the window (left, 0), whatever right says."""
    mod = load_script(FWD)
    q, k, v, sinks = make_inputs(1, 40, 60, 4, 2, 16, dtype=torch.float64)
    a = mod.ref_program(q, k, v, sinks, (7, 5), True)
    b = mod.ref_program(q, k, v, sinks, (7, 0), False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert mod.normalize_window((7, 5), True, 40, 60) == (7, 0)
    assert mod.normalize_window((-1, -1), True, 40, 60) == (-1, 0)


def test_normalize_window_keeps_the_mask():
    """Bounds no row reaches become -1 (one kernel for equivalent windows); the mask stays."""
    mod = load_script(FWD)
    for Sq, Sk in ((1, 1), (1, 9), (9, 1), (20, 20), (13, 30), (30, 13)):
        for window in itertools.product((-1, 0, 1, 5, 12, 29, 40), repeat=2):
            for causal in (False, True):
                norm = mod.normalize_window(window, causal, Sq, Sk)
                expect = mod.window_mask(Sq, Sk, window, causal)
                assert torch.equal(mod.window_mask(Sq, Sk, norm, False), expect), (window, norm)
    assert mod.normalize_window((128, 0), False, 4096, 4096) == (128, 0)
    assert mod.normalize_window((5000, 5000), False, 4096, 4096) == (-1, -1)


def test_attended_pairs_counts_the_mask():
    mod = load_script(FWD)
    for Sq, Sk in ((1, 1), (17, 17), (255, 1000), (1000, 255), (64, 64)):
        for window in [*WINDOWS, (1024, 0), (0, 0), (-1, 3)]:
            for causal in (False, True):
                expect = int(mod.window_mask(Sq, Sk, window, causal).sum())
                assert mod.attended_pairs(Sq, Sk, window, causal) == expect
    B, H, S, D = 2, 4, 4096, 128  # full attention: the usual count, causal: the visible half
    assert mod.window_flops(B, H, S, S, D, (-1, -1), False) == 4 * B * H * S * S * D
    assert mod.window_flops(B, H, S, S, D, (-1, -1), True) == 4 * B * H * S * (S + 1) // 2 * D


# ----------------------------------------------------------------------------- window blocks (CPU)
def _blocks(mod, m_blk, block_M, block_N, Sq, Sk, left, right):
    """The kernel's block bookkeeping for one tile, as ints: (n_start, n_blocks, n_left,
    n_inner_end)."""
    tile = (block_M, block_N, Sq, Sk, left, right)
    n_start, n_blocks = (int(x) for x in mod.window_key_blocks(m_blk, *tile))
    n_left, n_inner_end = (int(x) for x in mod.window_mask_runs(m_blk, n_start, n_blocks, *tile))
    return n_start, n_blocks, n_left, n_inner_end


SHAPES = [(1, 1), (1, 37), (37, 1), (17, 17), (40, 13), (13, 40), (64, 64), (100, 37), (5, 200)]
SMALL_WINDOWS = [(-1, -1), (0, 0), (3, 0), (0, 3), (8, 8), (16, 0), (-1, 5), (5, -1), (39, 2)]
TILES = [(8, 8), (16, 8), (8, 16), (12, 8), (16, 32)]


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_window_blocks_are_exactly_the_blocks_seen(Sq, Sk):
    """What the producer loads and the consumers walk: every key block some row of the tile sees,
    and no other (a tile whose rows see nothing visits one block, masked whole); the blocks the
    consumers leave unmasked are seen whole by every row of the tile."""
    mod = load_script(FWD)
    for window, causal, (block_M, block_N) in itertools.product(
        SMALL_WINDOWS, (False, True), TILES
    ):
        left, right = mod.normalize_window(window, causal, Sq, Sk)
        n_key_blocks = math.ceil(Sk / block_N)
        padded = torch.zeros(Sq, n_key_blocks * block_N, dtype=torch.bool)
        padded[:, :Sk] = mod.window_mask(Sq, Sk, window, causal)
        for m in range(math.ceil(Sq / block_M)):
            n_start, n_blocks, n_left, n_inner_end = _blocks(
                mod, m, block_M, block_N, Sq, Sk, left, right
            )
            where = (Sq, Sk, window, causal, block_M, block_N, m)
            rows = padded[m * block_M : (m + 1) * block_M].view(-1, n_key_blocks, block_N)
            seen = rows.any(-1).any(0).nonzero().flatten().tolist()
            if seen:
                assert (n_start, n_blocks) == (seen[0], seen[-1] - seen[0] + 1), where
            else:
                assert n_blocks == 1 and 0 <= n_start < n_key_blocks, where
            assert 0 <= n_left <= n_inner_end <= n_blocks, where
            for k in range(n_left, n_inner_end):
                assert rows[:, n_start + k].all(), (*where, k)


def emulate_kernel(mod, q, k, v, sinks, window_size, causal, scale, block_M, block_N):
    """The kernel's algorithm on the CPU in float64, tile by tile: the key blocks of
    window_key_blocks, masks only where the kernel applies them (window_mask_runs, and the
    first block as the kernel treats it), the online softmax in base 2 with the dense kernel's
    -inf guard, the sink folded in at the end."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    groups = H // k.shape[1]
    left, right = mod.normalize_window(window_size, causal, Sq, Sk)
    offset, s2 = Sk - Sq, scale * mod.LOG2E
    out = torch.full((B, H, Sq, D), math.nan, dtype=torch.float64)
    lse = torch.full((B, H, Sq), math.nan, dtype=torch.float64)
    for b, h, m in itertools.product(range(B), range(H), range(math.ceil(Sq / block_M))):
        n_start, n_blocks, n_left, n_inner_end = _blocks(
            mod, m, block_M, block_N, Sq, Sk, left, right
        )
        rows = torch.arange(m * block_M, (m + 1) * block_M)
        qt = torch.zeros(block_M, D, dtype=torch.float64)
        qt[: min(block_M, Sq - m * block_M)] = q[b, h, m * block_M : (m + 1) * block_M].double()
        acc = torch.zeros(block_M, D, dtype=torch.float64)
        row_max = torch.full((block_M,), -math.inf, dtype=torch.float64)
        row_sum = torch.zeros(block_M, dtype=torch.float64)
        for step in range(n_blocks):
            kb = n_start + step
            keys = torch.arange(kb * block_N, (kb + 1) * block_N)
            kt, vt = (torch.zeros(block_N, D, dtype=torch.float64) for _ in range(2))
            n = min(block_N, Sk - kb * block_N)  # TMA fills past Sk with zeros
            kt[:n] = k[b, h // groups, kb * block_N : kb * block_N + n].double()
            vt[:n] = v[b, h // groups, kb * block_N : kb * block_N + n].double()
            s = qt @ kt.T
            if not n_left <= step < n_inner_end or (step == 0 and left >= 0):
                vis = (keys < Sk)[None, :].expand(block_M, -1)
                centre = (rows + offset)[:, None]
                if right >= 0:
                    vis = vis & (keys[None, :] <= centre + right)
                if left >= 0:
                    vis = vis & (keys[None, :] >= centre - left)
                s = s.masked_fill(~vis, -math.inf)
            prev = row_max
            row_max = torch.maximum(row_max, s.max(-1).values)
            row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
            factor = torch.exp2(prev * s2 - row_max * s2)
            p = torch.exp2(s * s2 - row_max[:, None] * s2)
            row_sum = row_sum * factor + p.sum(-1)
            acc = acc * factor[:, None] + p @ vt
        m2 = row_max * s2
        if sinks is not None:
            sink = float(sinks[h]) * mod.LOG2E
            m_sink = torch.clamp(m2, min=sink)
            ratio = torch.exp2(m2 - m_sink)
            total = row_sum * ratio + torch.exp2(sink - m_sink)
        else:
            m_sink, ratio, total = m2, torch.ones_like(m2), row_sum
        seen = row_sum > 0
        o = torch.where(seen[:, None], acc * (ratio / total)[:, None], 0.0)
        l_ = torch.where(seen, (torch.log2(total) + m_sink) / mod.LOG2E, math.inf)
        real = min(block_M, Sq - m * block_M)
        out[b, h, m * block_M : m * block_M + real] = o[:real]
        lse[b, h, m * block_M : m * block_M + real] = l_[:real]
    return out, lse


@pytest.mark.parametrize(
    "Sq,Sk,window,causal,tile",
    [
        (40, 40, (8, 0), False, (16, 8)),
        (40, 40, (-1, -1), True, (16, 16)),
        (37, 61, (5, 5), False, (8, 16)),
        (61, 37, (12, 0), True, (16, 8)),
        (61, 37, (-1, -1), True, (8, 8)),  # rows that see no key
        (50, 50, (3, -1), False, (16, 8)),
        (1, 45, (128, 0), False, (16, 16)),
        (45, 45, (64, 64), False, (12, 8)),
    ],
)
def test_kernel_tile_loop_matches_reference(Sq, Sk, window, causal, tile):
    """The kernel's loop structure (block ranges, edge-only masks, online softmax, the sink
    folded in at the end), emulated with small tiles, gives the reference's numbers, sinks
    of every size included (far above and below the scores, -inf)."""
    mod = load_script(FWD)
    q, k, v, sinks = make_inputs(2, Sq, Sk, 4, 2, 16, dtype=torch.float64, scale=2.0)
    sinks = torch.tensor([0.5, 40.0, -30.0, -math.inf], dtype=torch.float64)
    for s in (sinks, None):
        out, lse = emulate_kernel(mod, q, k, v, s, window, causal, 0.25, *tile)
        ref_out, ref_lse = mod.ref_program(q, k, v, s, window, causal, 0.25, return_lse=True)
        assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12


# ----------------------------------------------------------------------------- script (CPU)
def test_tile_order_is_the_dense_forwards():
    """The sink forward deals its tiles as the dense forwards do at D=64 and D=128: round-robin,
    a head's query blocks in a row, or (a window bounded on one side only, more tiles than thread
    blocks) from the tile counter, in sections of the dense GQA forward's size, heaviest query
    blocks first: the last ones for a window bounded on the right, the first for one bounded on
    the left. Either order lists every (query block, head, batch) once."""
    sink, dense = load_script(FWD), load_script("flash_attention/example_gqa_fwd_bshd.py")
    grids = ((3, 45, 5, 1000), (1, 28, 4, 3000), (2, 64, 8, 4096), (1, 4, 1, 1000))
    for (B, H, Hkv, S), D, block_M in itertools.product(grids, (64, 128), (128, 192)):
        section = dense.counter_section(B, H, Hkv, S, S, D, True, block_M, 128, 132)
        assert sink.counter_section(B, H, Hkv, S, S, D, True, block_M, 132) == section
        assert sink.counter_section(B, H, Hkv, S, S, D, False, block_M, 132) == 0
    assert sink.counter_section(3, 45, 5, 1000, 1000, 128, True, 128, 132) == 135
    assert sink.counter_section(1, 4, 1, 1000, 1000, 128, True, 128, 132) == 0  # 32 tiles
    for nm, heads, batch, section in ((8, 4, 3, 0), (8, 4, 3, 4), (11, 6, 1, 3), (5, 2, 2, 1)):
        for heavy_last in (True, False):
            tiles = [
                sink.tile_of(t, nm, heads, section, heavy_last) for t in range(nm * heads * batch)
            ]
            assert sorted(tiles) == list(itertools.product(range(nm), range(heads), range(batch)))
            if section:  # a section's heads each give their heaviest block first
                heaviest = nm - 1 if heavy_last else 0
                assert [m for m, _, _ in tiles[:section]] == [heaviest] * section
                assert len({h + heads * b for _, h, b in tiles[:section]}) == section
            else:
                assert [m for m, _, _ in tiles[:nm]] == list(range(nm))


def test_script_contract():
    """The API of docs/CONVENTIONS.md ("Script contract") with this family's two arguments."""
    import ast

    mod = load_script(FWD)
    params = inspect.signature(mod.attention).parameters
    assert list(params) == [
        "q", "k", "v", "sinks", "window_size", "causal", "softmax_scale", "return_lse", "config"
    ]  # fmt: skip
    assert params["sinks"].default is None and params["window_size"].default == (-1, -1)
    assert params["causal"].default is False and params["softmax_scale"].default is None
    ref = list(inspect.signature(mod.ref_program).parameters)
    assert ref == list(params)[:-1]
    assert list(inspect.signature(mod.main).parameters) == ["argv"]
    source = (EXAMPLES / FWD).read_text()
    assert 'if __name__ == "__main__":\n    main()' in source
    kernels = [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d) == "T.prim_func" for d in node.decorator_list)
    ]
    # one kernel, defined with the tile counter's argument or without it
    assert kernels == ["flash_fwd", "flash_fwd"]
    macros = re.findall(r"@T\.macro\n    def (\w+)", source)
    phases = {"load_q", "load_kv", "scores", "mask", "softmax", "rescale", "pv", "row_factors"}
    assert phases | {"store_output", "start_tile", "next_tile_under_last_pv"} <= set(macros)
    tune = mod.build_parser()._option_string_actions["--tune"]
    assert tune.help == mod._harness().TUNE_HELP


def test_command_line(capsys):
    mod = load_script(FWD)
    parser = mod.build_parser()
    args = parser.parse_args([])
    assert args.window == [-1, -1] and args.sinks is True and args.causal is False
    args = parser.parse_args(["--window", "128", "0", "--no-sinks", "--causal"])
    assert args.window == [128, 0] and args.sinks is False and args.causal is True
    assert parser.parse_args(["--window", "-1", "64"]).window == [-1, 64]
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--window LEFT RIGHT" in text and "--no-sinks" in text and "--groups" in text
    bad = [  # argv, what the one-line error names
        (["--window", "128"], "--window"),  # two values
        (["--window", "-2", "0"], "--window"),
        (["--window", "a", "0"], "--window"),
        (["--dim", "256"], "--dim"),
        (["--dtype", "float32"], "--dtype"),
        (["--sinks", "yes"], "yes"),  # a switch takes no value
        (["--groups", "5", "--heads", "32"], "--groups"),
        (["--arch", "sm_100a"], "--arch"),
    ]
    for argv, fragment in bad:
        with pytest.raises(SystemExit) as exc:
            mod.main(["--compile-only", *argv])
        assert exc.value.code == 2, argv
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert fragment in last, (argv, last)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_main_without_gpu_says_so():
    with pytest.raises(SystemExit) as exc:
        load_script(FWD).main(["--seq_len", "128"])
    assert "--compile-only" in str(exc.value.code)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_peer_matches_reference():
    """main's FlexAttention peer (eager here, on the CPU): the window as a block mask, the sink
    by rescaling with its lse, GQA, rows that see no key; the same numbers as the reference."""
    mod = load_script(FWD)
    for Sq, Sk in ((70, 90), (90, 70)):
        q, k, v, sinks = make_inputs(1, Sq, Sk, 4, 2, 16)
        for window, causal in (((16, 0), False), ((-1, -1), True), ((8, 8), False)):
            for s in (sinks, None):
                out = mod.flex_peer(q, k, v, s, window, causal, 0.25)()
                ref = mod.ref_program(q, k, v, s, window, causal, 0.25)
                assert rel_err(out, ref) < 1e-5, (Sq, Sk, window, causal)


# ----------------------------------------------------------------------------- sm_90a builds (CPU)
# (D, Sq, Sk, window, causal, sinks, dtype): every head dim, causal or not, several windows,
# with and without sinks, ragged and Sq != Sk. default_config's tiles: 128 or 192 query rows.
BUILDS = [
    (64, 1000, 1000, (128, 0), True, True, "bfloat16"),
    (64, 4096, 4096, (1024, 0), False, False, "float16"),
    (64, 777, 1000, (64, 64), False, True, "float16"),
    (128, 1000, 1000, (128, 0), True, True, "bfloat16"),
    (128, 4096, 4096, (-1, -1), False, True, "float16"),
    (128, 1000, 777, (-1, -1), True, False, "bfloat16"),
    # no window on keys that end in a partial block: the ragged tail's mask in the key loop
    (128, 1000, 1000, (-1, -1), False, True, "bfloat16"),
    # causal, the last of 32 query blocks partial, tiles from the counter (the lse rows' bound)
    (128, 4000, 4000, (-1, -1), True, True, "bfloat16"),
    (128, 4096, 4096, (64, 64), False, False, "float16"),
    # windows bounded on one side, more tiles than SMs: from the tile counter
    (64, 2048, 2048, (-1, -1), True, True, "bfloat16"),
    (64, 1000, 1000, (200, -1), False, False, "float16"),
]


def _build_id(build):
    D, Sq, Sk, window, causal, sinks, dtype = build
    return f"D{D}-Sq{Sq}-Sk{Sk}-w{window[0]}_{window[1]}-{'causal' if causal else 'full'}-" + (
        "sinks" if sinks else "nosinks"
    )


def _build(build, **cfg):
    import harness

    mod = load_script(FWD)
    D, Sq, Sk, window, causal, sinks, dtype = build
    left, right = mod.normalize_window(window, causal, Sq, Sk)
    cfg = cfg or mod.default_config(D, (left, right), "sm_90a", Sk)
    args = (2, 16, 2, Sq, Sk, D, left, right, sinks, 1 / math.sqrt(D), dtype)
    return harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg), cfg


@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
def test_sm90_build_holds_the_schedule_and_spills_nothing(build):
    """Producer/consumer register split (setmaxnreg), TMA and mbarriers between them,
    asynchronous WGMMA with the softmax overlapping P V; the sinks read only when given; the
    tile counter's atomic where counter_section takes it; shared memory within an SM's; ptxas:
    no spills, no stack, no serialized WGMMA."""
    from test_flash_bwd_fast import assert_clean_build

    kernel, cfg = _build(build)
    src = kernel.get_kernel_source()
    threads = 2 * cfg["block_M"] + 128
    ctas = cfg["ctas_per_sm"]  # thread blocks sharing an SM, each with its share of registers
    regs = min(240, (65536 // ctas - 128 * 24) // (2 * cfg["block_M"]) // 8 * 8)
    assert f"__launch_bounds__({threads}, {ctas})" in src
    assert "warpgroup_reg_dealloc<24>" in src and f"warpgroup_reg_alloc<{regs}>" in src
    assert_one_producer_warp(src, 2 * cfg["block_M"])
    assert "tma_load" in src and ".expect_transaction(" in src and ".wait(" in src
    assert "wgmma_ss" in src and "wgmma_rs" in src  # Q Kᵀ from shared, P V with P in registers
    assert src.count("wait_wgmma<1>") >= 1, "Q Kᵀ of block k overlaps P V of block k-1"
    assert ("Sinks[" in src) == build[5]
    mod = load_script(FWD)
    D, Sq, Sk, window, causal = build[:5]
    left, right = mod.normalize_window(window, causal, Sq, Sk)
    one_sided = (left < 0) != (right < 0)
    counted = mod.counter_section(2, 16, 2, Sq, Sk, D, one_sided, cfg["block_M"], 132 * ctas)
    assert ("AtomicAddRet(" in src) == bool(counted)
    assert_clean_build(kernel, threads, 24, regs)


@pytest.mark.parametrize("dim", [64, 128])
def test_narrow_windows_take_two_thread_blocks_an_sm(dim):
    """default_config: two thread blocks an SM (64×64 tiles) for a window bounded on both sides
    and at most 256 keys wide, one otherwise; the varlen forward always one. Two fit an SM:
    registers (the launch bound asks for them; 232 a consumer thread) and shared memory (the
    H100's 228 KB an SM, 1 KB of it reserved per thread block)."""
    import harness

    mod = load_script(FWD)
    for window, ctas in (((128, 0), 2), ((64, 64), 2), ((256, 0), 2), ((300, 0), 1)):
        assert mod.default_config(dim, window, "sm_90a", 4096)["ctas_per_sm"] == ctas, window
    for window in ((1024, 0), (-1, 0), (-1, -1), (0, -1)):
        assert mod.default_config(dim, window, "sm_90a", 4096)["ctas_per_sm"] == 1, window
    varlen = load_script(VARLEN)
    assert "ctas_per_sm" not in varlen.default_config(dim, (128, 0), "sm_90a", 4096)
    kernel, cfg = _build((dim, 4096, 4096, (128, 0), True, True, "bfloat16"))
    assert cfg["ctas_per_sm"] == 2
    src = kernel.get_kernel_source()
    assert "__launch_bounds__(256, 2)" in src and "warpgroup_reg_alloc<232>" in src
    from test_flash_bwd_fast import ptxas_report

    static = int(re.search(r"(\d+) bytes smem", ptxas_report(src)).group(1))
    assert 2 * (harness.dynamic_smem_bytes(kernel) + static + 1024) <= 228 * 1024


@pytest.mark.parametrize("dim", [64, 128])
def test_tiles_start_under_the_last_pv_with_one_thread_block_an_sm(dim):
    """With Q in two slots and one thread block an SM (window (1024, 0)), the next tile's first
    Q Kᵀ is issued under this tile's last P V: one more WGMMA wait that leaves a GEMM in flight
    than the same tiles with one Q slot. Two thread blocks an SM (window (128, 0)) start every
    tile on its own either way. Every build spills nothing and keeps its WGMMAs asynchronous."""
    from test_flash_bwd_fast import assert_clean_build

    waits = {}
    for window in ((1024, 0), (128, 0)):
        build = (dim, 4096, 4096, window, True, True, "bfloat16")
        cfg = load_script(FWD).default_config(dim, window, "sm_90a", 4096)
        assert cfg["q_stages"] == 2
        for q_stages in (1, 2):
            kernel = _build(build, **{**cfg, "q_stages": q_stages})[0]
            src = kernel.get_kernel_source()
            regs = int(re.search(r"warpgroup_reg_alloc<(\d+)>", src).group(1))
            assert_clean_build(kernel, 2 * cfg["block_M"] + 128, 24, regs)
            waits[window, q_stages] = src.count("wait_wgmma<1>")
    assert waits[(1024, 0), 2] == waits[(1024, 0), 1] + 1
    assert waits[(128, 0), 2] == waits[(128, 0), 1]


def test_two_thread_block_default_falls_back_where_tilelang_rejects_it():
    """Where TileLang's ThreadSync pass rejects the two-thread-block default, the one-thread-block
    tiles are built instead, and the rejection is remembered: the failing build is tried once.
    The shapes that were rejected (D=64, Sq=500, Sk=700, window (128, 0) among them) build
    since the lse rows' bound is held in a local, so the rejection is simulated here; any
    other error is raised."""
    import harness

    mod = load_script(FWD)
    args = (2, 8, 2, 500, 700, 64, 128, 0, True, 0.125, "float16")
    tried = []

    def build(tiles):
        tried.append(tiles["ctas_per_sm"])
        if tiles["ctas_per_sm"] == 2:
            raise RuntimeError("[ThreadSync] Cannot lower a required shared-memory sync")
        return harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **tiles)

    cfg = mod.default_config(64, (128, 0), "sm_90a", 700)
    single = mod.single_cta_config(64, (128, 0), "sm_90a", 700)
    assert cfg["ctas_per_sm"] == 2 and single["ctas_per_sm"] == 1
    kernel = mod.build_with_fallback(build, cfg, single, args)
    assert "__launch_bounds__(384, 1)" in kernel.get_kernel_source()  # 128-row tiles
    mod.build_with_fallback(build, cfg, single, args)
    assert tried == [2, 1, 1]
    # The default itself builds now, with two thread blocks an SM.
    two = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert "__launch_bounds__(256, 2)" in two

    def broken(tiles):
        raise RuntimeError("another error")

    with pytest.raises(RuntimeError, match="another error"):  # not a rejection: raised
        mod.build_with_fallback(broken, cfg, single, ("other",))


def test_entry_is_the_built_kernels_main_function():
    """``entry``: the compiled ``main`` of a kernel built in this process (an executable linked
    on first use) or loaded from TileLang's cache (a module), not TileLang's call wrapper; the
    kernel itself for an adapter without an executable. The entry point still checks its
    arguments: CPU tensors are refused, not launched, and its host code checks shapes and
    dtypes."""
    import types

    import harness

    mod = load_script(FWD)
    bwd = load_script("attention_sink/example_gqa_sink_bwd_bhsd.py")
    kernel = harness.compile_for(bwd.flashattn_bwd_sinks, "sm_90a", 1, 4, 37, 64)
    built = kernel.adapter.get_exportable_executable()
    module = built.jit() if hasattr(built, "jit") else built
    main = mod.entry(kernel)
    assert main is module.main and main is not kernel
    loaded = types.SimpleNamespace(
        adapter=types.SimpleNamespace(get_exportable_executable=lambda: module)
    )
    assert mod.entry(loaded) is module.main
    other = types.SimpleNamespace(adapter=object())
    assert mod.entry(other) is other
    args = (torch.zeros(4), torch.zeros(1, 4, 37), torch.zeros(1, 4, 64), torch.zeros(4))
    with pytest.raises(RuntimeError, match="device_type mismatch"):
        main(*args)
    host = kernel.adapter.get_host_source()  # the checks main runs before it launches
    for check in ("input lse shape[2] violates", "input Delta dtype mismatch"):
        assert check in host


def test_forward_and_dq_pass_plans_are_settled_once_a_shape(monkeypatch):
    """The eager path's plans: ``forward_plan`` and ``dq_pass_plan`` build their kernels on a
    shape's first call and reuse them after (a new shape or new tiles build again); a caller's
    tiles reach the build. The device is an H100 stand-in (132 SMs) and the builds are
    recorded, not compiled."""
    mod = load_script(FWD)
    bwd = load_script("attention_sink/example_gqa_sink_bwd_bhsd.py")
    factories = (mod, "flashattn_fwd"), (bwd, "flashattn_bwd_dq"), (bwd.fast_bwd, "flash_bwd")
    built, launches = record_launches(monkeypatch, *factories)
    with fresh_plans(mod.forward_plan, bwd.dq_pass_plan):
        check_plans_are_settled_once_a_shape(mod, bwd, built, launches)


def check_plans_are_settled_once_a_shape(mod, bwd, built, launches):
    """The body of the test above, with its stand-ins in place."""
    device = torch.device("cuda", 0)
    fwd_args = (1, 8, 2, 4096, 4096, 64, (128, 0), True, True, 0.125, "bfloat16")
    first = mod.forward_plan(*fwd_args, None, device)
    assert mod.forward_plan(*fwd_args, None, device) is first
    assert [b[0] for b in built] == ["flashattn_fwd"]
    tiles = (("block_M", 64), ("block_N", 64), ("ctas_per_sm", 1), ("num_stages", 2))
    mod.forward_plan(*fwd_args, tiles + (("q_stages", 1),), device)
    assert len(built) == 2 and built[1][2]["block_M"] == 64 and built[1][2]["num_sms"] == 132
    mod.forward_plan(1, 8, 2, 2048, 2048, *fwd_args[5:], None, device)
    assert len(built) == 3

    built.clear()
    dq_args = (1, 8, 2, 4096, 4096, 64, (128, 0), 0.125, "bfloat16", None, device)
    cfg, seq_q_pad, entries = bwd.dq_pass_plan(*dq_args)
    assert bwd.dq_pass_plan(*dq_args)[2] is entries
    assert list(entries) == ["flash_bwd_dq", "flash_bwd_dkdv"]
    assert [b[0] for b in built] == ["flashattn_bwd_dq", "flash_bwd"]  # built once, in order
    for launch in entries.values():  # each entry is its own build
        launch()
    assert [name for name, _ in launches] == ["flashattn_bwd_dq", "flash_bwd"]
    assert seq_q_pad % cfg["block_N"] == 0 and seq_q_pad >= 4096


@pytest.mark.parametrize("left,runs", [(1000, 3), (-1, 1)])
def test_key_loop_runs(left, runs):
    """A window bounded on the left: the key loop in three runs (left edge masked, whole blocks,
    right edge masked), each with its own copy of the step (one wait_wgmma<1> each); open on the
    left: the dense kernel's single loop. (A left edge that falls on a block boundary spans one
    block, the first, handled before the loop: TileLang then drops the first run, rightly.)"""
    import harness

    mod = load_script(FWD)
    cfg = dict(block_M=128, block_N=128, num_stages=2)
    args = (1, 4, 4, 4096, 4096, 128, left, 0, True, 0.125, "float16")
    src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
    assert src.count("wait_wgmma<1>") == runs


def test_compile_only_main(capsys):
    mod = load_script(FWD)
    argv = ["--compile-only", "--seq_len", "255", "--dim", "64", "--heads", "8"]
    mod.main([*argv, "--window", "64", "0", "--causal"])
    out = capsys.readouterr().out
    assert "built for sm_90a" in out and "wgmma" in out and "(64, 0)" in out


def test_hopper_only():
    with pytest.raises(ValueError, match="Hopper"):
        load_script(FWD).default_config(128, (-1, -1), "sm_100a")


def test_tune_space_builds_for_sm90():
    """Every --tune entry builds (D=64 and D=128, a causal window)."""
    import harness

    mod = load_script(FWD)
    for dim in (64, 128):
        for cfg in mod.tune_configs(dim):
            args = (1, 4, 1, 512, 512, dim, 128, 0, True, 1 / math.sqrt(dim), "float16")
            src = harness.compile_for(mod.flashattn_fwd, "sm_90a", *args, **cfg).get_kernel_source()
            assert "wgmma" in src, cfg


# ----------------------------------------------------------------------------- bad input (CPU)
def _bad_inputs():
    """(description, kwargs, expected message fragment) for every rejected input."""
    q, k, v, sinks = make_inputs(1, 16, 16, 4, 2, 64, torch.float16)
    ok = dict(q=q, k=k, v=v, sinks=sinks)
    cases = [
        ("float32", dict(ok, q=q.float()), "float16 or bfloat16"),
        ("mixed dtypes", dict(ok, k=k.bfloat16()), "share a dtype"),
        ("rank 3", dict(ok, q=q[0]), "q must be"),
        ("k/v shapes differ", dict(ok, v=v[:, :, :8]), "same shape"),
        ("head dim 256", dict(ok, q=q.repeat(1, 1, 1, 4), k=k.repeat(1, 1, 1, 4),
                              v=v.repeat(1, 1, 1, 4)), "head dim"),
        ("head dim mismatch", dict(ok, k=k[..., :32], v=v[..., :32]), "k must be"),
        ("strided last dim", dict(ok, k=k.transpose(-1, -2).contiguous().transpose(-1, -2)),
         "last dimension"),
        ("H % Hkv", dict(ok, q=q[:, :3], sinks=sinks[:3]), "H % Hkv"),
        ("CPU tensors", ok, "CUDA tensor"),
        ("sinks shape [H, 1]", dict(ok, sinks=sinks[:, None]), "sinks must be \\[heads\\]"),
        ("sinks shape [Hkv]", dict(ok, sinks=sinks[:2]), "sinks must be \\[heads\\]"),
        ("sinks float16", dict(ok, sinks=sinks.half()), "sinks must be float32"),
        ("sinks float64", dict(ok, sinks=sinks.double()), "sinks must be float32"),
        ("sinks a list", dict(ok, sinks=sinks.tolist()), "sinks must be a torch.Tensor"),
        ("sinks on another device", dict(ok, sinks=sinks.to("meta")), "sinks must be on q's"),
    ]  # fmt: skip
    for window in [(1, 2, 3), (5,), 5, None, "(-1, -1)", (-2, 0), (0, -5), (1.0, 0),
                   (0, 1.5), (True, 0), (0, False), (torch.tensor(3), 0)]:  # fmt: skip
        cases.append((f"window_size={window!r}", dict(ok, window_size=window), "window_size"))
    return cases


def test_bad_input_raises_value_error_naming_argument():
    mod = load_script(FWD)
    for what, kwargs, fragment in _bad_inputs():
        with pytest.raises(ValueError, match=fragment):
            mod.attention(**kwargs)
            pytest.fail(f"accepted bad input: {what}")


def test_good_windows_and_sinks_reach_the_device_check():
    """Valid values pass every rule but the last (CUDA tensors): lists and numpy ints for the
    window, sinks None or float32 [H], -inf sinks included."""
    import numpy as np

    mod = load_script(FWD)
    q, k, v, sinks = make_inputs(1, 16, 16, 4, 2, 64, torch.float16)
    for window in [(-1, -1), [128, 0], (0, 0), (np.int64(3), -1), (10**6, 10**6)]:
        for s in (sinks, None, torch.full((4,), -math.inf)):
            with pytest.raises(ValueError, match="CUDA tensor"):
                mod.attention(q, k, v, s, window, causal=True)


# ----------------------------------------------------------------------------- GPU
SEQS = [(1, 1), (17, 17), (255, 255), (1000, 1000), (4096, 4096), (255, 1000), (1000, 255),
        (17, 4096)]  # fmt: skip
GPU_WINDOWS = [(-1, -1), (128, 0), (1024, 0), (64, 64)]
FACTORS = {  # name: values; the matrix covers every pair of values of two factors
    "seqs": SEQS,
    "window": GPU_WINDOWS,
    "sinks": [True, False],
    "causal": [False, True],
    "groups": [1, 8],
    "dtype": [torch.float16, torch.bfloat16],
    "dim": [64, 128],
}


def _pairs(case):
    items = list(case.items())
    return {((a, va), (b, vb)) for (a, va), (b, vb) in itertools.combinations(items, 2)}


def pairwise_cases(factors=FACTORS):
    """A small set of cases holding every pair of factor values (greedy, deterministic): the
    full product is 1024 cases, each its own kernel build."""
    names = list(factors)
    product = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())
    ]  # noqa: E501
    uncovered = set().union(*(_pairs(c) for c in product))
    cases = []
    while uncovered:
        best = max(product, key=lambda c: len(_pairs(c) & uncovered))
        cases.append(best)
        uncovered -= _pairs(best)
    return cases


def test_gpu_matrix_covers_every_pair():
    cases = pairwise_cases()
    assert len(cases) <= 60
    covered = set().union(*(_pairs(c) for c in cases))
    for (a, va), (b, vb) in itertools.combinations(
        [(n, v) for n, vals in FACTORS.items() for v in vals], 2
    ):
        if a != b:
            assert ((a, va), (b, vb)) in covered, (a, va, b, vb)


def _case_id(c):
    Sq, Sk = c["seqs"]
    dt = "f16" if c["dtype"] == torch.float16 else "bf16"
    return (
        f"Sq{Sq}-Sk{Sk}-w{c['window'][0]}_{c['window'][1]}-"
        f"{'causal' if c['causal'] else 'full'}-{'sinks' if c['sinks'] else 'nosinks'}-"
        f"g{c['groups']}-D{c['dim']}-{dt}"
    )


def check_forward(mod, B, Sq, Sk, H, Hkv, D, window, causal, sinks, dtype, scale=1.0, cfg=None):
    q, k, v, s = make_inputs(B, Sq, Sk, H, Hkv, D, dtype, "cuda", scale, sinks)
    out, lse = mod.attention(q, k, v, s, window, causal, return_lse=True, config=cfg)
    ref_out, ref_lse = mod.ref_program(q, k, v, s, window, causal, return_lse=True)
    assert rel_err(out, ref_out) < 1e-2  # fp16/bf16 output
    assert rel_err(lse, ref_lse) < 1e-4  # lse from fp32 scores: much tighter
    empty = ~mod.window_mask(Sq, Sk, window, causal, "cuda").any(-1)
    assert torch.all(out[:, :, empty] == 0) and torch.all(torch.isposinf(lse[:, :, empty]))
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("case", pairwise_cases(), ids=_case_id)
def test_forward_matches_reference(case, poisoned_empty):
    mod = load_script(FWD)
    Sq, Sk = case["seqs"]
    B = 1 if max(Sq, Sk) == 4096 else 2
    check_forward(
        mod, B, Sq, Sk, 8, 8 // case["groups"], case["dim"], case["window"], case["causal"],
        case["sinks"], case["dtype"],
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,Sq,Sk,H,Hkv,D,window,causal,dtype,scale",
    [
        (2, 1000, 1000, 8, 1, 128, (128, 0), True, torch.bfloat16, 10),  # large logits
        (2, 1000, 1000, 8, 2, 64, (64, 64), False, torch.float16, 10),
        (2, 1000, 255, 8, 2, 128, (3, 0), True, torch.float16, 1),  # 745 rows see no key
        (2, 300, 300, 16, 1, 64, (0, 0), False, torch.bfloat16, 1),  # one key a row
        (3, 1000, 1000, 32, 4, 128, (128, 0), True, torch.bfloat16, 1),  # many tiles per SM
        # one-sided windows with more tiles than SMs: the tiles from the counter
        (3, 1000, 1000, 32, 4, 64, (-1, -1), True, torch.float16, 1),  # causal
        (3, 1400, 1400, 9, 3, 128, (-1, -1), True, torch.bfloat16, 1),  # 11 blocks, 27 heads
        (2, 1000, 1000, 40, 40, 128, (-1, 200), False, torch.float16, 1),  # left unbounded
        (2, 1000, 1000, 40, 5, 64, (200, -1), False, torch.bfloat16, 1),  # right unbounded
        (1, 3000, 3000, 28, 4, 64, (-1, -1), True, torch.bfloat16, 1),  # 192-row tiles, 1 Q slot
        (1, 4000, 4000, 16, 2, 128, (-1, -1), True, torch.bfloat16, 1),  # last of 32 blocks partial
        (1, 4096, 4096, 16, 16, 128, (4095, 0), False, torch.float16, 1),  # = causal
        (2, 255, 255, 16, 1, 128, (64, 64), True, torch.bfloat16, 1),  # causal: (64, 0)
    ],
)
def test_forward_edge_cases(B, Sq, Sk, H, Hkv, D, window, causal, dtype, scale, poisoned_empty):
    check_forward(load_script(FWD), B, Sq, Sk, H, Hkv, D, window, causal, True, dtype, scale)


@pytest.mark.gpu
def test_sinks_of_every_size(poisoned_empty):
    """Per head: a sink far above the scores (the keys get almost no weight), far below, -inf
    (= no sink), 0; the numbers stay finite and -inf sinks equal sinks=None."""
    mod = load_script(FWD)
    q, k, v, _ = make_inputs(2, 1000, 1000, 4, 2, 128, torch.bfloat16, "cuda")
    sinks = torch.tensor([40.0, -40.0, -math.inf, 0.0], device="cuda")
    for window, causal in (((128, 0), True), ((-1, -1), False)):
        out, lse = mod.attention(q, k, v, sinks, window, causal, return_lse=True)
        ref_out, ref_lse = mod.ref_program(q, k, v, sinks, window, causal, return_lse=True)
        assert rel_err(out, ref_out) < 1e-2 and rel_err(lse, ref_lse) < 1e-4
        assert torch.all(out[:, 0].abs() < 1e-6)  # sink 40: exp(40) outweighs every key
        none = torch.full((4,), -math.inf, device="cuda")
        plain = mod.attention(q, k, v, None, window, causal)
        assert rel_err(mod.attention(q, k, v, none, window, causal), plain) < 1e-3


@pytest.mark.gpu
def test_blocks_outside_the_window_are_never_read():
    """K and V are NaN wherever no tile's window reaches (a NaN V in any block the kernel
    loads would reach O through P V, masked or not): the output is still the reference's."""
    mod = load_script(FWD)
    Sq, Sk, window = 128, 4096, (64, 0)
    q, k, v, sinks = make_inputs(2, Sq, Sk, 8, 1, 128, torch.float16, "cuda")
    out_ref = mod.ref_program(q, k, v, sinks, window, False)
    first = Sk - Sq - window[0]  # row 0's first key; every row starts at or after it
    k[:, :, : first // 128 * 128] = math.nan
    v[:, :, : first // 128 * 128] = math.nan
    out = mod.attention(q, k, v, sinks, window)
    assert rel_err(out, out_ref) < 1e-2


@pytest.mark.gpu
def test_causal_ignores_right():
    mod = load_script(FWD)
    q, k, v, sinks = make_inputs(2, 500, 700, 8, 2, 64, torch.float16, "cuda")
    a = mod.attention(q, k, v, sinks, (100, 37), causal=True)
    b = mod.attention(q, k, v, sinks, (100, 0), causal=False)
    assert torch.equal(a, b)


def _tune_cases():
    mod = load_script(FWD)
    return [(dim, cfg) for dim in (64, 128) for cfg in mod.tune_configs(dim)]


@pytest.mark.gpu
@pytest.mark.parametrize("dim,cfg", _tune_cases(), ids=lambda x: str(x))
def test_tune_space_is_correct(dim, cfg, poisoned_empty):
    """Every configuration --tune may pick: ragged, Sq != Sk, a window narrower than a block."""
    mod = load_script(FWD)
    check_forward(mod, 2, 300, 333, 4, 2, dim, (50, 0), True, True, torch.float16, cfg=cfg)
    check_forward(mod, 2, 300, 333, 4, 4, dim, (100, 30), False, True, torch.bfloat16, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        ["--window", "128", "0", "--causal"],
        ["--window", "64", "64", "--no-sinks", "--dtype", "bfloat16", "--seq_len_k", "700"],
        ["--groups", "1", "--causal"],
    ],
)
def test_main_small(extra, capsys):
    argv = ["--batch", "1", "--heads", "8", "--seq_len", "1000", "--dim", "64", *extra]
    load_script(FWD).main(argv)
    out = capsys.readouterr().out
    assert "out " in out and "lse " in out and "tilelang" in out
    assert "flex_attention" in out and "tilelang dense" in out


# ----------------------------------------------------------------------------- backward (CPU)
BWD = "attention_sink/example_gqa_sink_bwd_bhsd.py"


def test_backward_reference_forward_is_the_forward_reference():
    """The differentiable reference (sink as a logit column) computes what the forward's does."""
    bwd, mod = load_script(BWD), load_script(FWD)
    for window, causal in (((5, 2), False), ((-1, -1), True), ((3, 0), False)):
        q, k, v, sinks = make_inputs(2, 30, 20, 4, 2, 16, dtype=torch.float64)
        for s in (sinks.double(), None):
            a = bwd.ref_program(q, k, v, s, window, causal, 0.3)
            b = mod.ref_program(q, k, v, s, window, causal, 0.3)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((7, 0), True), ((4, 4), False)])
def test_sink_grad_matches_autograd(window, causal):
    """dsinks[h] = −Σ_rows exp(sink_h − lse)·rowsum(O ∘ dO), lse from the forward (the sink
    included, +inf for rows that see no key), against autograd through the reference."""
    bwd, mod = load_script(BWD), load_script(FWD)
    q, k, v, sinks = make_inputs(2, 25, 18, 4, 2, 16, dtype=torch.float64)
    sinks = sinks.double().requires_grad_()
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = bwd.ref_program(q, k, v, sinks, window, causal, 0.3)
    (expect,) = torch.autograd.grad(out, sinks, dout)
    out2, lse = mod.ref_program(q, k, v, sinks.detach(), window, causal, 0.3, return_lse=True)
    delta = (out2 * dout).sum(-1)
    assert torch.isposinf(lse).any() == (causal or window == (4, 4))  # Sq > Sk: empty rows
    torch.testing.assert_close(bwd.ref_sink_grad(sinks.detach(), lse, delta).double(), expect)
    # delta padded past Sq (as the group backward returns it): the padding is not read.
    padded = torch.cat([delta, torch.full_like(delta[:, :, :5], math.nan)], dim=2)
    torch.testing.assert_close(bwd.ref_sink_grad(sinks.detach(), lse, padded).double(), expect)


def _key_blocks_seen(Sq, Sk):
    """For every small window, causal or not, tile and key block bx: (where, (left, right),
    tile, bx, cols, seen) — ``cols[k]`` the mask of query block k against the key block's keys,
    ``seen`` the query blocks with a query that sees one of them."""
    mod = load_script(FWD)
    for window, causal, (block_M, block_N) in itertools.product(
        SMALL_WINDOWS, (False, True), TILES
    ):
        n_q_blocks = math.ceil(Sq / block_N)
        padded = torch.zeros(n_q_blocks * block_N, Sk, dtype=torch.bool)
        padded[:Sq] = mod.window_mask(Sq, Sk, window, causal)
        for bx in range(math.ceil(Sk / block_M)):
            cols = padded[:, bx * block_M : (bx + 1) * block_M].reshape(n_q_blocks, block_N, -1)
            seen = cols.any(-1).any(-1).nonzero().flatten().tolist()
            where = (Sq, Sk, window, causal, block_M, block_N, bx)
            edges = mod.normalize_window(window, causal, Sq, Sk)
            yield where, edges, (block_M, block_N), bx, cols, seen


def _assert_range(q_start, n_q, seen, n_q_blocks, key_tail, where):
    """Every seen query block and no other; the ragged last key block may visit more after
    them (fully masked)."""
    if seen and key_tail:
        assert q_start == seen[0] and q_start + n_q - 1 >= seen[-1], where
        assert q_start + n_q <= n_q_blocks, where
    elif seen:
        assert (q_start, n_q) == (seen[0], seen[-1] - seen[0] + 1), where


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_window_query_blocks_are_exactly_the_blocks_seen(Sq, Sk):
    """The ``atomic`` backward's loop, for a key block: every query block with a query that
    sees one of its keys (one, masked whole, when none does); blocks left unmasked see every
    key of the key block whole."""
    bwd = load_script(BWD)
    for where, (left, right), (block_M, block_N), bx, cols, seen in _key_blocks_seen(Sq, Sk):
        q_start, n_q, first_whole, end_whole = (
            int(x) for x in bwd.window_query_blocks(bx, block_M, block_N, Sq, Sk, left, right)
        )
        key_tail = (bx + 1) * block_M > Sk
        _assert_range(q_start, n_q, seen, len(cols), key_tail, where)
        if not seen:
            assert n_q == 1 and 0 <= q_start < len(cols), where
        for k in range(q_start, q_start + n_q):
            if not (key_tail or k < first_whole or k >= end_whole):
                assert cols[k].all(), (*where, k)


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_fast_query_block_range_is_exactly_the_blocks_seen(Sq, Sk):
    """The ``group`` backward (example_mha_bwd_wgmma_pipelined.py's kernel with a window): a
    key block walks every query block with a query that sees one of its keys, none when no
    query does."""
    fast = load_script(FAST_BWD)
    for where, (left, right), (block_M, block_N), bx, cols, seen in _key_blocks_seen(Sq, Sk):
        edges = (left, right, Sk - Sq + right, Sk - Sq - left)
        q_pad = len(cols) * block_N
        q_start, n_q = (int(x) for x in fast.query_block_range(bx, block_M, block_N, q_pad, edges))
        _assert_range(q_start, n_q, seen, len(cols), (bx + 1) * block_M > Sk, where)
        if not seen:
            assert n_q == 0, where


def emulate_backward(bwd, mod, q, k, v, dout, sinks, window_size, causal, scale, block_M, block_N):
    """The backward kernel's loop on the CPU in float64: per key block and head, the query blocks
    of window_query_blocks, P from the forward's lse, the mask only where the kernel applies
    it, dv, dk, dq accumulated as the kernel does; dsinks by ref_sink_grad."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    groups = H // k.shape[1]
    left, right = mod.normalize_window(window_size, causal, Sq, Sk)
    out, lse = mod.ref_program(q, k, v, sinks, window_size, causal, scale, return_lse=True)
    delta = (out * dout).sum(-1)
    offset = Sk - Sq
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    pad_q = math.ceil(Sq / block_N) * block_N + block_N
    for b, h, bx in itertools.product(range(B), range(H), range(math.ceil(Sk / block_M))):
        q_start, n_q, first_whole, end_whole = (
            int(x) for x in bwd.window_query_blocks(bx, block_M, block_N, Sq, Sk, left, right)
        )
        keys = torch.arange(bx * block_M, (bx + 1) * block_M)
        kt, vt = (torch.zeros(block_M, D, dtype=torch.float64) for _ in range(2))
        n = min(block_M, Sk - bx * block_M)
        kt[:n], vt[:n] = k[b, h // groups, keys[:n]], v[b, h // groups, keys[:n]]
        qp, dop = (torch.zeros(pad_q, D, dtype=torch.float64) for _ in range(2))
        lp, dp_ = torch.zeros(pad_q, dtype=torch.float64), torch.zeros(pad_q, dtype=torch.float64)
        qp[:Sq], dop[:Sq], lp[:Sq], dp_[:Sq] = q[b, h], dout[b, h], lse[b, h], delta[b, h]
        dk_t, dv_t = torch.zeros(block_M, D, dtype=torch.float64), torch.zeros_like(vt)
        for kq in range(q_start, q_start + n_q):
            rows = torch.arange(kq * block_N, (kq + 1) * block_N)
            p = torch.exp(kt @ qp[rows].T * scale - lp[rows][None, :])  # Pᵀ [keys, queries]
            if (bx + 1) * block_M > Sk or kq < first_whole or kq >= end_whole:
                vis = (keys[:, None] < Sk) & (rows[None, :] < Sq)
                centre = rows[None, :] + offset
                if right >= 0:
                    vis &= keys[:, None] <= centre + right
                if left >= 0:
                    vis &= keys[:, None] >= centre - left
                p = p.masked_fill(~vis, 0.0)
            dpt = vt @ dop[rows].T
            dv_t += p @ dop[rows]
            ds = p * (dpt - dp_[rows][None, :]) * scale
            dk_t += ds @ qp[rows]
            real = rows < Sq
            dq[b, h, rows[real]] += (ds.T @ kt)[real]
        dk[b, h // groups, keys[:n]] += dk_t[:n]
        dv[b, h // groups, keys[:n]] += dv_t[:n]
    dsinks = None if sinks is None else bwd.ref_sink_grad(sinks, lse, delta)
    return dq, dk, dv, dsinks


@pytest.mark.parametrize(
    "Sq,Sk,window,causal,tile",
    [
        (40, 40, (8, 0), False, (16, 8)),
        (37, 61, (5, 5), False, (8, 16)),
        (61, 37, (12, 0), True, (16, 8)),  # rows that see no key
        (50, 50, (3, -1), False, (16, 8)),
        (45, 45, (-1, -1), True, (12, 8)),
    ],
)
def test_backward_tile_loop_matches_autograd(Sq, Sk, window, causal, tile):
    """The backward kernel's loop structure (query block ranges, edge-only masks, P from lse,
    dsinks from lse and delta), emulated with small tiles, gives autograd's gradients."""
    bwd, mod = load_script(BWD), load_script(FWD)
    q, k, v, sinks = make_inputs(2, Sq, Sk, 4, 2, 16, dtype=torch.float64)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for s in (sinks.double(), None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
            [s.clone().requires_grad_()] if s is not None else []
        )  # noqa: E501
        out = bwd.ref_program(
            *leaves[:3], leaves[3] if s is not None else None, window, causal, 0.25
        )  # noqa: E501
        expect = torch.autograd.grad(out, leaves, dout)
        got = emulate_backward(bwd, mod, q, k, v, dout, s, window, causal, 0.25, *tile)
        for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expect, strict=False):
            assert rel_err(g, e) < 1e-12, name


def emulate_dq_pass(bwd, mod, q, k, v, dout, sinks, window_size, causal, scale, block_M, block_N):
    """``flashattn_bwd_dq``'s loop on the CPU in float64: per query block and head, the key
    blocks of window_key_blocks, P from the forward's lse (+inf on rows past Sq), the mask only
    on the blocks window_mask_runs leaves masked, dQ summed in the block's own rows."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    groups = H // k.shape[1]
    left, right = mod.normalize_window(window_size, causal, Sq, Sk)
    out, lse = mod.ref_program(q, k, v, sinks, window_size, causal, scale, return_lse=True)
    delta = (out * dout).sum(-1)
    offset = Sk - Sq
    n_q = math.ceil(Sq / block_M)
    pad_k = math.ceil(Sk / block_N) * block_N + block_N
    dq = torch.zeros_like(q)
    for b, h, bx in itertools.product(range(B), range(H), range(n_q)):
        n_start, n_blocks = (
            int(x) for x in mod.window_key_blocks(bx, block_M, block_N, Sq, Sk, left, right)
        )
        runs = mod.window_mask_runs(bx, n_start, n_blocks, block_M, block_N, Sq, Sk, left, right)
        n_left, n_inner_end = (int(x) for x in runs)
        rows = torch.arange(bx * block_M, (bx + 1) * block_M)
        real = rows < Sq
        qt, dot = (torch.zeros(block_M, D, dtype=torch.float64) for _ in range(2))
        qt[real], dot[real] = q[b, h, rows[real]], dout[b, h, rows[real]]
        lse2 = torch.full((block_M,), math.inf, dtype=torch.float64)
        dl = torch.zeros(block_M, dtype=torch.float64)
        lse2[real], dl[real] = lse[b, h, rows[real]], delta[b, h, rows[real]]
        kp, vp = (torch.zeros(pad_k, D, dtype=torch.float64) for _ in range(2))
        kp[:Sk], vp[:Sk] = k[b, h // groups], v[b, h // groups]
        acc = torch.zeros(block_M, D, dtype=torch.float64)
        for n in range(n_blocks):
            keys = torch.arange((n_start + n) * block_N, (n_start + n + 1) * block_N)
            p = torch.exp(qt @ kp[keys].T * scale - lse2[:, None])
            if n < n_left or n >= n_inner_end:
                vis = keys[None, :] < Sk
                centre = rows[:, None] + offset
                if right >= 0:
                    vis = vis & (keys[None, :] <= centre + right)
                if left >= 0:
                    vis = vis & (keys[None, :] >= centre - left)
                p = p.masked_fill(~vis, 0.0)
            ds = p * (dot @ vp[keys].T - dl[:, None])
            acc += ds @ kp[keys]
        dq[b, h, rows[real]] = (acc * scale)[real]
    return dq


@pytest.mark.parametrize(
    "Sq,Sk,window,causal,tile",
    [
        (40, 40, (8, 0), False, (16, 8)),
        (37, 61, (5, 5), False, (8, 16)),
        (61, 37, (12, 0), True, (16, 8)),  # rows that see no key
        (50, 50, (0, 0), False, (8, 8)),
        (45, 70, (3, 9), True, (16, 16)),  # causal: (3, 0)
    ],
)
def test_dq_pass_loop_matches_autograd(Sq, Sk, window, causal, tile):
    """The dQ pass's loop (key block ranges, edge-only masks, P from lse, padded rows), emulated
    with small tiles, gives autograd's dq."""
    bwd, mod = load_script(BWD), load_script(FWD)
    q, k, v, sinks = make_inputs(2, Sq, Sk, 4, 2, 16, dtype=torch.float64)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks.double())]
    out = bwd.ref_program(*leaves, window, causal, 0.25)
    expect = torch.autograd.grad(out, leaves[0], dout)[0]
    got = emulate_dq_pass(bwd, mod, q, k, v, dout, sinks.double(), window, causal, 0.25, *tile)
    assert rel_err(got, expect) < 1e-12


@pytest.mark.parametrize(
    "window,kernels",
    [
        ((256, 0), ("flash_fwd", "flash_bwd_prep", "flash_bwd", "flash_bwd_post")),
        ((128, 0), ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")),
    ],
)
def test_backward_builds_for_sm90(window, kernels, capsys):
    """--compile-only builds every kernel of a training step (a causal window, Sq != Sk). The
    backward (strategy group, the default) at D128: a window wider than 128 keys takes the
    fused kernel, which adds dQ with the bulk reduce-add; a narrower one the dQ pass, whose two
    kernels add nothing anywhere, and the hand-scheduled kernel without its dQ half."""
    load_script(BWD).main(
        ["--compile-only", "--seq_len", "1000", "--seq_len_k", "777", "--heads", "8",
         "--window", *map(str, window), "--causal", "--dim", "128"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "built for sm_90a" in out
    lines = {
        line.split(":")[0].strip(): line for line in out.splitlines() if "lines of CUDA" in line
    }  # noqa: E501
    assert list(lines) == [*kernels, "flash_bwd_sinks"]
    backward = kernels[2]
    assert "wgmma" in lines[backward] and "tma" in lines[backward]
    if window == (128, 0):
        assert "wgmma" in lines["flash_bwd_dq"]
        assert "bulk-reduce" not in lines[backward] and "atomics" not in lines[backward]
        assert "atomics" not in lines["flash_bwd_dq"]
    else:
        assert "bulk-reduce" in lines[backward]


@pytest.mark.parametrize(
    "window,dim,pays",
    [((128, 0), 128, True), ((64, 64), 128, True), ((0, 0), 128, True), ((129, 0), 128, False),
     ((256, 0), 64, True), ((192, 64), 64, True), ((257, 0), 64, False), ((256, 0), 128, False),
     ((1024, 0), 64, False), ((-1, 0), 64, False), ((16, -1), 64, False), ((-1, -1), 128, False)],
)  # fmt: skip
def test_dq_pass_takes_the_narrow_windows(window, dim, pays):
    assert load_script(BWD).dq_pass_pays(*window, dim) is pays


def test_dq_pass_keeps_its_grid_order():
    """A config's ``interleave`` (the order of the hand-scheduled backward's launches with dQ)
    does not reach the dQ pass's dK/dV-only launch, whose kernel refuses it."""
    bwd, fast = load_script(BWD), load_script(FAST_BWD)
    cfg = dict(bwd.dkdv_config(64, fast.default_config(64)), interleave=4)
    kernels = bwd.dq_pass_kernels(1, 64, 8, 4096, 4096, 64, 128, 0, 0.125, "bfloat16", cfg)
    assert kernels["flash_bwd_dkdv"][2]["interleave"] == 1


@pytest.mark.parametrize(
    "D,window,Sq,Sk",
    [(64, (128, 0), 4096, 4096), (128, (128, 0), 1000, 777), (64, (64, 64), 255, 1000)],
)
def test_dq_pass_builds_clean(D, window, Sq, Sk):
    """The dQ pass's kernels for sm_90a: ``flash_bwd_dq`` (TileLang's pipeline, WGMMA) and the
    hand-scheduled kernel with ``with_dq=False`` (setmaxnreg and mbarriers, no dQ tile, no
    reduce-add), each without spills or a serialized WGMMA (ptxas); groups of 8. At D = 64 the
    latter takes ``dkdv_config``'s tiles: one consumer warpgroup, two thread blocks an SM, whose
    registers and shared memory fit twice."""
    from test_flash_bwd_fast import assert_clean_build, ptxas_report

    import harness

    bwd, fast = load_script(BWD), load_script(FAST_BWD)
    cfg = bwd.dkdv_config(D, fast.default_config(D))
    kernels = bwd.dq_pass_kernels(1, 64, 8, Sq, Sk, D, *window, D**-0.5, "bfloat16", cfg)
    assert list(kernels) == ["flash_bwd_dq", "flash_bwd_dkdv"]
    built = {
        name: harness.compile_for(factory, "sm_90a", *args, **kw)
        for name, (factory, args, kw) in kernels.items()
    }
    src = built["flash_bwd_dq"].get_kernel_source()
    assert "wgmma" in src and "atomic" not in src.lower()
    report = ptxas_report(src)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report
    assert "Potential Performance Loss" not in report
    dkdv = built["flash_bwd_dkdv"]
    src = dkdv.get_kernel_source()
    assert "cp.reduce.async.bulk" not in src and "dq_store_or_add" not in src
    assert "setmaxnreg" in src or "warpgroup_reg_alloc" in src
    if D == 64:
        assert cfg["block_M"] == cfg["block_N"] == 64 and "__launch_bounds__(256, 2)" in src
        report = assert_clean_build(dkdv, threads=256, consumer_regs=232)
        static = int(re.search(r"(\d+) bytes smem", report).group(1))
        # An H100 SM has 228 KB of shared memory, 1 KB of it reserved for each thread block.
        assert 2 * (harness.dynamic_smem_bytes(dkdv) + static + 1024) <= 228 * 1024
    else:
        assert cfg == fast.default_config(D) and "__launch_bounds__(384, 1)" in src
        assert_clean_build(dkdv)


def test_two_thread_blocks_an_sm_only_without_dq():
    """``ctas_per_sm=2`` is for the one-warpgroup dK/dV kernel: with 128 keys (two consumer
    warpgroups) or with dQ the registers of two thread blocks do not fit."""
    fast = load_script(FAST_BWD)
    args = (1, 8, 256, 256, 64, True, 0.125, "bfloat16")
    for kw in (dict(block_M=128), dict(block_M=64, with_dq=True), dict(block_M=64, ctas_per_sm=3)):
        kw = {"ctas_per_sm": 2, "with_dq": False, **kw}
        with pytest.raises(ValueError, match="ctas_per_sm"):
            fast.flash_bwd.func.orig_func(*args, block_N=64, **kw)


def test_backward_command_line_and_bad_input(capsys):
    bwd = load_script(BWD)
    parser = bwd.build_parser()
    assert "--tune" not in parser._option_string_actions
    assert parser.parse_args(["--window", "64", "0", "--no-sinks"]).window == [64, 0]
    with pytest.raises(SystemExit):
        bwd.main(["--compile-only", "--window", "-3", "0"])
    q, k, v, sinks = make_inputs(1, 16, 16, 4, 2, 64, torch.float16)
    for kwargs, fragment in (
        (dict(window_size=(1, 2, 3)), "window_size"),
        (dict(sinks=sinks.half()), "sinks must be float32"),
        (dict(causal=1), "causal"),
        (dict(), "CUDA tensor"),
    ):
        with pytest.raises(ValueError, match=fragment):
            bwd.attention(q, k, v, **{"sinks": sinks, **kwargs})


# ----------------------------------------------------------------------------- backward (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,Sq,Sk,H,Hkv,D,window,causal,sinks,dtype",
    [
        (2, 1000, 1000, 8, 1, 128, (128, 0), True, True, torch.bfloat16),
        (2, 1000, 1000, 8, 2, 64, (64, 64), False, True, torch.float16),
        (2, 255, 1000, 8, 8, 128, (-1, -1), True, True, torch.float16),
        (2, 1000, 255, 8, 2, 64, (3, 0), True, True, torch.bfloat16),  # rows that see no key
        (1, 4096, 4096, 8, 1, 64, (1024, 0), False, True, torch.float16),
        (2, 17, 17, 4, 4, 128, (-1, -1), False, False, torch.bfloat16),
        (2, 1000, 1000, 8, 2, 128, (200, -1), False, False, torch.float16),
        (2, 128, 2048, 8, 1, 64, (64, 0), False, True, torch.bfloat16),  # keys no query sees
        (2, 4096, 4096, 16, 2, 128, (1024, 0), True, True, torch.bfloat16),
        (1, 777, 1000, 8, 8, 64, (-1, 100), False, True, torch.float16),
        # No window, no mask: the fast backward's last wave in parts (160 thread blocks, the
        # last 28 in 4 parts each; tail_split_plan) on the BHSD layout.
        (1, 4096, 4096, 20, 5, 128, (-1, -1), False, True, torch.bfloat16),
        # The dQ pass (dq_pass_pays): one row, Sq != Sk both ways, a diagonal-only window,
        # few queries against many keys, a long sequence with groups of 8.
        (1, 1, 1, 8, 1, 64, (128, 0), True, True, torch.float16),
        (2, 255, 1000, 16, 2, 128, (64, 64), False, True, torch.float16),
        (2, 1000, 777, 8, 8, 64, (0, 0), False, True, torch.bfloat16),
        (2, 17, 4096, 8, 2, 64, (100, 28), False, True, torch.bfloat16),
        (1, 4096, 4096, 8, 1, 128, (128, 0), True, True, torch.bfloat16),
        # Up to 256 keys wide at D64: the dQ pass; at D128 the same window takes the fused kernel.
        (2, 1000, 1000, 8, 2, 64, (256, 0), True, True, torch.float16),
        (2, 777, 1000, 8, 8, 64, (192, 64), False, True, torch.bfloat16),
        (2, 1000, 1000, 8, 2, 128, (256, 0), True, True, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("strategy", ["group", "atomic"])
def test_backward_matches_autograd(
    B, Sq, Sk, H, Hkv, D, window, causal, sinks, dtype, strategy, poisoned_empty
):  # noqa: E501
    bwd = load_script(BWD)
    q, k, v, s = make_inputs(B, Sq, Sk, H, Hkv, D, dtype, "cuda", 1.0, sinks)
    dout = seeded_dout(q)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([s.requires_grad_()] if sinks else [])
    out = bwd.attention(q, k, v, s, window, causal, strategy=strategy)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = bwd.ref_program(*ref_leaves[:3], ref_leaves[3] if sinks else None, window, causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    assert rel_err(out, ref) < 1e-2  # fp16/bf16 output
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=False):
        assert rel_err(g, r) < 2e-2, name  # gradients


@pytest.mark.gpu
def test_dq_pass_with_head_splits_matches_autograd():
    """A caller's ``config`` with ``head_splits`` > 1 on the dQ pass's path (the default never
    splits a window's heads): the dK/dV kernel writes each part's float32 dK and dV, and
    ``flash_bwd_post_kv`` sums them."""
    bwd = load_script(BWD)
    q, k, v, s = make_inputs(1, 1000, 1000, 8, 2, 64, torch.bfloat16, "cuda", 1.0, True)
    dout = seeded_dout(q)
    leaves = [t.requires_grad_() for t in (q, k, v, s)]
    config = {**load_script(FAST_BWD).default_config(64), "head_splits": 2}
    out = bwd.attention(*leaves, (128, 0), True, strategy="group", config=config)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = bwd.ref_program(*ref_leaves, (128, 0), True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert rel_err(g, r) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,H,Sq,delta_len", [(1, 1, 1, 64), (2, 8, 17, 64), (3, 4, 1000, 1024), (1, 64, 4096, 4096),
                         (2, 2, 5000, 5120)]
)  # fmt: skip
def test_sink_grad_kernel_matches_torch(B, H, Sq, delta_len):
    """flashattn_bwd_sinks against ref_sink_grad in float64: one row to several chunks of
    rows, odd lengths, rows with lse = +inf (no key), delta padded with NaN rows it must not
    read."""
    bwd = load_script(BWD)
    g = torch.Generator(device="cuda").manual_seed(0)
    sinks = torch.randn(H, generator=g, device="cuda") * 2
    lse = torch.randn(B, H, Sq, generator=g, device="cuda") * 3 + 4
    lse[:, :, 1::7] = math.inf
    delta = torch.full((B, H, delta_len), math.nan, device="cuda")
    delta[:, :, :Sq] = torch.randn(B, H, Sq, generator=g, device="cuda")
    got = bwd.sink_grad(sinks, lse, delta)
    expect = bwd.ref_sink_grad(sinks.double(), lse.double(), delta.double())
    assert torch.isfinite(got).all()
    assert rel_err(got, expect) < 1e-4  # float32 sums of up to 10^4 terms


@pytest.mark.gpu
def test_forward_and_backward_replay_in_a_cuda_graph():
    """The sink operators capture in a CUDA graph (they launch on PyTorch's current stream and
    never wait on the host; benchmarks/bench_sink.py times them so), and a replay on new input
    values gives what eager gives: forward and backward, window 128, GQA 8, D64, sinks."""
    bwd = load_script(BWD)
    q, k, v, s = make_inputs(1, 1000, 1000, 8, 1, 64, torch.bfloat16, "cuda", 1.0, True)
    dout = seeded_dout(q)
    leaves = [t.requires_grad_() for t in (q, k, v, s)]

    def step():
        out = bwd.attention(*leaves, (128, 0), True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    # The benchmark's own capture (warm-up on a side stream, then the graph); its last call of
    # the function is the captured one, whose outputs each replay rewrites.
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import bench_sink

    outputs = []
    replay = bench_sink.graphed(lambda: outputs.append(step()))
    captured = outputs[-1]
    with torch.no_grad():  # new values in the captured input tensors
        for t in (*leaves, dout):
            t.copy_(torch.randn_like(t) * (2 if t is s else 1))
    replay()
    torch.cuda.synchronize()
    expect = step()
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), captured, expect, strict=True):
        assert rel_err(got, want) < 1e-3, name  # dQ's reduce-adds may add in another order


@pytest.mark.gpu
def test_backward_main_small(capsys):
    argv = ["--batch", "1", "--heads", "8", "--seq_len", "1000", "--dim", "64"]
    load_script(BWD).main([*argv, "--window", "128", "0", "--causal"])
    out = capsys.readouterr().out
    assert "dsinks" in out and "tilelang" in out


def test_backward_strategies():
    """``group`` (the hand-scheduled backward) is the default on Hopper; an unknown strategy
    is a ValueError before any device check; --strategy picks one."""
    bwd = load_script(BWD)
    assert bwd.default_strategy(64) == bwd.default_strategy(128) == "group"
    assert bwd.default_config(128, strategy="group") == load_script(FAST_BWD).default_config(128)
    assert bwd.build_parser().parse_args(["--strategy", "atomic"]).strategy == "atomic"
    q, k, v, sinks = make_inputs(1, 16, 16, 4, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="strategy"):
        bwd.attention(q, k, v, sinks, strategy="split")


@pytest.mark.parametrize(
    "D,window,S", [(64, (128, 0), 4096), (128, (1024, 0), 8192), (64, (64, 64), 4096)]
)
def test_group_backward_with_a_window_spills_nothing(D, window, S):
    """The hand-scheduled kernel with both window edges masked (BHSD, groups of 8): no spills,
    no serialized WGMMA (ptxas), as without a window. These windows are bounded on both sides,
    so the backward is one launch with ready flags (``ordered_store``): each dQ tile's lowest
    key block stores it with a bulk copy and raises its flag (release), the others wait for the
    flag (acquire) and then add; the prep zeroes nothing."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    fast = load_script(FAST_BWD)
    cfg = fast.default_config(D)
    kernels = fast.backward_kernels(S, S, D, False, D**-0.5, "bfloat16", cfg, 8, window, "bhsd")
    assert list(kernels) == ["flash_bwd_prep", "flash_bwd_ordered", "flash_bwd_post"]
    assert kernels["flash_bwd_prep"][2]["zero_dq"] is False
    factory, args, kw = kernels["flash_bwd_ordered"]
    src = harness.compile_for(factory, "sm_90a", 1, 64, *args, **kw).get_kernel_source()
    assert "dq_store_or_add(" in src and "dq_publish(" in src
    for ptx in ("cp.async.bulk.global.shared::cta", "ld.acquire.gpu", "st.release.gpu"):
        assert ptx in src, ptx
    # At D = 128 both edges are one unsigned compare of the key's distance past the window's
    # first key (two selects there made nvcc branch around each exp2); D = 64 keeps the selects.
    width = window[0] + window[1]
    compare = re.search(r"\(\*\(uint \*\)\(&\(\w+\)\)\) <= \(uint\)" + str(width) + r"\b", src)
    assert bool(compare) == (D == 128)
    # D = 128: one grid index in ``launch_order`` (the window's top key blocks, cut short by the
    # end of the queries, launch last); D = 64 keeps the grid of (key block, kv head, batch).
    n_long = fast.longest_walks(S, S, False, window, cfg["block_M"], cfg["block_N"])
    assert (f"((int)blockIdx.x) < {n_long * 8})" in src) == (D == 128)
    assert ("blockIdx.y" in src) == (D == 64)
    report = ptxas_report(src)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report
    assert "Potential Performance Loss" not in report


@pytest.mark.parametrize("D", [64, 128])
def test_backward_dq_atomics_follow_the_layout(D):
    """dQ is added by atomics into a buffer laid out by ``dq_layout`` (columns d and d + 1 lie 32
    floats apart), so its atomics must stay scalar, each at its laid-out address: the guard
    against TileLang vectorizing an atomic add without its destination's layout (upstream "Auto
    Vectorization on AtomicAdd Ignores BufferLayout and LowerArgs"). dK/dV, in a plain layout,
    take four-float atomics. Groups of 8, a window, S not a multiple of the block."""
    import harness

    bwd = load_script(BWD)
    args = (1, 8, 1, 1000, 1000, D, 128, 0, D**-0.5, "bfloat16")
    kernel = harness.compile_for(bwd.flashattn_bwd, "sm_90a", *args, **bwd.default_config(D))
    src = kernel.get_kernel_source()

    def atomics(buffer):
        return set(re.findall(r"\b(AtomicAdd\w*)\(\(?&\(?" + buffer + r"\[", src))

    assert atomics("dQ") == {"AtomicAdd"}
    dq_lines = [line for line in src.splitlines() if "AtomicAdd((&(dQ[" in line]
    assert dq_lines and all("& 1) * 32)" in line for line in dq_lines)
    assert atomics("dK") == atomics("dV") == {"AtomicAddx4"}


# ----------------------------------------------------------------------------- varlen forward
# example_gqa_sink_fwd_varlen.py: the same attention over packed sequences (cu_seqlens).
VARLEN = "attention_sink/example_gqa_sink_fwd_varlen.py"
# (query length, key length) per sequence: empty sequences, one token, Sq != Sk both ways.
RAGGED = [(0, 5), (1, 1), (17, 30), (30, 17), (3, 0), (9, 9), (0, 0), (40, 12)]


def make_varlen_inputs(lengths, H, Hkv, D, dtype=torch.float32, device="cpu", sinks=True):
    """Packed q [total_q, H, D], k, v [total_k, Hkv, D], cu_seqlens_q/k int32, the max lengths
    and sinks (float32 [H] or None) for sequences of the given (query, key) lengths."""
    g = torch.Generator().manual_seed(len(lengths) * 100 + H + D)
    len_q, len_k = ([pair[i] for pair in lengths] for i in (0, 1))
    cu_q, cu_k = (
        torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (len_q, len_k)
    )
    q = torch.randn(sum(len_q), H, D, generator=g)
    k, v = (torch.randn(sum(len_k), Hkv, D, generator=g) for _ in range(2))
    s = torch.randn(H, generator=g) * 2 if sinks else None
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    return (q, k, v, cu_q.to(device), cu_k.to(device), max(len_q, default=0),
            max(len_k, default=0), s if s is None else s.to(device))  # fmt: skip


def direct_varlen(q, k, v, cu_q, cu_k, sinks, window, causal, scale):
    """Float64, sequence by sequence with ``direct`` (the window as a loop-built mask, the sink
    as an extra logit column): out [total_q, H, D], lse [H, total_q]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        o, l_ = direct(qb, kb, vb, sinks, window, causal, scale)
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), l_[0]
    return out, lse


@pytest.mark.parametrize("window", [*WINDOWS, (1024, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_varlen_reference_matches_direct_float64(window, causal, groups):
    """Ragged batches with empty sequences (no queries, no keys, neither) and Sq != Sk: the
    reference gives the direct computation's numbers, sequence by sequence."""
    mod = load_script(VARLEN)
    *args, sinks = make_varlen_inputs(RAGGED, 4, 4 // groups, 16, torch.float64)
    q, k, v, cu_q, cu_k, max_q, max_k = args
    for s in (sinks, None):
        s = s if s is None else s.float()
        out, lse = mod.ref_program(*args, s, window, causal, 0.3, return_lse=True)
        ref_out, ref_lse = direct_varlen(q, k, v, cu_q, cu_k, s, window, causal, 0.3)
        assert lse.shape == (4, q.shape[0])
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


def _sink_tile_costs(mod, lengths, heads, block_M, block_N, window):
    """{(query block, head, sequence): the window's key blocks + 1} for every tile."""
    return {
        (m, h, b): int(mod.window_key_blocks(m, block_M, block_N, sq, sk, *window)[1]) + 1
        for b, (sq, sk) in enumerate(lengths)
        for h in range(heads)
        for m in range(math.ceil(sq / block_M))
    }


def test_varlen_forward_plan_is_settled_once_a_batch(monkeypatch):
    """The varlen sink forward's plan (``forward_plan``): the first call over a batch's lengths
    builds its kernels (the window normalised on the longest sequences) and deals its tile list;
    later calls over the same lengths only launch. Without sinks the kernel gets a stand-in,
    the same one every call, as are the parts' stand-ins without parts; with parts the combine
    gets the sinks too. The kernels are recorded stand-ins on CPU tensors, the device an
    H100's."""
    mod = load_script(VARLEN)
    factories = (mod, "flashattn_fwd_varlen"), (mod, "flashattn_fwd_varlen_combine")
    builds, launches = record_launches(monkeypatch, *factories)
    with fresh_plans(mod.forward_plan):
        check_varlen_forward_plan(mod, builds, launches)


def check_varlen_forward_plan(mod, builds, launches):
    """The body of the test above, with its stand-ins in place."""

    from test_varlen import make_varlen

    def call(lens_q, lens_k, sinks, window):
        q, k, v, _, cu_q, cu_k, max_q, _ = make_varlen(lens_q, lens_k, 8, 2, 128, torch.bfloat16)
        args = (q, k, v, cu_q, cu_k, max_q, sinks, window, False, 0.125)
        out, lse = mod.attention_forward(*args)
        return (q, k, v, cu_q, cu_k, sinks, out, lse), launches[-1]

    stand_ins = []
    for _ in range(2):  # 1000 queries and keys, H8/Hkv2: 64 whole tiles
        tensors, (name, launched) = call([1000], [1000], None, (5000, 0))
        assert name == "flashattn_fwd_varlen" and len(launched) == 11
        assert all(a is b for a, b in zip(launched[:5], tensors[:5], strict=True))
        assert all(a is b for a, b in zip(launched[7:9], tensors[6:], strict=True))
        stand_ins.append(launched[6:7] + launched[9:])
    assert len(builds) == 1 and builds[0][1][3:6] == (-1, 0, False)  # window as causal
    assert [t.shape for t in stand_ins[0]] == [(8,), (1, 128, 128), (1, 128)]
    assert all(a is b for a, b in zip(*stand_ins, strict=True))  # made once, with the plan
    # 128 queries over 16384 keys, sinks: 8 tiles in 132 parts, then the combine with the sinks
    sinks = torch.randn(8)
    tensors, _ = call([128], [16384], sinks, (-1, -1))
    (name, launched), (merge, merged) = launches[-2:]
    assert (name, merge) == ("flashattn_fwd_varlen", "flashattn_fwd_varlen_combine")
    O_part, lse_part = launched[9:]
    assert O_part.shape == (132, 128, 128)
    assert launched[6].data_ptr() == sinks.data_ptr()  # the caller's sinks (detached)
    assert merged[0] is O_part and merged[1] is lse_part and merged[3] is tensors[3]
    assert merged[4] is launched[6] and merged[5] is tensors[6] and merged[6] is tensors[7]
    assert [b[0] for b in builds[1:]] == ["flashattn_fwd_varlen", "flashattn_fwd_varlen_combine"]


def test_varlen_tile_schedule_lists_every_tile_once():
    """Every (query block, head, sequence) of a sequence with queries exactly once, whole or
    in parts (test_varlen's ``_walks``), none of an empty one; each tile charged its window's
    key blocks (window_key_blocks) plus one, as tile_costs says; the thread blocks' loads
    within one heaviest tile of each other. A last round of few tiles over long windows goes
    in parts: without a window, causal, and with a wide left edge; not where the busiest
    thread block's walk is shorter than MIN_SPLIT_WALK."""
    from test_varlen import _walks

    mod = load_script(VARLEN)
    owner = load_script("flash_attention/example_gqa_fwd_varlen.py")  # the deal's code
    ragged = [(0, 5), (1, 1), (300, 300), (17, 1000), (1000, 17), (5, 0), (700, 700)]
    few_long = [(64, 4096), (100, 3000), (0, 7)]
    for lengths in (ragged, few_long):
        cu_q = [0, *itertools.accumulate(p[0] for p in lengths)]
        cu_k = [0, *itertools.accumulate(p[1] for p in lengths)]
        for window in ((-1, -1), (-1, 0), (128, 0), (64, 64), (3000, 0)):
            costs = _sink_tile_costs(mod, lengths, 3, 64, 32, window)
            for num_sms in (1, 7, 132):
                table, combine = mod.tile_schedule(cu_q, cu_k, 3, 64, 32, window, num_sms)
                _, load = _walks(table, combine, costs, num_sms, owner.MIN_PART_BLOCKS)
                assert max(load) - min(load) <= max(costs.values())
                # parts where a last round of few tiles walks long windows: on 7 SMs after a
                # round of whole tiles, on 132 every tile; never for the narrow windows, nor
                # for the ragged batch, whose busiest walk is under MIN_SPLIT_WALK (the varlen
                # forward's list, without that bound, has parts there on 132 SMs)
                long_window = window in ((-1, -1), (-1, 0), (3000, 0))
                parts = lengths is few_long and num_sms > 1 and long_window
                assert (len(combine) > 0) == parts, (lengths, window, num_sms)
                if lengths is few_long and num_sms == 132 and parts:
                    assert len(combine) == 9 and table.shape == (1, 132, 6)  # every tile
            for m, _, b in list(costs)[:20]:
                sq, sk = lengths[b]
                cost = mod.tile_costs(*(torch.tensor([x]) for x in (sq, sk, m)), 64, 32, window)
                assert int(cost) == costs[(m, 0, b)]


def _walk_sink_schedule(mod, table, combine, args, sinks, window, block_M, block_N, scale):
    """What the sink varlen forward computes from a tile list, in float64 with torch: each
    entry's window blocks first … end - 1 (key blocks n_start + first …) under the window
    mask; a whole tile's rows folded with the sink into out and lse, a part's into its slot;
    then each split tile's parts and the sink merged as flashattn_fwd_varlen_combine does."""
    from test_varlen import _walk_keys

    q, k, v, cu_q, cu_k = args[:5]
    groups = q.shape[1] // k.shape[1]
    left, right = window
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float64)
    slot_o, slot_lse = {}, {}

    def fold(lses, outs, h):  # the rows' lse_p and O_p, and the sink: out and lse
        sink = torch.full_like(lses[0], -math.inf if sinks is None else float(sinks[h]))
        total = torch.logsumexp(torch.stack([*lses, sink]), dim=0)
        seen = torch.stack(lses).max(dim=0).values > -math.inf
        weights = [torch.exp(lp - total)[:, None].nan_to_num() for lp in lses]
        o = sum(w * op for w, op in zip(weights, outs, strict=True))
        return torch.where(seen[:, None], o, 0.0), torch.where(seen, total, math.inf)

    for m, h, b, slot, first, end in table.reshape(-1, 6).tolist():
        if b < 0:
            continue
        q0, lq, k0, lk = cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]
        n_start = int(mod.window_key_blocks(m, block_M, block_N, lq, lk, left, right)[0])
        rows = torch.arange(m * block_M, min(lq, (m + 1) * block_M))
        keys = torch.arange((n_start + first) * block_N, (n_start + end) * block_N)
        centre = rows[:, None] + lk - lq
        visible = (keys[None, :] < lk).expand(len(rows), -1)
        if right >= 0:
            visible = visible & (keys[None, :] <= centre + right)
        if left >= 0:
            visible = visible & (keys[None, :] >= centre - left)
        o, part_lse = _walk_keys(
            q[q0 + rows, h], k[k0 : k0 + lk], v[k0 : k0 + lk], h // groups, keys, visible, scale
        )  # fmt: skip
        if slot < 0:
            out[q0 + rows, h], lse[h, q0 + rows] = fold([part_lse], [o], h)
        else:
            slot_o[slot], slot_lse[slot] = o, part_lse
    for m, h, b, slot0, n in combine.tolist():
        q0, lq = cu_q[b], cu_q[b + 1] - cu_q[b]
        rows = torch.arange(m * block_M, min(lq, (m + 1) * block_M))
        lses = [slot_lse[slot0 + i] for i in range(n)]
        outs = [slot_o[slot0 + i] for i in range(n)]
        out[q0 + rows, h], lse[h, q0 + rows] = fold(lses, outs, h)
    return out, lse


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3000, 0), (64, 64)])
def test_varlen_tile_schedule_walk_matches_reference(window):
    """The tile list, walked as the kernel walks it (``_walk_sink_schedule``: whole tiles and
    parts, the parts merged with the sink), gives ref_program's out and lse on every row, with
    and without sinks: few tiles over long keys (parts, but for the narrow window) beside empty
    sequences, Sq != Sk. Float64, small head dim, 132 SMs."""
    mod = load_script(VARLEN)
    lengths = [(64, 4096), (0, 5), (100, 3000), (30, 17), (3, 0)]
    *args, sinks = make_varlen_inputs(lengths, 4, 2, 16, torch.float64)
    cu_q, cu_k = args[3].tolist(), args[4].tolist()
    for s in (sinks, None):
        s = s if s is None else s.float()
        ref_out, ref_lse = mod.ref_program(*args, s, window, False, 0.3, return_lse=True)
        table, combine = mod.tile_schedule(cu_q, cu_k, 4, 64, 32, window, 132)
        assert (len(combine) > 0) == (window != (64, 64))
        out, lse = _walk_sink_schedule(
            mod, table, combine, (*args[:3], cu_q, cu_k), s, window, 64, 32, 0.3
        )  # fmt: skip
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


def test_varlen_script_contract():
    import ast

    mod = load_script(VARLEN)
    params = list(inspect.signature(mod.attention_varlen).parameters)
    assert params == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "sinks",
        "window_size", "causal", "softmax_scale", "return_lse", "config",
    ]  # fmt: skip
    assert list(inspect.signature(mod.ref_program).parameters) == params[:-1]
    source = (EXAMPLES / VARLEN).read_text()
    kernels = [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d) == "T.prim_func" for d in node.decorator_list)
    ]
    assert kernels == ["flash_fwd_varlen", "flash_fwd_combine"]
    macros = set(re.findall(r"@T\.macro\n    def (\w+)", source))
    steps = {"load_q", "load_kv", "scores", "mask", "softmax", "rescale", "pv", "epilogue"}
    assert steps | {"part_epilogue"} <= macros
    args = mod.build_parser().parse_args(["--window", "128", "0", "--no-sinks"])
    assert args.window == [128, 0] and args.sinks is False


def test_varlen_bad_sinks_and_windows_raise_value_error():
    mod = load_script(VARLEN)
    *args, sinks = make_varlen_inputs([(5, 7), (3, 4)], 4, 2, 64, torch.float16)
    cases = [
        (dict(sinks=sinks[:2]), "sinks must be \\[heads\\]"),
        (dict(sinks=sinks.half()), "sinks must be float32"),
        (dict(sinks=sinks.tolist()), "sinks must be a torch.Tensor"),
        (dict(sinks=sinks.to("meta")), "sinks must be on q's"),
        (dict(sinks=sinks, window_size=(-2, 0)), "window_size"),
        (dict(sinks=sinks, window_size=(1, 2, 3)), "window_size"),
        (dict(sinks=sinks, window_size=(1.0, 0)), "window_size"),
        (dict(sinks=None, window_size=(128, 0), causal=True), "CUDA tensor"),  # valid
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            mod.attention_varlen(*args, **kwargs)


# (D, window as the kernel takes it, longest key sequence, sinks, dtype, groups): every tile
# choice of default_config and every loop form (one loop; three runs for a left edge). A window
# with both edges runs the left-edge loop with one more compare; it is built at D128, where the
# registers are tightest (each build is a full compile of the hand-scheduled kernel).
VARLEN_BUILDS = [
    (64, (-1, -1), 4096, True, "float16", 8),
    (64, (-1, 0), 4096, True, "bfloat16", 1),
    (64, (-1, 0), 1000, False, "float16", 8),
    (64, (128, 0), 4096, True, "bfloat16", 8),
    (128, (-1, -1), 4096, False, "bfloat16", 1),
    (128, (1024, 0), 4096, True, "float16", 8),
    (128, (64, 64), 4096, True, "bfloat16", 8),
]


@pytest.mark.parametrize("build", VARLEN_BUILDS, ids=str)
def test_varlen_sm90_build_spills_nothing(build):
    """The default tiles for each kind of window: the producer/consumer split, TMA, WGMMA with
    the softmax overlapping P V; ptxas: no spills, no stack, no serialized WGMMA."""
    from test_flash_bwd_fast import ptxas_report

    import harness

    mod = load_script(VARLEN)
    D, window, longest_k, sinks, dtype, groups = build
    cfg = mod.default_config(D, window, "sm_90a", longest_k)
    args = (16, 16 // groups, D, *window, sinks, 1 / math.sqrt(D), dtype)
    src = harness.compile_for(mod.flashattn_fwd_varlen, "sm_90a", *args, **cfg).get_kernel_source()
    regs = min(240, (65536 - 128 * 24) // (2 * cfg["block_M"]) // 8 * 8)
    assert "warpgroup_reg_dealloc<24>" in src and f"warpgroup_reg_alloc<{regs}>" in src
    assert_one_producer_warp(src, 2 * cfg["block_M"])
    assert "tma_load" in src and "wgmma_ss" in src and "wgmma_rs" in src
    assert ("Sinks[" in src) == sinks
    runs = 3 if window[0] >= 0 else 1  # the key loop: three runs with a left edge, else one
    assert src.count("wait_wgmma<1>") == runs
    report = ptxas_report(src)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "Potential Performance Loss" not in report, report


def test_varlen_compile_only_main(capsys):
    argv = ["--compile-only", "--dim", "64", "--heads", "8", "--window", "64", "0", "--causal"]
    load_script(VARLEN).main(argv)
    out = capsys.readouterr().out
    assert "built for sm_90a" in out and "wgmma" in out and "(64, 0)" in out
    assert "flashattn_fwd_varlen_combine: " in out  # the merge of tiles in parts builds too


# GPU: the correctness matrix on ragged batches (lengths 0, 1, 17, 255, 1000; Sq != Sk).
VARLEN_BATCHES = {
    "ragged": [(17, 17), (0, 0), (1000, 1000), (1, 1), (255, 255), (0, 17)],
    "sq_ne_sk": [(255, 1000), (1000, 255), (1, 17), (17, 0), (255, 1)],
}
# The BHSD matrix's factors, with the packed batches in place of its sequence lengths.
VARLEN_FACTORS = {"batch": list(VARLEN_BATCHES)} | {
    name: values for name, values in FACTORS.items() if name != "seqs"
}


def _varlen_case_id(c):
    dt = "f16" if c["dtype"] == torch.float16 else "bf16"
    return (
        f"{c['batch']}-w{c['window'][0]}_{c['window'][1]}-"
        f"{'causal' if c['causal'] else 'full'}-{'sinks' if c['sinks'] else 'nosinks'}-"
        f"g{c['groups']}-D{c['dim']}-{dt}"
    )


def check_varlen(mod, lengths, H, Hkv, D, window, causal, sinks, dtype, cfg=None):
    *args, s = make_varlen_inputs(lengths, H, Hkv, D, dtype, "cuda", sinks)
    out, lse = mod.attention_varlen(*args, s, window, causal, return_lse=True, config=cfg)
    ref_out, ref_lse = mod.ref_program(*args, s, window, causal, return_lse=True)
    assert rel_err(out, ref_out) < 1e-2  # fp16/bf16 output
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), ~finite)  # rows that see no key: lse +inf
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-4
    assert torch.all(out.transpose(0, 1)[~finite] == 0)  # … and out 0
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("case", pairwise_cases(VARLEN_FACTORS), ids=_varlen_case_id)
def test_varlen_forward_matches_reference(case, poisoned_empty):
    mod = load_script(VARLEN)
    check_varlen(
        mod, VARLEN_BATCHES[case["batch"]], 8, 8 // case["groups"], case["dim"], case["window"],
        case["causal"], case["sinks"], case["dtype"],
    )  # fmt: skip


# A last round of fewer tiles than SMs over long windows: in parts, merged with the sink.
# (lengths, H, Hkv, D, window, causal, sinks, dtype)
VARLEN_PARTS = [
    ([(256, 8192), (256, 8192)], 8, 8, 128, (-1, -1), True, True, torch.bfloat16),
    ([(128, 16384)], 32, 8, 128, (-1, -1), True, True, torch.bfloat16),
    ([(64, 8192)] * 4, 16, 16, 128, (-1, -1), False, False, torch.float16),
    # a left edge: the three runs cut at each part's ends; an empty and a short sequence
    ([(300, 12000), (0, 7), (17, 9000)], 4, 2, 64, (9000, 0), False, True, torch.float16),
    ([(700, 12000), (5, 0)], 4, 4, 64, (9000, 100), False, True, torch.bfloat16),
    # Sq > Sk, causal: the first 600 rows see no key in any part (out 0, lse +inf)
    ([(9000, 8400)], 1, 1, 64, (-1, -1), True, True, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_PARTS, ids=lambda c: f"{c[0][0]}x{len(c[0])}-D{c[3]}")
def test_varlen_forward_tiles_in_parts(case, poisoned_empty):
    """Batches whose tiles go in parts over their windows (checked on the device's tile list):
    out and lse as the reference gives them, sinks added once per row in the merge."""
    mod = load_script(VARLEN)
    lengths, H, Hkv, D, window, causal, sinks, dtype = case
    len_q, len_k = [p[0] for p in lengths], [p[1] for p in lengths]
    kernel_window = mod.normalize_window(window, causal, max(len_q), max(len_k))
    cfg = mod.default_config(D, kernel_window, "sm_90a", max(len_k))
    cu_q, cu_k = ((0, *itertools.accumulate(n)) for n in (len_q, len_k))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, combine = mod.tile_schedule(
        cu_q, cu_k, H, cfg["block_M"], cfg["block_N"], kernel_window, num_sms
    )  # fmt: skip
    assert combine[:, 4].sum() > 0  # part slots
    check_varlen(mod, lengths, H, Hkv, D, window, causal, sinks, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dim,cfg", _tune_cases(), ids=lambda x: str(x))
def test_varlen_tune_space_is_correct(dim, cfg, poisoned_empty):
    mod = load_script(VARLEN)
    lengths = [(300, 333), (17, 0), (1, 1), (200, 150)]
    check_varlen(mod, lengths, 4, 2, dim, (50, 0), True, True, torch.float16, cfg=cfg)
    check_varlen(mod, lengths, 4, 4, dim, (100, 30), False, True, torch.bfloat16, cfg=cfg)


@pytest.mark.gpu
def test_varlen_main_small(capsys):
    argv = ["--batch", "4", "--heads", "8", "--seq_len", "1000", "--dim", "64"]
    load_script(VARLEN).main([*argv, "--window", "128", "0", "--causal"])
    out = capsys.readouterr().out
    assert "out " in out and "lse " in out and "tilelang varlen" in out
