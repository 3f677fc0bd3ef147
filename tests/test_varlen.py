"""Varlen (packed) attention scripts — example_mha_fwd_varlen.py, example_gqa_fwd_varlen.py and
example_gqa_bwd_tma_reduce_varlen.py: references against per-sequence dense references and the
padded batch (through bert_padding, with gradients), cu_seqlens validation, command lines and
sm_90a builds (CPU); forward and gradient matrices on a GPU (marker ``gpu``)."""

import argparse
import functools
import itertools
import json
import math
import re
import sys
import types

import pytest
import torch
from helpers import ROOT, assert_one_producer_warp, fresh_plans, load_script, record_launches

import bert_padding as bp

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_varlen  # noqa: E402  (its batch is one of the tile lists checked here)

MHA_FWD = "flash_attention/example_mha_fwd_varlen.py"
GQA_FWD = "flash_attention/example_gqa_fwd_varlen.py"
GQA_BWD = "flash_attention/example_gqa_bwd_tma_reduce_varlen.py"
SCRIPTS = [MHA_FWD, GQA_FWD, GQA_BWD]
DENSE = {  # the dense script each varlen script must agree with on equal lengths
    MHA_FWD: "flash_attention/example_mha_fwd_bshd.py",
    GQA_FWD: "flash_attention/example_gqa_fwd_bshd.py",
    # the same forward kernel (example_gqa_fwd_bshd.py's) and the same backward
    # (example_mha_bwd_wgmma_pipelined.py's, the "group" strategy, Hopper's default)
    GQA_BWD: "flash_attention/example_gqa_bwd.py",
}


