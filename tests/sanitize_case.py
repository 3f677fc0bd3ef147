"""Small ragged causal forwards + backwards of the hand-scheduled kernels — MHA, GQA
(example_gqa_bwd.py's group strategy, four query heads a kv head, shared out over four thread
blocks a key block by the small-grid default, and at D = 64 also walked by one thread block of
128 keys; each also with a single key block and Sq > Sk), attention sinks with a window
(example_gqa_sink_bwd_bhsd.py's group strategy, both window edges, key blocks no query reaches:
narrow windows take its dQ pass, a wider one the fused kernel; its forward on a grid of several
tiles a thread block; the varlen sink forward in parts) and packed sequences
(example_gqa_bwd_tma_reduce_varlen.py: the persistent varlen forward and the packed backward,
with a zero-length sequence, Sq ≠ Sk and partial blocks; at D = 64 also the forward without a
mask, whose 192-row tiles take turns, and at D = 128 a causal forward whose tiles go in parts
over long keys), the fast backward with its last wave's walks in parts over the queries
(non-causal, ragged: tail_split_plan) or of an odd step count, and the dense forward with its
tiles in parts over the keys (ragged keys, and a causal grid with fewer tiles than SMs: parts
of each tile's own key blocks, merged by the combine kernel), in causal pairs of an odd block
count, or in clusters of two thread blocks sharing K/V by TMA multicast (D = 128 without
causal), or from a tile counter (causal D = 128, 165 tiles of 33 heads) — for
compute-sanitizer (not collected by pytest). On an H100, from the repository root:

    python tests/sanitize_case.py                      # compile once (TileLang caches it)
    compute-sanitizer --tool memcheck python tests/sanitize_case.py
    compute-sanitizer --tool racecheck python tests/sanitize_case.py
    compute-sanitizer --tool racecheck python tests/sanitize_case.py sink   # one family:
                                                        # mha (MHA and GQA), tail, odd,
                                                        # sink, varlen or fwd
"""

import itertools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import load_script  # noqa: E402

FAMILIES = sys.argv[1:] or ["mha", "tail", "odd", "sink", "varlen", "fwd"]
mha = load_script("flash_attention/example_mha_bwd_wgmma_pipelined.py")
gqa = load_script("flash_attention/example_gqa_bwd.py")
# "GQA walk": the group's four heads walked by one thread block of 128 keys, which at D = 64
# under the diagonal takes its turn at dQ as a branch on the step.
walk = dict(strategy="group", config=dict(gqa.fast_bwd.default_config(64), head_splits=1))
families = (("MHA", mha.attention, 2, 2, {}), ("GQA", gqa.attention, 4, 1, {}))
for name, attention, H, Hkv, kw in families + (("GQA walk", gqa.attention, 4, 1, walk),):
    if "mha" not in FAMILIES:
        break
    # (255, 17), (512, 64): one key block, which sees one query block.
    for D, Sq, Sk in ((64, 200, 333), (128, 200, 333), (128, 255, 17), (64, 512, 64)):
        if kw and D != 64:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (
            torch.randn(1, S, heads, D, generator=g, device="cuda", dtype=torch.bfloat16)
            for S, heads in ((Sq, H), (Sk, Hkv), (Sk, Hkv), (Sq, H))
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, causal=True, **kw)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
        print(f"{name} D{D} Sq{Sq} Sk{Sk}: finite", finite)