def make_varlen(lens_q, lens_k, H, Hkv, D, dtype=torch.float64, device="cpu", scale=1.0, seed=0):
    """Packed q, k, v, dout (normal values; q, k, v times ``scale``), int32 cu_seqlens on
    ``device``, and the max lengths."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lens_q), sum(lens_k)

    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(device, dtype)

    q = randn(total_q, H, D, s=scale)
    k, v = randn(total_k, Hkv, D, s=scale), randn(total_k, Hkv, D, s=scale)
    dout = randn(total_q, H, D)

    def cu(lens):
        return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device, torch.int32)

    return q, k, v, dout, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)


def heads_for(script, H=4, Hkv=2):
    return (H, H) if script == MHA_FWD else (H, Hkv)


# ----------------------------------------------------------------------------- CPU: references
# Lengths per sequence (query, key): Sq ≠ Sk both ways, a sequence of length 1, a sequence
# without queries and one without keys.
LENS_Q = [1, 13, 0, 7, 9]
LENS_K = [9, 3, 4, 0, 9]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_equals_per_sequence_dense_references(script, causal):
    """ref_program (packed) = the dense script's ref_program run on each sequence alone, out
    and lse, in float64; a sequence without keys gives out 0 and lse +inf."""
    mod, dense = load_script(script), load_script(DENSE[MHA_FWD if script == MHA_FWD else GQA_FWD])
    H, Hkv = heads_for(script)
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_varlen(LENS_Q, LENS_K, H, Hkv, 16)
    out, lse = mod.ref_program(q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.3, return_lse=True)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(LENS_Q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if LENS_Q[b] == 0:
            continue
        if LENS_K[b] == 0:
            assert torch.all(out[rows] == 0) and torch.all(torch.isposinf(lse[:, rows]))
            continue
        ref_out, ref_lse = dense.ref_program(
            q[None, rows], k[None, keys], v[None, keys], causal, 0.3, return_lse=True
        )
        torch.testing.assert_close(out[rows], ref_out[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, rows], ref_lse[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_round_trip_with_gradients(script, causal):
    """Padded batch → unpad_input → ref_program → pad_input equals ref_padded (dense attention
    on the padded batch under its masks), and so do the gradients of the padded q, k, v through
    both routes (float64)."""
    mod = load_script(script)
    H, Hkv = heads_for(script)
    B, Sq, Sk, D = len(LENS_Q), max(LENS_Q), max(LENS_K), 16
    g = torch.Generator().manual_seed(1)
    mask_q = torch.arange(Sq)[None, :] < torch.tensor(LENS_Q)[:, None]
    mask_k = torch.arange(Sk)[None, :] < torch.tensor(LENS_K)[:, None]
    shapes = [(B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D)]
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    q_unpad, indices_q, cu_q, max_q, seqused_q = bp.unpad_input(leaves[0], mask_q)
    k_unpad, _, cu_k, max_k, _ = bp.unpad_input(leaves[1], mask_k)
    v_unpad = bp.unpad_input(leaves[2], mask_k)[0]
    assert seqused_q.tolist() == LENS_Q and (max_q, max_k) == (Sq, Sk)
    out = mod.ref_program(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, causal)
    out_pad = bp.pad_input(out, indices_q, B, Sq)
    grads = torch.autograd.grad(out_pad, leaves, dout)

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mod.ref_padded(*ref_leaves, mask_q, mask_k, causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    torch.testing.assert_close(out_pad, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"d{name}")
    # Padded positions get exactly zero gradient; so do keys of the sequence without queries.
    assert torch.all(grads[0][~mask_q] == 0) and torch.all(grads[1][~mask_k] == 0)
    assert torch.all(grads[1][2] == 0) and torch.all(grads[2][2] == 0)


def test_reference_grads_padded_chunked_equals_direct():
    """reference_grads_padded (float32, one batch entry at a time) = one float32 autograd pass."""
    mod = load_script(GQA_BWD)
    B, Sq, Sk, H, Hkv, D = 3, 9, 12, 4, 2, 16
    g = torch.Generator().manual_seed(2)
    mask_q = torch.arange(Sq)[None, :] < torch.tensor([9, 1, 4])[:, None]
    mask_k = torch.arange(Sk)[None, :] < torch.tensor([12, 5, 0])[:, None]
    shapes = [(B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D)]
    q, k, v, dout = (torch.randn(s, generator=g).half() for s in shapes)
    got = mod.reference_grads_padded(q, k, v, mask_q, mask_k, dout, True, 0.3)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = mod.ref_padded(*leaves, mask_q, mask_k, True, 0.3)
    want = (out, *torch.autograd.grad(out, leaves, dout.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------- CPU: validation
def _bad_calls(script):
    """(description, args, kwargs, message fragment) for every input the function rejects.
    Everything but the named defect is valid, and the tensors are on the CPU, so each defect
    is found before the final CUDA check."""
    H, Hkv = heads_for(script)
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_varlen(
        [3, 0, 5], [4, 2, 0], H, Hkv, 128, torch.half
    )
    good = (q, k, v, cu_q, cu_k, max_q, max_k)

    def with_(**changes):
        names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
        return tuple(changes.get(n, a) for n, a in zip(names, good, strict=True))

    i32 = functools.partial(torch.tensor, dtype=torch.int32)
    cases = [
        ("cu_seqlens_q int64", with_(cu_seqlens_q=cu_q.long()), "cu_seqlens_q must be int32"),
        ("cu_seqlens_k a list", with_(cu_seqlens_k=cu_k.tolist()), "cu_seqlens_k must be a torch"),
        ("cu_seqlens_q 2-D", with_(cu_seqlens_q=cu_q[None]), "cu_seqlens_q must be 1-D"),
        ("cu_seqlens_k empty", with_(cu_seqlens_k=cu_k[:0]), "cu_seqlens_k must be 1-D"),
        ("cu_seqlens_q on meta", with_(cu_seqlens_q=cu_q.to("meta")), "cu_seqlens_q must be on"),
        ("cu_seqlens_q from 1", with_(cu_seqlens_q=i32([1, 3, 3, 8])), "must start at 0"),
        ("cu_seqlens_k decreasing", with_(cu_seqlens_k=i32([0, 4, 3, 6])), "non-decreasing"),
        ("cu_seqlens_q short of total", with_(cu_seqlens_q=i32([0, 3, 3, 7])), "token count 8"),
        ("cu_seqlens_k past total", with_(cu_seqlens_k=i32([0, 4, 6, 7])), "token count 6"),
        (
            "batch sizes differ",
            with_(cu_seqlens_k=i32([0, 6]), max_seqlen_k=6),
            "cu_seqlens_q and cu_seqlens_k must have the same length",
        ),
        ("max_seqlen_q too small", with_(max_seqlen_q=4), "max_seqlen_q"),
        ("max_seqlen_k too small", with_(max_seqlen_k=3), "max_seqlen_k"),
        ("max_seqlen_q a float", with_(max_seqlen_q=5.0), "max_seqlen_q must be an int"),
        ("max_seqlen_k a bool", with_(max_seqlen_k=True), "max_seqlen_k"),
        ("float32", with_(q=q.float()), "float16 or bfloat16"),
        ("mixed dtypes", with_(k=k.bfloat16(), v=v.bfloat16()), "share a dtype"),
        ("rank 4", with_(q=q[None]), "q must be"),
        ("k/v shapes differ", with_(v=v[:, :1]), "same shape"),
        ("head dim mismatch", with_(k=k[..., :64], v=v[..., :64]), "k must be"),
        ("head dim 96", with_(q=q[..., :96], k=k[..., :96], v=v[..., :96]), "head dim"),
        ("strided last dim", with_(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "last"),
        ("CPU tensors", good, "CUDA tensor"),
    ]
    if script == MHA_FWD:
        cases.append(("fewer kv heads", with_(k=k[:, :2], v=v[:, :2]), "MHA script"))
    else:
        cases.append(("H % Hkv", with_(q=torch.cat([q, q[:, :1]], dim=1)), "H % Hkv"))
    return cases


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_raises_value_error_naming_argument(script):
    mod = load_script(script)
    for what, args, fragment in _bad_calls(script):
        with pytest.raises(ValueError, match=fragment):
            mod.attention_varlen(*args)
            pytest.fail(f"accepted bad input: {what}")


@pytest.mark.parametrize("script", SCRIPTS)
def test_cu_seqlens_read_once_and_rechecked_after_an_in_place_change(script):
    """The values of a cu_seqlens tensor are read from the device once and kept on it, and once
    they passed they are not walked again for the same token count and max_seqlen; another
    max_seqlen, or changing the tensor in place, makes the next call check them again. (On the
    CPU the call gets as far as the last check, the device one.)"""
    mod = load_script(script)
    Hkv = 4 if script == MHA_FWD else 2
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_varlen([3, 2], [4, 1], 4, Hkv, 64, torch.float16)
    with pytest.raises(ValueError, match="CUDA"):  # every other check passed
        mod.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    assert cu_q._host_values == (cu_q._version, [0, 3, 5])
    assert cu_q._values_passed == (cu_q._version, 5, max_q)
    with pytest.raises(ValueError, match="max_seqlen_q .2. must be at least"):
        mod.attention_varlen(q, k, v, cu_q, cu_k, 2, max_k)
    cu_q[1] = 6  # now decreasing: the kept values are stale and must not be trusted
    with pytest.raises(ValueError, match="non-decreasing"):
        mod.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)


# ----------------------------------------------------------------------------- CPU: command line
@pytest.mark.parametrize("script", SCRIPTS)
def test_flags(script):
    parser = load_script(script).build_parser()
    args = parser.parse_args([])
    assert args.causal is False and args.batch == 8 and args.seq_len == 2048
    assert parser.parse_args(["--causal"]).causal is True
    for bad in (["--causal", "False"], ["--dtype", "float32"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


@pytest.mark.parametrize("script", [GQA_FWD, GQA_BWD])
def test_groups_must_divide_heads(script, capsys):
    with pytest.raises(SystemExit):
        load_script(script).main(["--heads", "32", "--groups", "5", "--compile-only"])
    assert "--groups" in capsys.readouterr().err


def test_random_lengths_hold_one_and_the_maximum():
    mod = load_script(MHA_FWD)
    lengths = mod.random_lengths(6, 300, torch.Generator().manual_seed(0))
    assert 1 in lengths.tolist() and 300 in lengths.tolist()
    assert lengths.min() >= 1 and lengths.max() <= 300


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script", SCRIPTS)
def test_main_without_gpu_says_so(script):
    with pytest.raises(SystemExit) as exc:
        load_script(script).main(["--seq_len", "128"])
    assert "--compile-only" in str(exc.value.code)


# ----------------------------------------------------------------------------- CPU: tile list
def _tile_costs(lens_q, lens_k, heads, block_M, block_N, causal):
    """Every tile (query block, head, sequence) the forward kernel must run and its cost (key
    blocks visited + 1), written out loop by loop."""
    costs = {}
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k, strict=True)):
        for m in range(-(-sq // block_M)):
            last_key = min(sk, (m + 1) * block_M + sk - sq) if causal else sk
            blocks = max(1, -(-last_key // block_N))
            for h in range(heads):
                costs[(m, h, b)] = blocks + 1
    return costs


SCHEDULES = [  # (lens_q, lens_k, heads, block_M, num_sms)
    ([17, 64, 1, 130], [17, 64, 1, 130], 3, 128, 132),
    ([0, 5, 0, 300, 17, 0], [0, 5, 0, 300, 17, 0], 4, 128, 8),  # empty sequences, first and last
    ([100, 1, 513, 64, 300], [300, 50, 17, 64, 0], 2, 192, 16),  # Sq != Sk both ways, no keys
    ([4096], [4096], 1, 128, 132),  # fewer tiles than SMs, long keys: in parts
    (bench_varlen.random_lengths(), bench_varlen.random_lengths(), 32, 128, 132),
    ([4096] * 4, [4096] * 4, 32, 128, 132),  # a last round of 4 tiles: in parts
    ([64, 64], [4096, 4096], 4, 128, 132),  # short queries over long keys: in parts
    ([300, 40], [5000, 700], 4, 128, 32),  # some tiles in parts, some whole
    ([1000], [1000], 8, 128, 132),  # parts would save 4 key blocks: fewer than COMBINE_BLOCKS
]
PARTS = {3, 5, 6, 7}  # the cases whose last round goes in parts (causal too)
PARTS_CAUSAL = {3, 6, 7}


def _walks(table, combine, costs, num_sms, min_part):
    """Check a tile list's shape and parts; returns every entry and each thread block's work."""
    rounds, grid, six = table.shape
    assert table.dtype == torch.int32 and six == 6 and 1 <= grid <= num_sms
    entries = [tuple(e) for e in table.reshape(-1, 6).tolist()]
    assert all(e == (-1,) * 6 for e in entries if e[2] < 0)
    assert all(e[2] >= 0 for e in entries[: (rounds - 1) * grid])
    whole = [e[:3] for e in entries if e[2] >= 0 and e[3] < 0]
    assert all(e[4] == 0 and e[5] + 1 == costs[e[:3]] for e in entries if e[2] >= 0 and e[3] < 0)
    # Parts: in the last round only; each split tile listed once in combine, its parts covering
    # its key blocks once, in consecutive slots, each at least min_part blocks.
    parts = [e for e in entries if e[3] >= 0]
    assert all(i >= (rounds - 1) * grid for i, e in enumerate(entries) if e[3] >= 0)
    split = [tuple(c) for c in combine.tolist()]
    assert combine.dtype == torch.int32 and len({c[:3] for c in split}) == len(split)
    slots = sorted(e[3] for e in parts)
    assert slots == list(range(len(parts)))
    for m, h, b, slot0, n in split:
        mine = sorted((e[3], e[4], e[5]) for e in parts if e[:3] == (m, h, b))
        assert [e[0] for e in mine] == list(range(slot0, slot0 + n)) and n >= 2
        assert [e[1] for e in mine] == [0] + [e[2] for e in mine[:-1]]
        assert mine[-1][2] + 1 == costs[(m, h, b)]
        assert all(end - first >= min_part for _, first, end in mine)
    assert len(whole) == len(set(whole))
    assert set(whole) | {c[:3] for c in split} == set(costs)
    assert not set(whole) & {c[:3] for c in split}
    load = [0] * grid
    for i, e in enumerate(entries):
        if e[2] >= 0:
            load[i % grid] += e[5] - e[4] + 1
    return entries, load


@pytest.mark.parametrize("script", [MHA_FWD, GQA_FWD])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(SCHEDULES)))
def test_tile_schedule(script, causal, case):
    """tile_schedule lists every (query block, head, sequence) tile exactly once, as a whole
    tile or in parts (``_walks``), and nothing for a sequence without queries; at most num_sms
    thread blocks, one entry each per round, empty entries (-1) in the last round only;
    sequences start heaviest first; no thread block gets more than one tile's cost above
    another (the round-by-round deal); and where the last round goes in parts, the busiest
    thread block ends sooner than the same list dealt whole."""
    lens_q, lens_k, heads, block_M, num_sms = SCHEDULES[case]
    mod = load_script(script)
    cu_q = [sum(lens_q[:b]) for b in range(len(lens_q) + 1)]
    cu_k = [sum(lens_k[:b]) for b in range(len(lens_k) + 1)]
    table, combine = mod.tile_schedule(cu_q, cu_k, heads, block_M, 128, causal, num_sms)
    costs = _tile_costs(lens_q, lens_k, heads, block_M, 128, causal)
    owner = load_script(GQA_FWD)  # the tile list's code, which the MHA script imports
    entries, load = _walks(table, combine, costs, num_sms, owner.MIN_PART_BLOCKS)
    rounds, grid = table.shape[:2]
    assert (len(combine) > 0) == (case in (PARTS_CAUSAL if causal else PARTS))
    whole_grid = min(num_sms, len(costs))  # parts take every SM
    assert grid == (num_sms if len(combine) else whole_grid)
    assert rounds == -(-len(costs) // whole_grid)

    first_round = {}  # the round in which each sequence's first tile runs
    for i, e in enumerate(entries):
        if e[2] >= 0:
            first_round.setdefault(e[2], i // grid)
    work = {b: sum(c for (_, _, s), c in costs.items() if s == b) for b in first_round}
    starts = [first_round[b] for b in sorted(first_round, key=lambda b: -work[b])]
    assert starts == sorted(starts)
    assert max(load) - min(load) <= max(costs.values())

    if len(combine):  # dealt whole, the last round would end COMBINE_BLOCKS or more later
        before = [0] * grid  # each thread block's work before the last round
        for i, e in enumerate(entries[: (rounds - 1) * grid]):
            before[i % grid] += e[5] - e[4] + 1
        last = {e[:3] for e in entries[(rounds - 1) * grid :] if e[2] >= 0}
        heaviest = sorted((costs[t] for t in last), reverse=True)
        free = sorted(before[:whole_grid])
        whole_end = max(f + c for f, c in zip(free, heaviest, strict=False))
        assert max(load) <= whole_end - owner.COMBINE_BLOCKS


def _walk_keys(q_rows, k, v, kv_head, keys, visible, scale):
    """Rows ``q_rows`` over keys ``keys`` of ``k``, ``v`` (a sequence's, from its first key),
    those ``visible`` only, in float64: the output normalised by its own row sums and the lse,
    -inf for a row that sees none of them, as a part's epilogue leaves them. Keys past the
    sequence are never visible (their rows are read clamped)."""
    if len(k) == 0:
        k = v = torch.zeros(1, kv_head + 1, q_rows.shape[-1], dtype=q_rows.dtype)
    kk = keys.clamp(max=len(k) - 1)
    kh, vh = k[kk, kv_head], v[kk, kv_head]
    scores = (q_rows @ kh.T * scale).masked_fill(~visible, -math.inf)
    row_max = scores.max(dim=1, keepdim=True).values
    row_max = row_max.masked_fill(row_max == -math.inf, 0)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=1)
    o = torch.where(row_sum[:, None] > 0, p @ vh / row_sum[:, None], 0.0)
    return o, torch.where(row_sum > 0, torch.log(row_sum) + row_max[:, 0], -math.inf)


def _walk_schedule(table, combine, q, k, v, cu_q, cu_k, causal, block_M, block_N):
    """What the forward kernel computes from a tile list, in float64 with torch: each entry's
    key blocks first … end - 1 under the kernel's masks; a whole tile's rows into out and lse,
    a part's into its slot; then each split tile's parts merged as flashattn_fwd_varlen_combine
    does. Entries past a sequence's rows are dropped, as the kernel never stores them."""
    H, D = q.shape[1:]
    groups = H // k.shape[1]
    scale = 1 / math.sqrt(D)
    out = torch.full_like(q, math.nan)
    lse = torch.full((H, q.shape[0]), math.nan, dtype=torch.float64)
    slot_o, slot_lse = {}, {}
    for m, h, b, slot, first, end in table.reshape(-1, 6).tolist():
        if b < 0:
            continue
        q0, lq, k0, lk = cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]
        rows = torch.arange(m * block_M, min(lq, (m + 1) * block_M))
        keys = torch.arange(first * block_N, end * block_N)
        visible = (keys[None, :] < lk).expand(len(rows), -1)
        if causal:
            visible = visible & (keys[None, :] <= rows[:, None] + lk - lq)
        o, part_lse = _walk_keys(
            q[q0 + rows, h], k[k0 : k0 + lk], v[k0 : k0 + lk], h // groups, keys, visible, scale
        )  # fmt: skip
        if slot < 0:
            out[q0 + rows, h] = o
            lse[h, q0 + rows] = torch.where(part_lse > -math.inf, part_lse, math.inf)
        else:
            slot_o[slot], slot_lse[slot] = o, part_lse
    for m, h, b, slot0, n in combine.tolist():
        q0, lq = cu_q[b], cu_q[b + 1] - cu_q[b]
        rows = torch.arange(m * block_M, min(lq, (m + 1) * block_M))
        lses = torch.stack([slot_lse[slot0 + i] for i in range(n)])
        top = lses.max(dim=0).values
        top = top.masked_fill(top == -math.inf, 0)
        w = torch.exp(lses - top)
        total = w.sum(dim=0)
        o = sum(w[i][:, None] * slot_o[slot0 + i] for i in range(n))
        out[q0 + rows, h] = torch.where(total[:, None] > 0, o / total[:, None], 0.0)
        lse[h, q0 + rows] = torch.where(total > 0, top + torch.log(total), math.inf)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [1, 2, 7])
def test_tile_schedule_walk_matches_reference(case, causal):
    """The tile list, walked as the kernel walks it (``_walk_schedule``: whole tiles and parts,
    the parts merged), gives ref_program's out and lse on every row: whole tiles only with empty
    sequences and Sq != Sk both ways (cases 1 and 2), parts beside whole tiles (case 7, on 32
    SMs). Float64, small head dim."""
    lens_q, lens_k, heads, block_M, num_sms = SCHEDULES[case]
    mod = load_script(GQA_FWD)
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, heads, heads // 2, 16)
    cu_q_list, cu_k_list = cu_q.tolist(), cu_k.tolist()
    ref_out, ref_lse = mod.ref_program(q, k, v, cu_q, cu_k, max_q, max_k, causal, return_lse=True)
    table, combine = mod.tile_schedule(cu_q_list, cu_k_list, heads, block_M, 128, causal, num_sms)
    assert (len(combine) > 0) == (case == 7)
    out, lse = _walk_schedule(
        table, combine, q, k, v, cu_q_list, cu_k_list, causal, block_M, 128
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("script", [GQA_FWD, MHA_FWD])
def test_forward_plan_is_settled_once_a_batch(script, monkeypatch):
    """attention_forward's plan (``forward_plan``): the first call over a batch's lengths builds
    its kernels and deals its tile list, later calls over the same lengths only launch; new
    lengths deal again. Its launches: without parts the tile list and one-slot stand-ins for the
    parts' outputs, the same ones every call; with parts, fresh float32 outputs for every slot,
    then the combine over them. The kernels are recorded stand-ins on CPU tensors, the device an
    H100's."""
    mod, gqa = load_script(script), load_script(GQA_FWD)  # the combine: the GQA script's
    factories = (mod, "flashattn_fwd_varlen"), (gqa, "flashattn_fwd_varlen_combine")
    builds, launches = record_launches(monkeypatch, *factories)
    with fresh_plans(mod.forward_plan):
        check_forward_plan(mod, builds, launches)


def check_forward_plan(mod, builds, launches):
    """The body of the test above, with its stand-ins in place."""

    def call(lens_q, lens_k, H):
        q, k, v, _, cu_q, cu_k, max_q, _ = make_varlen(lens_q, lens_k, H, H, 128, torch.bfloat16)
        out, lse = mod.attention_forward(q, k, v, cu_q, cu_k, max_q, False, 0.125)
        return (q, k, v, cu_q, cu_k, out, lse), launches[-1]

    # 2 x 1000, H8: 128 tiles, one round of 128 thread blocks, whole
    stand_ins = []
    for _ in range(2):
        tensors, (name, launched) = call([1000, 1000], [1000, 1000], 8)
        assert name == "flashattn_fwd_varlen" and len(launched) == 10
        assert all(a is b for a, b in zip(launched[:5] + launched[6:8], tensors, strict=True))
        assert launched[5].shape == (1, 128, 6) and launched[5].dtype == torch.int32
        stand_ins.append(launched[8:])
    assert len(builds) == 1
    assert [t.shape for t in stand_ins[0]] == [(1, 128, 128), (1, 128)]
    assert all(a is b for a, b in zip(*stand_ins, strict=True))  # made once, with the plan
    # 128 queries over 16384 keys, H8: 8 tiles in 132 parts, then the combine over them
    tensors, _ = call([128], [16384], 8)
    (name, launched), (merge, merged) = launches[-2:]
    assert (name, merge) == ("flashattn_fwd_varlen", "flashattn_fwd_varlen_combine")
    O_part, lse_part = launched[8:]
    assert O_part.shape == (132, 128, 128) and lse_part.shape == (132, 128)
    assert O_part.dtype == lse_part.dtype == torch.float32
    assert merged[0] is O_part and merged[1] is lse_part and merged[3] is tensors[3]
    assert merged[4] is tensors[5] and merged[5] is tensors[6]
    assert [b[0] for b in builds[1:]] == ["flashattn_fwd_varlen", "flashattn_fwd_varlen_combine"]


# ----------------------------------------------------------------------------- CPU: builds
# (script, argv): every kernel of every script for sm_90a, both head dims, causal and not, both
# dtypes, groups 1/4/8.
BUILDS = [
    (MHA_FWD, ["--dim", "128", "--causal"]),
    (MHA_FWD, ["--dim", "64", "--dtype", "bfloat16"]),
    (GQA_FWD, ["--dim", "128", "--dtype", "bfloat16", "--groups", "8"]),
    (GQA_FWD, ["--dim", "64", "--causal", "--groups", "4"]),
    (GQA_BWD, ["--dim", "128", "--causal", "--groups", "4"]),
    (GQA_BWD, ["--dim", "64", "--dtype", "bfloat16", "--groups", "1"]),
]


@pytest.mark.parametrize(
    "script,argv", BUILDS, ids=[f"{s[16:-3]} {' '.join(a)}" for s, a in BUILDS]
)
def test_compile_only_main_builds_for_sm90(script, argv, capsys):
    load_script(script).main(["--compile-only", "--heads", "16", *argv])
    out = capsys.readouterr().out
    assert "built for sm_90a" in out
    assert re.search(r"flashattn_fwd_varlen: .*wgmma, tma", out), out
    if script == GQA_BWD:  # the hand-scheduled backward in its packed mode: no atomics
        line = re.search(r"flash_bwd_varlen: .*", out).group(0)
        assert re.search(r"wgmma, tma.*bulk-reduce", line) and "atomics" not in line, out
        for name in ("flash_bwd_prep", "flash_bwd_post"):
            assert f"{name}:" in out


@functools.cache
def forward_kernel(script, dim, causal, dtype):
    """A forward script's compiled kernel for sm_90a with its default tiles (what
    test_compile_only_main built: TileLang's cache makes the second build cheap)."""
    import harness

    mod = load_script(script)
    heads = (16,) if script == MHA_FWD else (16, 2)
    cfg = mod.default_config(dim, "sm_90a", causal)
    return harness.compile_for(
        mod.flashattn_fwd_varlen, "sm_90a", *heads, dim, causal, 1 / math.sqrt(dim), dtype, **cfg
    )


@functools.cache
def sources(script, dim, causal, dtype):
    """CUDA source of each kernel for sm_90a."""
    if script == GQA_BWD:
        return load_script(script).compile_all(16, 4, dim, causal, dtype, "sm_90a")
    return {"flashattn_fwd_varlen": forward_kernel(script, dim, causal, dtype).get_kernel_source()}


def test_backward_script_runs_the_persistent_forward():
    """The backward script's differentiable function runs example_gqa_fwd_varlen.py's kernel
    (imported from beside it, not a copy): its compile_all builds exactly that kernel, with the
    forward script's own default tiles, so a training step gets the persistent forward."""
    bwd = load_script(GQA_BWD)
    assert bwd.fwd.flashattn_fwd_varlen is load_script(GQA_FWD).flashattn_fwd_varlen
    built = bwd.compile_all(16, 2, 128, True, "float16", "sm_90a")["flashattn_fwd_varlen"]
    assert built == forward_kernel(GQA_FWD, 128, True, "float16").get_kernel_source()


@pytest.mark.parametrize("script", [MHA_FWD, GQA_FWD])
def test_persistent_forward_code(script):
    """The forward scripts' kernel: one for every batch (total_q, total_k, the batch and the
    tile list's shape arrive as kernel arguments; the list's grid is the launch grid), written
    out as producer and consumer warpgroups (24 and 240 registers, S(k) issued before
    P(k-1) V(k-1) is waited for, and before V(k-1)'s load is). Each round reads its entry of
    the tile list and skips an empty one before any load; a tile walks its entry's key blocks
    first … end - 1. Q/K/V come by TMA at per-sequence offsets; a whole tile's output leaves by
    TMA store only from blocks wholly inside their sequence (a box would overwrite the next
    sequence's rows), by a guarded store otherwise; a part's (slot >= 0) goes to O_part and
    lse_part."""
    src = sources(script, 128, True, "float16")["flashattn_fwd_varlen"]
    signature = src[: src.index("{")]
    for arg in (
        "int batch",
        "int total_q",
        "int rounds",
        "int grid",
        "const int* __restrict__ tiles",
        "int slots",
        "float* __restrict__ O_part",
        "float* __restrict__ lse_part",
    ):
        assert arg in signature, arg
    assert "__launch_bounds__(384, 1)" in src  # two consumer warpgroups + the producer
    assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<240>" in src
    assert_one_producer_warp(src, 256)
    assert src.count("wait_wgmma<1>") >= 1, "QKᵀ of block k overlaps PV of block k-1"
    # in the key loop, V(k-1)'s wait sits between S(k)'s issue and P(k-1) V(k-1)'s
    loop = src[re.search(r"for \(int k\w* = \(first\w* \+ 1\); ", src).start() :]
    s_issue, v_wait = loop.index("tl::wgmma_ss<"), loop.index("v_full[")
    assert s_issue < v_wait < loop.index("tl::wgmma_rs<")
    for tensor in ("Q", "K", "V"):
        assert f"tl::tma_load({tensor}_desc" in src, tensor
    # the round's entry first; an empty one (bz < 0) skips everything, loads included
    first_load = src.index("tma_load(")
    entry = r"for \(int it = 0; it < rounds; \+\+it\) \{\n\s*bz = tiles\[[^;]*;\n\s*if \(0 <= bz\)"
    assert re.search(entry, src[:first_load])
    # (seq_len_q reaches the epilogue macro as a copy: seq_len_q_1)
    store = re.search(r"if \(\(+.*\) <= seq_len_q\w*\) \{\n[^}]*tl::tma_store\(Output_desc", src)
    assert store, "the TMA store must sit under the whole-block test"
    assert re.search(r"\} else \{(?:(?!tma_store).)*?\*\(uint4\*\)\(Output \+", src, re.S)
    # whole tiles (slot < 0) store out and lse; parts their float32 rows
    whole, part = src.index("if (slot < 0) {"), src.index("(O_part + ")
    assert whole < src.index("tl::tma_store(Output_desc") < part < src.index("lse_part[")


FORWARD_BUILDS = [
    (MHA_FWD, 64, False),  # 192 query rows: three consumer warpgroups at 160 registers
    (MHA_FWD, 64, True),
    (MHA_FWD, 128, False),
    (MHA_FWD, 128, True),
    (GQA_FWD, 64, False),
    (GQA_FWD, 128, True),
]


@pytest.mark.parametrize(
    "script,dim,causal", FORWARD_BUILDS, ids=[f"{s[16:-3]}-D{d}-{c}" for s, d, c in FORWARD_BUILDS]
)
def test_forward_spills_nothing_and_fits(script, dim, causal):
    """Default tiles: ptxas spills nothing, no stack, no serialized WGMMA; the consumers'
    setmaxnreg rise is covered by the producer's drop (or they would wait forever: a deadlock);
    shared memory fits an H100 thread block. A tile's key blocks after its first run in two
    loops, those without a mask and then the masked ones (the causal diagonal, or the ragged
    last block), causal or not: S = Q Kᵀ is issued three times in the code (the first block,
    each loop) and P V three times (each loop, the last). Three consumer warpgroups (192 rows)
    take turns at those four issue points, each between a wait on its own named barrier and an
    arrival on the next one's; two take none."""
    from test_flash_bwd_fast import assert_clean_build

    kernel = forward_kernel(script, dim, causal, "bfloat16")
    src = kernel.get_kernel_source()
    threads = int(re.search(r"__launch_bounds__\((\d+), 1\)", src).group(1))
    consumer_regs = int(re.search(r"warpgroup_reg_alloc<(\d+)>", src).group(1))
    assert_clean_build(kernel, threads, 24, consumer_regs)
    waits = src.count("__sync_thread_partial(((((int)threadIdx.x) >> 7) + 9), 256);")
    passes = src.count("__named_barrier_arrive(((((((int)threadIdx.x) >> 7) + 1) % 3) + 9), 256);")
    assert src.count("tl::wgmma_ss<") == src.count("tl::wgmma_rs<") == 3
    assert waits == passes == (4 if threads == 3 * 128 + 128 else 0), (waits, passes)
    assert src.count("__named_barrier_arrive(9, 256);") == (waits > 0)


def test_backward_code():
    """The packed backward (example_mha_bwd_wgmma_pipelined.py's flash_bwd, layout "thd"): the
    grid's z index picks the sequence through ``seq_order`` (heaviest first); a thread block
    past its sequence's keys leaves before any load; the others put their sequence's offsets
    and lengths in shared memory (``info``: first query row, first key row, key count, Sk − Sq,
    the sequence) and read them there. Q, K, V, dO, lse2 and Delta arrive by TMA, K/V at
    the sequence's first key row, Q/dO at its first query row, lse2 and Delta as whole rows of
    the sequence's own tiles (innermost coordinate 0, the tile ``q_offset // 64 + b + k``); dQ
    goes out by one bulk reduce-add a step, dK/dV by 16-byte row stores of the sequence's keys
    only; no atomics anywhere."""
    src = sources(GQA_BWD, 128, True, "float16")["flash_bwd_varlen"]
    first_load = src.index("tma_load(")
    assert "int b = seq_order[((int64_t)((int)blockIdx.z))];" in src
    exit_test = re.search(r"if \(\(\(\(int\)blockIdx\.x\) \* 128\) < seq_len_k\) \{", src)
    assert exit_test and exit_test.start() < first_load
    table = src[exit_test.end() : first_load]
    # b comes from memory, so TileLang guards each read at b: a value set under a bounds test.
    first_key_row = re.search(r"(condval_\d+) = cu_seqlens_k\[\(\(int64_t\)b\)\];", table)
    assert first_key_row and f"info[1] = {first_key_row.group(1)};" in table
    assert "__syncthreads();" in table
    assert "info[4] = b;" in table
    for tensor in ("Q", "K", "V", "dO", "lse2", "Delta"):
        assert f"tl::tma_load({tensor}_desc" in src, tensor
    for tensor, row in (("K", 1), ("V", 1), ("Q", 0), ("dO", 0)):
        load = re.search(rf"tl::tma_load\({tensor}_desc, [^;]*;", src).group(0)
        assert f"+ info[{row}])" in load, load
    for tensor in ("lse2", "Delta"):
        load = re.search(rf"tl::tma_load\({tensor}_desc, [^;]*;", src).group(0)
        assert re.search(r"\]\)\), 0, \(+info\[0\] >> 6\) \+ info\[4\]\)", load)
    assert re.search(
        r"tma_store_add\(\(&\(\(\(float\*\)dq_shared\)\[[^]]*\]\)\), \(&\(dQ_accum\[", src
    )
    for tensor in ("dK", "dV"):
        assert re.search(rf"< info\[2\]\) \{{[^}}]*\*\(uint4\*\)\({tensor} \+", src), tensor
    assert "atomic" not in src.lower()
    signature = src[: src.index("{")]
    for arg in ("int batch", "int max_seqlen_k", "int total_k", "int n_tiles"):
        assert arg in signature, arg


def test_backward_sequence_order():
    """``sequence_order`` (the order the packed backward's grid takes the sequences): heaviest
    first by the steps their key blocks walk plus one a key block, ties in the given order. By
    hand, 128 keys a thread block and 64 queries a step: lengths 1, 4096, 0 queries with 300
    keys, 2000, 2000 weigh 1·2, 32·65, 3·1, 16·33, 16·33 without a mask. Causal (bottom-right),
    64 queries over 4096 keys weigh 32 key blocks of one step each (64); 1000 over 1000, key
    block j walks 16 − 2j query blocks: 80."""
    fast = load_script(GQA_BWD).fast_bwd
    cu_q, cu_k = [0, 1, 4097, 4097, 6097, 8097], [0, 1, 4097, 4397, 6397, 8397]
    assert fast.sequence_order(cu_q, cu_k, False, 128, 64) == [1, 3, 4, 2, 0]
    assert fast.sequence_order([0, 64, 1064], [0, 4096, 5096], True, 128, 64) == [1, 0]
    assert fast.sequence_order([0, 64, 664], [0, 4096, 4696], True, 128, 64) == [0, 1]
    assert fast.sequence_order([0, 0], [0, 0], True, 128, 64) == [0]


def emulate_packed_backward(q, k, v, dout, out, lse, cu_q, cu_k, causal, scale, block_N):
    """The packed backward on the CPU in float64, indexed as its three kernels index (the
    layout, not the arithmetic order): the preprocess fills each sequence's padded tiles of
    lse2 and delta from the forward's lse [H, total_q] (tiles between sequences stay NaN: reading
    one shows); each key block of a sequence walks ``query_block_range`` on its run-time
    lengths, loads Q/dO/K/V boxes at the sequence's packed offsets (rows of the next sequence
    included; past the end, zeros), masks only keys past the sequence's end and outside the
    causal diagonal, and reduce-adds whole dQ tiles into the sequence's tiles; the
    postprocess writes each tile's rows inside the sequence. dK/dV start as NaN: a key row
    no thread block writes shows."""
    fast = load_script(GQA_BWD).fast_bwd
    block_M, log2e = 128, 1 / math.log(2)
    total_q, H, D = q.shape
    Hkv = k.shape[1]
    groups, B = H // Hkv, len(cu_q) - 1
    n_tiles = fast.tile_start(total_q, B, block_N)
    nan = float("nan")
    lse2 = torch.full((H, n_tiles, block_N), nan, dtype=torch.float64)
    delta = torch.full((H, n_tiles, block_N), nan, dtype=torch.float64)
    row_delta = (out * dout).sum(-1).T  # [H, total_q]

    def box(x, start, n):  # TMA: rows start … start + n − 1, zeros past the tensor's end
        rows = x[start : start + n]
        return torch.cat([rows, rows.new_zeros(n - rows.shape[0], *rows.shape[1:])])

    for b in range(B):
        q0, Lq = cu_q[b], cu_q[b + 1] - cu_q[b]
        t0 = fast.tile_start(q0, b, block_N)
        for t in range(math.ceil(Lq / block_N)):
            for i in range(block_N):
                row = t * block_N + i
                real = row < Lq
                delta[:, t0 + t, i] = row_delta[:, q0 + row] if real else 0.0
                lse2[:, t0 + t, i] = lse[:, q0 + row] * log2e if real else math.inf

    dq_accum = torch.zeros(H, n_tiles, block_N, D, dtype=torch.float64)
    dk, dv = torch.full_like(k, nan), torch.full_like(v, nan)
    right = 0 if causal else -1
    for b in range(B):
        q0, k0 = cu_q[b], cu_k[b]
        Lq, Lk = cu_q[b + 1] - q0, cu_k[b + 1] - k0
        t0 = fast.tile_start(q0, b, block_N)
        hi = Lk - Lq + right
        key_blocks = math.ceil(
            max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)) / block_M
        )  # the grid
        for by, bx in itertools.product(range(Hkv), range(key_blocks)):
            if bx * block_M >= Lk:
                continue  # the early exit
            edges = (-1, right, hi, Lk - Lq + 1)
            q_start, n = (
                int(x)
                for x in fast.query_block_range(
                    bx, block_M, block_N, fast.padded_len(Lq, block_N), edges
                )
            )
            keys = torch.arange(bx * block_M, (bx + 1) * block_M)
            kb, vb = (
                box(k[:, by], k0 + bx * block_M, block_M),
                box(v[:, by], k0 + bx * block_M, block_M),
            )
            dk_t, dv_t = (
                torch.zeros(block_M, D, dtype=torch.float64),
                torch.zeros(block_M, D, dtype=torch.float64),
            )
            for h in range(by * groups, (by + 1) * groups):
                for kq in range(q_start, q_start + n):
                    qb = box(q[:, h], q0 + kq * block_N, block_N)
                    dob = box(dout[:, h], q0 + kq * block_N, block_N)
                    logit = (
                        kb @ qb.T * scale * log2e - lse2[h, t0 + kq][None, :]
                    )  # Pᵀ [keys, queries]
                    visible = (keys < Lk)[:, None].expand(-1, block_N)
                    if causal:
                        cols = kq * block_N + torch.arange(block_N)
                        visible = visible & (keys[:, None] <= cols[None, :] + hi)
                    p = torch.exp2(logit.masked_fill(~visible, -math.inf))
                    ds = p * (vb @ dob.T - delta[h, t0 + kq][None, :])
                    dv_t += p @ dob
                    dk_t += ds @ qb
                    dq_accum[h, t0 + kq] += ds.T @ kb
            rows = min(block_M, Lk - bx * block_M)
            dk[k0 + bx * block_M : k0 + bx * block_M + rows, by] = dk_t[:rows] * scale
            dv[k0 + bx * block_M : k0 + bx * block_M + rows, by] = dv_t[:rows]

    dq = torch.full_like(q, nan)
    for b in range(B):
        q0, Lq = cu_q[b], cu_q[b + 1] - cu_q[b]
        t0 = fast.tile_start(q0, b, block_N)
        for t in range(math.ceil(Lq / block_N)):
            rows = min(block_N, Lq - t * block_N)
            dq[q0 + t * block_N : q0 + t * block_N + rows] = (
                dq_accum[:, t0 + t, :rows].transpose(0, 1) * scale
            )
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_N", [64, 80, 128])
def test_packed_backward_layout_gives_reference_gradients(causal, block_N):
    """emulate_packed_backward (the packed kernels' indexing, in float64) equals autograd
    through ref_program: padding rows add nothing, boxes that run into the next sequence
    change nothing, sequences without queries get dK = dV = 0, rows without keys dQ = 0, and
    every gradient row is written (no NaN)."""
    mod = load_script(GQA_BWD)
    lens_q = [1, 0, 130, 17, 64, 200, 0]
    lens_k = [140, 3, 9, 0, 64, 300, 20]
    H, Hkv, D, scale = 4, 2, 8, 0.3
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, H, Hkv, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = mod.ref_program(*leaves, cu_q, cu_k, max_q, max_k, causal, scale, return_lse=True)
    want = torch.autograd.grad(out, leaves, dout)
    got = emulate_packed_backward(
        q,
        k,
        v,
        dout,
        out.detach(),
        lse.detach(),
        cu_q.tolist(),
        cu_k.tolist(),
        causal,
        scale,
        block_N,
    )
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