# One wave of whole walks, then a last wave in parts on 132 SMs: D64 S2000 H9 (288 walks, the
# last 24 in two parts), D128 S1500 H12 (144 walks, the last 12 in three parts).
for D, S, H in ((64, 2000, 9), (128, 1500, 12)) if "tail" in FAMILIES else ():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, S, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(mha.attention(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    print(f"tail D{D} S{S} H{H}: finite", all(bool(torch.isfinite(t).all()) for t in grads))

# Walks of an odd step count, whose count of turns the fast backward reads through a warp
# shuffle: D128 S300 without a mask (five query blocks, a compile-time count), D64 S400 (its
# even control) and D128 Sq777 Sk1000 causal (the storing launch runs one key block a row,
# thirteen query blocks).
for D, Sq, Sk, causal in ((128, 300, 300, False), (64, 400, 400, False), (128, 777, 1000, True)):
    if "odd" not in FAMILIES:
        break
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, S, 2, D, generator=g, device="cuda", dtype=torch.bfloat16)
        for S in (Sq, Sk, Sk, Sq)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = mha.attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
    print(f"odd D{D} Sq{Sq} Sk{Sk} causal={causal}: finite", finite)

sink = load_script("attention_sink/example_gqa_sink_bwd_bhsd.py")
sink_varlen = load_script("attention_sink/example_gqa_sink_fwd_varlen.py")
for D in (64, 128) if "sink" in FAMILIES else ():
    # (Sq, Sk, window, causal, kv heads); the last, two grid rows whose short walks launch
    # after both rows' long ones at D = 128 (the fast backward's launch_order)
    cases = (
        (200, 333, (64, 0), True, 1),
        (64, 600, (32, 16), False, 1),
        (200, 333, (300, 0), True, 1),
        (1000, 1000, (300, 0), True, 2),
    )
    for Sq, Sk, window, causal, Hkv in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (
            torch.randn(1, heads, S, D, generator=g, device="cuda", dtype=torch.bfloat16)
            for S, heads in ((Sq, 4), (Sk, Hkv), (Sk, Hkv), (Sq, 4))
        )
        sinks = torch.randn(4, generator=g, device="cuda")
        leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
        out = sink.attention(*leaves, window, causal, strategy="group")
        grads = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
        print(f"sink D{D} Sq{Sq} Sk{Sk} Hkv{Hkv} window {window}: finite", finite)
    # The forward alone on 480 tiles, three or four a thread block: each after the first starts
    # under the last P V of the one before (Q in two slots, one thread block an SM)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(2, heads, 700, D, generator=g, device="cuda", dtype=torch.bfloat16)
        for heads in (40, 8, 8)
    )
    sinks = torch.randn(40, generator=g, device="cuda")
    out = sink.fwd.attention(q, k, v, sinks, (300, 0), True)
    # causal, no left bound: the same 480 tiles from the tile counter (counter_section)
    out2 = sink.fwd.attention(q, k, v, sinks, (-1, -1), True)
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t).all()) for t in (out, out2))
    print(f"sink forward D{D}, 480 tiles, round-robin and from the counter: finite", finite)
    # The varlen sink forward, few tiles over long keys: in parts (a left edge cut at the parts'
    # ends; causal), merged with the sinks by its combine kernel; an empty sequence among them
    lengths = [(300, 12000), (0, 7), (17, 9000)]
    cu_q, cu_k = (
        torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda")
        for n in ([p[0] for p in lengths], [p[1] for p in lengths])
    )
    q = torch.randn(317, 4, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(21007, 2, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in "kv"
    )
    outs = [
        sink_varlen.attention_varlen(q, k, v, cu_q, cu_k, 300, 12000, sinks[:4], window, causal)
        for window, causal in (((9000, 0), False), ((-1, -1), True))
    ]
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t).all()) for t in outs)
    print(f"sink varlen forward D{D} in parts: finite", finite)