# ----------------------------------------------------------------------------- GPU
def _forward_cases():
    """(script, lens_q, lens_k, H, Hkv, D, causal, dtype, input scale)."""
    mix = [1, 700, 37, 1024, 255, 128, 129, 1]  # lengths 1 and the maximum, ragged blocks
    with_empty = [5, 0, 300, 17, 0]  # zero-length sequences, one of them last
    q_gt_k, k_for = [100, 1, 513, 64, 300], [300, 50, 17, 64, 0]  # Sq ≠ Sk both ways, no keys
    cases = []
    for script in SCRIPTS:
        gqa = [(8, 8)] if script == MHA_FWD else [(8, 8), (8, 4), (8, 2), (8, 1)]
        for i, (H, Hkv) in enumerate(gqa):
            cases += [
                (script, mix, mix, H, Hkv, 128, False, torch.float16, 1),
                (script, mix, mix, H, Hkv, 64, True, torch.bfloat16, 1),
            ][: 2 if i == 0 else 1]
        H, Hkv = gqa[-1]
        cases += [
            (script, with_empty, with_empty, H, Hkv, 128, True, torch.float16, 1),
            (script, q_gt_k, k_for, H, Hkv, 128, True, torch.bfloat16, 1),
            (script, q_gt_k, k_for, H, Hkv, 64, False, torch.float16, 1),
            (script, k_for, q_gt_k, H, Hkv, 64, True, torch.float16, 1),
            (script, mix, mix, H, Hkv, 128, True, torch.bfloat16, 10),
        ]
    return cases


def _case_id(case):
    script, lens_q, lens_k, H, Hkv, D, causal, dtype, scale = case
    lens = f"q{len(lens_q)}x{max(lens_q)}" + ("" if lens_q == lens_k else f"-k{max(lens_k)}")
    tag = (
        f"{script.split('/')[-1][8:-10]}-{lens}-H{H}-Hkv{Hkv}-D{D}-{'causal' if causal else 'full'}"
    )
    return tag + f"-{str(dtype)[6:]}" + (f"-x{scale}" if scale != 1 else "")


@pytest.mark.gpu
@pytest.mark.parametrize("case", _forward_cases(), ids=_case_id)
def test_forward_matches_reference(case, poisoned_empty):
    """out (rel < 1e-2) and, where exposed, lse against ref_program in float32; every
    buffer the kernels fill starts as NaN (poisoned_empty). Rows that see no key are exactly 0
    (and lse +inf), never NaN."""
    from helpers import rel_err

    script, lens_q, lens_k, H, Hkv, D, causal, dtype, scale = case
    mod = load_script(script)
    q, k, v, _, *varlen = make_varlen(lens_q, lens_k, H, Hkv, D, dtype, "cuda", scale)
    args = (q, k, v, *varlen, causal)
    ref_out, ref_lse = mod.ref_program(*args, return_lse=True)
    if script == GQA_BWD:
        out = mod.attention_varlen(*args)
    else:
        out, lse = mod.attention_varlen(*args, return_lse=True)
        assert lse.shape == ref_lse.shape
        assert rel_err(lse, ref_lse) < 1e-4  # lse comes from fp32 scores: much tighter
    assert rel_err(out, ref_out) < 1e-2, rel_err(out, ref_out)  # fp16/bf16 output
    no_key = ref_lse.isposinf().all(dim=0)  # query rows that see no key
    assert torch.all(out[no_key] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("script,Hkv", [(MHA_FWD, 32), (GQA_FWD, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_many_tiles_a_thread_block(script, Hkv, causal, poisoned_empty):
    """bench_varlen's batch (16384 tokens, 8 sequences up to 4096) at H32 D128: some 30 tiles a
    thread block, so the K/V ring's mbarrier phases wrap many times within one launch, which
    the small cases above never do. A schedule whose phases slip over many tiles hangs here
    (conftest's watchdog fails it) or gives wrong rows."""
    from helpers import rel_err

    mod = load_script(script)
    lens = bench_varlen.random_lengths()
    q, k, v, _, *varlen = make_varlen(lens, lens, 32, Hkv, 128, torch.bfloat16, "cuda")
    out, lse = mod.attention_varlen(q, k, v, *varlen, causal, return_lse=True)
    ref_out, ref_lse = mod.ref_program(q, k, v, *varlen, causal, return_lse=True)
    assert rel_err(lse, ref_lse) < 1e-4
    assert rel_err(out, ref_out) < 1e-2


PART_CASES = [  # (lens_q, lens_k, H, Hkv, D, causal, dtype): fewer tiles than SMs, long keys
    ([64, 64], [4096, 4096], 8, 2, 128, False, torch.bfloat16),
    ([200, 333], [2000, 4000], 4, 4, 128, True, torch.float16),
    ([17, 1, 300, 0], [5000, 3000, 0, 9], 4, 2, 64, True, torch.bfloat16),  # no keys, no queries
    ([17, 1, 300, 0], [5000, 3000, 0, 9], 4, 4, 64, False, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("script", [MHA_FWD, GQA_FWD])
@pytest.mark.parametrize("case", range(len(PART_CASES)))
def test_forward_tiles_in_parts(script, case, poisoned_empty):
    """Batches whose tiles go in parts over their keys on this GPU (asserted from the tile
    list): out and lse against ref_program, with every buffer poisoned (the parts' outputs
    included), rows that see no key exactly 0."""
    from helpers import rel_err

    lens_q, lens_k, H, Hkv, D, causal, dtype = PART_CASES[case]
    mod = load_script(script)
    Hkv = H if script == MHA_FWD else Hkv
    q, k, v, _, *varlen = make_varlen(lens_q, lens_k, H, Hkv, D, dtype, "cuda")
    cfg = mod.default_config(D, "sm_90a", causal)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cu_q, cu_k = varlen[0].tolist(), varlen[1].tolist()
    _, combine = mod.tile_schedule(cu_q, cu_k, H, cfg["block_M"], cfg["block_N"], causal, num_sms)
    assert len(combine) > 0
    out, lse = mod.attention_varlen(q, k, v, *varlen, causal, return_lse=True)
    ref_out, ref_lse = mod.ref_program(q, k, v, *varlen, causal, return_lse=True)
    assert rel_err(lse, ref_lse) < 1e-4
    assert rel_err(out, ref_out) < 1e-2
    assert torch.all(out[ref_lse.isposinf().all(dim=0)] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "D,causal,dtype", [(128, True, torch.float16), (64, False, torch.bfloat16)]
)
def test_equal_lengths_match_dense_kernel(script, D, causal, dtype, poisoned_empty):
    """All sequences of one length: the packed batch is the dense batch reshaped, and the varlen
    kernel must give what the dense kernel gives on the same data. Same tiles, same arithmetic
    per row: only rounding may differ, so the bound is 10× under the reference tolerance
    (outputs and all gradients)."""
    from helpers import rel_err

    mod, dense = load_script(script), load_script(DENSE[script])
    B, S = 3, 300
    H, Hkv = (8, 8) if script == MHA_FWD else (8, 2)
    q, k, v, dout, *varlen = make_varlen([S] * B, [S] * B, H, Hkv, D, dtype, "cuda")
    if script != GQA_BWD:
        out = mod.attention_varlen(q, k, v, *varlen, causal)
        ref = dense.attention(*(t.view(B, S, *t.shape[1:]) for t in (q, k, v)), causal)
        assert rel_err(out.view(B, S, H, D), ref) < 1e-3
        return
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = mod.attention_varlen(*leaves, *varlen, causal)
    grads = torch.autograd.grad(out, leaves, dout)
    dense_leaves = [t.detach().view(B, S, *t.shape[1:]).requires_grad_() for t in (q, k, v)]
    ref = dense.attention(*dense_leaves, causal)
    ref_grads = torch.autograd.grad(ref, dense_leaves, dout.view(B, S, H, D))
    assert rel_err(out.view(B, S, H, D), ref) < 1e-3
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert rel_err(a.view(b.shape), b) < 1e-3, f"d{name}"


def _backward_cases():
    """(lens_q, lens_k, H, Hkv, D, causal, dtype, input scale): groups 1/2/4/8, both dtypes
    and head dims, a length-1 and a maximal sequence, zero-length sequences, Sq ≠ Sk (rows with
    no key, keys no query sees), ×10 inputs."""
    mix = [1, 700, 37, 1024, 255, 128, 129, 1]
    with_empty = [5, 0, 300, 17, 0]
    q_gt_k, k_for = [100, 1, 513, 64, 300, 0], [300, 50, 17, 64, 0, 40]
    return [
        (mix, mix, 8, 8, 128, False, torch.float16, 1),
        (mix, mix, 8, 4, 128, True, torch.bfloat16, 1),
        (mix, mix, 8, 2, 64, True, torch.float16, 1),
        (mix, mix, 8, 1, 64, False, torch.bfloat16, 1),
        (with_empty, with_empty, 8, 2, 128, True, torch.float16, 1),
        (q_gt_k, k_for, 8, 4, 128, True, torch.bfloat16, 1),
        (k_for, q_gt_k, 8, 8, 64, True, torch.float16, 1),
        (q_gt_k, k_for, 8, 1, 128, False, torch.float16, 1),
        (mix, mix, 8, 2, 128, True, torch.bfloat16, 10),
    ]


def _bwd_case_id(case):
    return _case_id((GQA_BWD, *case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", _backward_cases(), ids=_bwd_case_id)
def test_gradients_match_reference(case, poisoned_empty):
    """out (rel < 1e-2) and dq, dk, dv (rel < 2e-2) against autograd through ref_program in
    float32; every buffer the kernels fill starts as NaN (poisoned_empty). Query rows that see
    no key get out 0 and dq 0; keys that no query sees get dk = dv = 0."""
    from helpers import rel_err

    mod = load_script(GQA_BWD)
    lens_q, lens_k, H, Hkv, D, causal, dtype, scale = case
    q, k, v, dout, *varlen = make_varlen(lens_q, lens_k, H, Hkv, D, dtype, "cuda", scale)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = mod.attention_varlen(*leaves, *varlen, causal)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = mod.ref_program(*ref_leaves, *varlen, causal, return_lse=True)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.float())
    assert rel_err(out, ref_out) < 1e-2  # fp16/bf16 forward
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert rel_err(a, b) < 2e-2, f"d{name}: {rel_err(a, b):.3e}"  # gradients
    no_key = ref_lse.isposinf().all(dim=0)
    assert torch.all(out[no_key] == 0) and torch.all(grads[0][no_key] == 0)
    unseen = (ref_grads[2] == 0).flatten(1).all(dim=1)  # keys no query sees (exact in fp32)
    assert torch.all(grads[1][unseen] == 0) and torch.all(grads[2][unseen] == 0)


@pytest.mark.gpu
def test_backward_saves_only_what_it_uses_and_takes_expanded_dout(poisoned_empty):
    """The autograd node holds q, k, v, out, lse and the two cu_seqlens, nothing else; and
    loss = out.sum() (a stride-0 dout) with a non-default scale still gives right gradients."""
    from helpers import rel_err

    mod = load_script(GQA_BWD)
    q, k, v, _, *varlen = make_varlen([300, 1, 77], [300, 9, 0], 8, 2, 128, torch.bfloat16, "cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = mod.attention_varlen(*leaves, *varlen, causal=True, softmax_scale=0.05)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 7 and saved[-2].dtype == torch.int32 and saved[-1].dtype == torch.int32
    grads = torch.autograd.grad(out.float().sum(), leaves)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = mod.ref_program(*ref_leaves, *varlen, causal=True, softmax_scale=0.05)
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert rel_err(a, b) < 2e-2, f"d{name}"  # fp16/bf16 gradients


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
def test_new_batch_does_not_recompile(script):
    """Two batches with different token counts and batch sizes run on one compiled kernel each
    (the backward script: its forward, imported from example_gqa_fwd_varlen.py, and the packed
    backward's three kernels)."""
    mod = load_script(script)
    factories = [mod.flashattn_fwd_varlen] if script != GQA_BWD else [
        mod.fwd.flashattn_fwd_varlen,
        mod.fast_bwd.flash_bwd_prep,
        mod.fast_bwd.flash_bwd,
        mod.fast_bwd.flash_bwd_post,
    ]  # fmt: skip
    H, Hkv = heads_for(script, 8, 2)
    for lens in ([17, 300], [1, 2, 3, 500, 64]):
        q, k, v, dout, *varlen = make_varlen(lens, lens, H, Hkv, 64, torch.float16, "cuda")
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = mod.attention_varlen(*leaves, *varlen, causal=True)
        if script == GQA_BWD:
            torch.autograd.grad(out, leaves, dout)
        if lens[0] == 17:
            built = [len(f._kernel_cache) for f in factories]
    assert [len(f._kernel_cache) for f in factories] == built


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
def test_empty_batches(script):
    """No keys at all: out 0 (and dq 0); no queries at all: an empty out (and dk = dv = 0).
    Nothing is launched for either."""
    mod = load_script(script)
    H, Hkv = heads_for(script, 8, 2)
    for lens_q, lens_k in (([5, 3], [0, 0]), ([0, 0], [7, 1])):
        q, k, v, dout, *varlen = make_varlen(lens_q, lens_k, H, Hkv, 64, torch.float16, "cuda")
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = mod.attention_varlen(*leaves, *varlen)
        assert out.shape == q.shape and torch.all(out == 0)
        if script == GQA_BWD:
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
            assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("extra", [[], ["--causal", "--dtype", "bfloat16", "--seq_len_k", "700"]])
def test_main_small(script, extra, capsys):
    """main() end to end at a small size: random lengths → unpad_input → kernels → pad_input,
    checked against the padded dense reference (it raises otherwise), then the benchmark."""
    argv = ["--batch", "5", "--heads", "8", "--seq_len", "300", "--dim", "64", *extra]
    if script != MHA_FWD:
        argv += ["--groups", "2"]
    load_script(script).main(argv)
    out = capsys.readouterr().out
    assert "out " in out and "TFLOP/s" in out
    if script == GQA_BWD:
        assert all(f"{name} " in out for name in ("dq", "dk", "dv"))
        assert "varlen backward" in out and "varlen forward+backward" in out


@pytest.mark.parametrize("dim", [64, 128])
def test_backward_fits_hopper_shared_memory(dim):
    """The H100 refused a 312320-byte launch of an earlier version of this script's backward:
    check the dynamic shared memory of the compiled launch against the 227 KB per-block
    limit."""
    import harness

    mod = load_script(GQA_BWD)
    cfg = mod.default_config(dim, "sm_90a")
    args = (None, 8, None, None, dim, True, dim**-0.5, "float16")
    kernel = harness.compile_for(
        mod.fast_bwd.flash_bwd, "sm_90a", *args, **cfg, groups=4, layout="thd"
    )  # fmt: skip
    assert harness.dynamic_smem_bytes(kernel) <= 232448


def test_bench_dense_seqlens():
    """bench_varlen's equal-length batches: any S in 1..16384 (the first B·S tokens when S does
    not divide them) or ``matched``, the S of equal attention work per token (ΣL² / ΣL)."""
    assert bench_varlen.matched_seqlen(bench_varlen.random_lengths()) == 2426  # the seeded batch
    assert bench_varlen.matched_seqlen([100, 300]) == 250  # (10^4 + 9·10^4) / 400
    assert bench_varlen.seqlen_arg("matched") == "matched"
    assert bench_varlen.seqlen_arg("2426") == 2426 and bench_varlen.seqlen_arg("16384") == 16384
    for bad in ("0", "16385"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_varlen.seqlen_arg(bad)
    with pytest.raises(SystemExit):
        bench_varlen.main(["--dense-seqlens", "0"])


def stub_bench_gpu(monkeypatch, fake_rows):
    """bench_varlen without a GPU: no kernels loaded, ``fake_rows(mode)`` for the rows."""
    monkeypatch.setattr(bench_varlen.harness, "require_gpu", lambda name: None)
    monkeypatch.setattr(bench_varlen, "load", lambda path: types.SimpleNamespace(fast_bwd=None))
    monkeypatch.setattr(bench_varlen, "forward_rows", fake_rows("fwd"))
    monkeypatch.setattr(bench_varlen, "backward_rows", fake_rows("bwd"))
    monkeypatch.setattr(bench_varlen.torch.cuda, "get_device_name", lambda: "GPU X")


def test_bench_records_when_and_how(tmp_path, monkeypatch):
    """bench_varlen's results say which command made them and when (UTC), in varlen.md's
    header and in varlen.json, beside the tables. The GPU parts are stubbed: one forward row and
    one backward row for each setting."""
    rows = {"fwd": 0, "bwd": 0}

    def fake_rows(mode):
        def make(_kernels, _dense, _lengths, causal, dtype, _seqlens):
            rows[mode] += 1
            impl = "tilelang varlen"
            return [{"mode": mode, "impl": impl, "causal": causal, "dtype": dtype, "tflops": 500.0,
                     "ms": 1.0, "ours": True}]  # fmt: skip

        return make

    stub_bench_gpu(monkeypatch, fake_rows)
    bench_varlen.main(["--out", str(tmp_path), "--dtypes", "bfloat16", "--dense-seqlens", "2048"])
    assert rows == {"fwd": 2, "bwd": 2}  # causal and not
    command = (
        f"python benchmarks/bench_varlen.py --out {tmp_path} --dtypes bfloat16 --dense-seqlens 2048"
    )
    table = (tmp_path / "varlen.md").read_text()
    assert f"`{command}`, one process, " in table
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d–\d\d:\d\d UTC", table)
    record = json.loads((tmp_path / "varlen.json").read_text())
    assert record["command"] == command and record["device"] == "GPU X"
    assert re.fullmatch(r"\d\d:\d\d–\d\d:\d\d UTC", record["time"])


def test_bench_cut_short_keeps_the_settings_it_finished(tmp_path, monkeypatch):
    """A bench_varlen run stopped partway (a time limit) leaves varlen.json with the rows of
    every setting it finished. The GPU parts are stubbed; the backward of the second setting
    (causal) stops the run."""

    def fake_rows(mode):
        def make(_kernels, _dense, _lengths, causal, dtype, _seqlens):
            if mode == "bwd" and causal:
                raise KeyboardInterrupt  # as a timeout's signal would stop it
            return [{"mode": mode, "impl": "tilelang varlen", "causal": causal, "dtype": dtype,
                     "tflops": 500.0, "ms": 1.0, "ours": True}]  # fmt: skip

        return make

    stub_bench_gpu(monkeypatch, fake_rows)
    with pytest.raises(KeyboardInterrupt):
        bench_varlen.main(["--out", str(tmp_path), "--dtypes", "bfloat16"])
    record = json.loads((tmp_path / "varlen.json").read_text())
    assert [(r["mode"], r["causal"]) for r in record["rows"]] == [("fwd", False), ("bwd", False)]