varlen = load_script("flash_attention/example_gqa_bwd_tma_reduce_varlen.py")
lens_q, lens_k = [200, 0, 17, 130], [333, 5, 17, 64]
cu_q, cu_k = ([0] + [sum(lens[: i + 1]) for i in range(len(lens))] for lens in (lens_q, lens_k))
cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32, device="cuda") for cu in (cu_q, cu_k))
for D in (64, 128) if "varlen" in FAMILIES else ():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(n, heads, D, generator=g, device="cuda", dtype=torch.bfloat16)
        for n, heads in ((sum(lens_q), 4), (sum(lens_k), 1), (sum(lens_k), 1), (sum(lens_q), 4))
    )
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = varlen.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    print(f"varlen D{D}: finite", all(bool(torch.isfinite(t).all()) for t in (out, *grads)))
    if D == 64:  # without a mask: 192-row tiles, whose three warpgroups take turns
        with torch.no_grad():
            out = varlen.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
        torch.cuda.synchronize()
        print("varlen forward D64 without a mask: finite", bool(torch.isfinite(out).all()))
    if D == 128:  # fewer tiles than SMs over long keys: walked in parts, then merged
        cu_q2, cu_k2 = (
            torch.tensor(c, dtype=torch.int32, device="cuda")
            for c in ([0, 40, 340], [0, 4000, 7000])
        )
        q2 = torch.randn(340, 4, D, generator=g, device="cuda", dtype=torch.bfloat16)
        k2, v2 = (
            torch.randn(7000, 1, D, generator=g, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        with torch.no_grad():
            out = varlen.attention_varlen(q2, k2, v2, cu_q2, cu_k2, 300, 4000, causal=True)
        torch.cuda.synchronize()
        print("varlen forward D128 in parts: finite", bool(torch.isfinite(out).all()))

dense = load_script("flash_attention/example_mha_fwd_bshd.py")
for D in (64, 128, 256) if "fwd" in FAMILIES else ():  # D=256: O staged in V's ring
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, S, 4, D, generator=g, device="cuda") for S in (17, 4100, 4100))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out = dense.attention(q, k, v)  # 4 tiles, 33 key blocks (65 at D=256): 8 or 16 parts a tile
    # causal, 18 tiles (12 at D=64) in parts of their own key blocks (the first tiles' last
    # parts have none)
    q2 = torch.randn(1, 1100, 2, D, generator=g, device="cuda")
    k2, v2 = (torch.randn(1, 4100, 2, D, generator=g, device="cuda") for _ in range(2))
    out2 = dense.attention(*(t.to(torch.bfloat16) for t in (q2, k2, v2)), causal=True)
    # causal pairs with 5 query blocks a head (640 rows): two heads' middle blocks pair up, and
    # with 33 heads a last head is left alone (tile_of); 165 tiles, more than the SMs. At D=128
    # the pairs would leave a ragged round: the tiles come from a counter (counter_section)
    q3, k3, v3 = (torch.randn(1, 640, 33, D, generator=g, device="cuda") for _ in range(3))
    out3 = dense.attention(*(t.to(torch.bfloat16) for t in (q3, k3, v3)), causal=True)
    # ragged keys, 480 tiles: three or four a thread block, each after the first started under
    # the last P V of the one before (Q in two slots, up to D=128); at D=128 in clusters of two
    # sharing K/V by multicast, as is q4 below (whole tiles, then parts)
    q6, k6, v6 = (torch.randn(2, 700, 40, D, generator=g, device="cuda") for _ in range(3))
    out6 = dense.attention(*(t.to(torch.bfloat16) for t in (q6, k6, v6)))
    outs = [out, out2, out3, out6]
    if D in (64, 256):  # causal from the counter (counter_section): 270 tiles, or 160 at D=256,
        # where the pairs would leave a ragged round (O staged in V's ring: its store, then V)
        heads = 45 if D == 64 else 20
        q7, k7, v7 = (torch.randn(1, 1000, heads, D, generator=g, device="cuda") for _ in range(3))
        outs.append(dense.attention(*(t.to(torch.bfloat16) for t in (q7, k7, v7)), causal=True))
    if D == 128:
        # ragged keys in whole tiles then parts (144 tiles over 17 key blocks: Sk reaches the
        # mask by a shuffle), and 160 keys a block (no causal, Sk >= 8192), 4 tiles in parts
        q4 = torch.randn(1, 1000, 18, D, generator=g, device="cuda")
        k4, v4 = (torch.randn(1, 2100, 18, D, generator=g, device="cuda") for _ in range(2))
        outs.append(dense.attention(*(t.to(torch.bfloat16) for t in (q4, k4, v4))))
        q5 = torch.randn(1, 17, 4, D, generator=g, device="cuda").to(torch.bfloat16)
        k5, v5 = (torch.randn(1, 8200, 4, D, generator=g, device="cuda") for _ in range(2))
        outs.append(dense.attention(q5, *(t.to(torch.bfloat16) for t in (k5, v5))))
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t).all()) for t in outs)
    print(f"forward in parts, and causal pairs of an odd block count, D{D}: finite", finite)
