"""Benchmark the varlen (packed) kernels against their peers in one process, on one GPU.

The batch: random sequence lengths in 1..4096 (seeded) drawn until they hold 16384 tokens (the
last one trimmed so the total is exactly 16384), H = 32, D = 128, causal and not, fp16 and
bf16 — the setting of FlashAttention-3's published varlen figures. For each:

- forward: ours (example_mha_fwd_varlen.py) against FA3's ``flash_attn_varlen_func`` (bf16
  only; skipped when ``fa3_fwd_interface`` is missing or is not FA3's), and against our dense
  forward (example_mha_fwd_bshd.py) at the same token count, B = 16384 // S sequences of
  equal length S (the batch's first B·S tokens), beside our varlen kernel on that same
  equal-length batch (the cost of varlen itself);
- backward (the backward pass alone, 2.5× the forward FLOPs): ours
  (example_gqa_bwd_tma_reduce_varlen.py, one kv head per query head) against SDPA FLASH (FA2)
  and cuDNN on the padded equivalent — the batch padded to its longest sequence, which is what
  a model without varlen kernels runs; and, at the same token count, our dense hand-scheduled
  backward (example_mha_bwd_wgmma_pipelined.py, which example_gqa_bwd.py's ``group`` strategy
  runs) on B = 16384 // S sequences of length S, beside our varlen backward on that batch.

The equal-length S default to 2048, 4096 and ``matched``: the S whose dense batch does the same
attention work per token as the random one, ΣL² / ΣL (2426 for the seeded batch).

FLOPs count the useful work of the packed batch (summed per sequence, as docs/CONVENTIONS.md
says) for every row of a report, padded peers included, so TFLOP/s compare as times. Each of our
rows is checked against SDPA FLASH run sequence by sequence before it is timed.

Writes ``<out>/varlen.json`` (one record per implementation and setting; written again after
every setting, so a run cut short keeps the rows it finished) and ``<out>/varlen.md`` (the
tables).

    python benchmarks/bench_varlen.py --out benchmarks/results
"""

import argparse
import functools
import importlib.util
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import bert_padding as bp  # noqa: E402
import harness  # noqa: E402

TOKENS = 16384
MAX_LEN = 4096
HEADS, DIM = 32, 128


def load(relpath):
    spec = importlib.util.spec_from_file_location(pathlib.Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_lengths(tokens=TOKENS, max_len=MAX_LEN, seed=0):
    """Lengths drawn from 1..max_len until they reach ``tokens``; the last is trimmed so they sum
    to exactly ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(1, max_len + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def matched_seqlen(lengths):
    """The S at which equal-length sequences do as much attention work per token as ``lengths``
    (work per sequence ∝ L², causal or not): ΣL² / ΣL, rounded."""
    return round(sum(n * n for n in lengths) / sum(lengths))


def seqlen_arg(text):
    """--dense-seqlens: a length in 1..16384, or ``matched`` (``matched_seqlen``)."""
    if text == "matched":
        return text
    S = int(text)
    if not 1 <= S <= TOKENS:
        raise argparse.ArgumentTypeError(f"{S} is not in 1..{TOKENS}")
    return S


def make_batch(lengths, dtype, seed=0):
    """The padded batch (q, k, v, dout ``[B, max_len, H, D]``, zeros in the padding) with its
    mask, and its packed form through bert_padding, as a user would build it."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, S = len(lengths), max(lengths)
    mask = torch.arange(S, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
    padded = [
        torch.randn(B, S, HEADS, DIM, generator=g, device="cuda", dtype=dtype)
        * mask[..., None, None]
        for _ in range(4)
    ]
    q, indices, cu_seqlens, max_seqlen, _ = bp.unpad_input(padded[0], mask)
    k, v, dout = (bp.unpad_input(t, mask)[0] for t in padded[1:])
    packed = dict(q=q, k=k, v=v, dout=dout, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    return padded, mask, packed


def sdpa_per_sequence(q, k, v, dout, cu_seqlens, causal, scale):
    """Reference out, dq, dk, dv: SDPA FLASH (FA2) on each sequence alone (Sq = Sk per sequence,
    so its top-left causal mask is the bottom-right one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bounds = cu_seqlens.tolist()
    outs, grads = [], [[], [], []]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        leaves = [t[start:end].transpose(0, 1)[None].detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, is_causal=causal, scale=scale
            )
        seq_dout = dout[start:end].transpose(0, 1)[None]
        for acc, grad in zip(grads, torch.autograd.grad(out, leaves, seq_dout), strict=True):
            acc.append(grad[0].transpose(0, 1))
        outs.append(out.detach()[0].transpose(0, 1))
    return torch.cat(outs), *(torch.cat(g) for g in grads)


def forward_rows(fwd, dense, lengths, causal, dtype_name, dense_seqlens):
    dtype = harness.DTYPES[dtype_name]
    scale = DIM**-0.5
    _, _, p = make_batch(lengths, dtype)
    cu, max_len = p["cu_seqlens"], p["max_seqlen"]
    varlen = (p["q"], p["k"], p["v"], cu, cu, max_len, max_len)
    ref = sdpa_per_sequence(p["q"], p["k"], p["v"], p["dout"], cu, causal, scale)[0]
    out = fwd.attention_varlen(*varlen, causal, scale)
    rel = harness.check_close("out", out, ref, 1e-2)  # fp16/bf16 forward

    setting = {"dtype": dtype_name, "causal": causal, "tokens": TOKENS, "B": len(lengths)}
    ours = {"tilelang varlen": lambda: fwd.attention_varlen(*varlen, causal, scale)}
    peers = {}
    fa3 = harness.fa3_varlen_forward()
    if fa3 is not None and dtype == torch.bfloat16:
        peers["fa3 varlen"] = lambda: fa3(*varlen, softmax_scale=scale, causal=causal)
    flops = harness.varlen_flops(cu, cu, HEADS, DIM, DIM, causal)
    title = f"varlen fwd {len(lengths)} seqs, {TOKENS} tokens, H{HEADS} D{DIM} causal={causal} "
    rows = [
        {**r, **setting, "mode": "fwd", "S": None, "rel_err": rel if r["ours"] else None}
        for r in harness.report(title + dtype_name, ours, peers, flops)
    ]

    for S in dense_seqlens:
        B = TOKENS // S  # the first B·S tokens, when S does not divide them
        packed = [p[n][: B * S] for n in ("q", "k", "v")]
        q, k, v = (t.view(B, S, HEADS, DIM) for t in packed)
        equal_cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device="cuda")
        equal = (*packed, equal_cu, equal_cu, S, S)
        check = harness.sdpa_peers(q, k, v, causal, scale)["sdpa_flash(FA2)"]()
        rel = harness.check_close("dense", dense.attention(q, k, v, causal, scale), check, 1e-2)
        ours = {
            "tilelang dense": lambda q=q, k=k, v=v: dense.attention(q, k, v, causal, scale),
            "tilelang varlen equal": lambda e=equal: fwd.attention_varlen(*e, causal, scale),
        }
        flops = harness.attention_flops(B, HEADS, S, S, DIM, DIM, causal)
        title = f"equal lengths fwd B{B} S{S} H{HEADS} D{DIM} causal={causal} {dtype_name}"
        rows += [
            {**r, **setting, "mode": "fwd-equal", "S": S, "B": B, "tokens": B * S, "rel_err": rel}
            for r in harness.report(title, ours, {}, flops)
        ]
    return rows


def backward_rows(bwd, dense_bwd, lengths, causal, dtype_name, dense_seqlens):
    dtype = harness.DTYPES[dtype_name]
    scale = DIM**-0.5
    padded, _, p = make_batch(lengths, dtype)
    cu, max_len = p["cu_seqlens"], p["max_seqlen"]
    leaves = [p[n].detach().requires_grad_() for n in ("q", "k", "v")]
    varlen = (*leaves, cu, cu, max_len, max_len, causal, scale)
    out = bwd.attention_varlen(*varlen)  # graph kept: the backward alone is timed
    grads = torch.autograd.grad(out, leaves, p["dout"], retain_graph=True)
    ref = sdpa_per_sequence(p["q"], p["k"], p["v"], p["dout"], cu, causal, scale)
    rels = [
        harness.check_close(f"d{n}", g, r, 2e-2)  # fp16/bf16 gradients
        for n, g, r in zip("qkv", grads, ref[1:], strict=True)
    ]
    ours = {
        "tilelang varlen": lambda: torch.autograd.grad(out, leaves, p["dout"], retain_graph=True)
    }
    _, peers = harness.sdpa_backward_peers(*padded, causal, scale)
    peers = {f"{name} padded": fn for name, fn in peers.items()}
    flops = harness.varlen_flops(cu, cu, HEADS, DIM, DIM, causal, backward=True)
    title = (
        f"varlen bwd {len(lengths)} seqs (padded to {max_len}), {TOKENS} tokens, "
        f"H{HEADS} D{DIM} causal={causal} {dtype_name}"
    )
    setting = {"dtype": dtype_name, "causal": causal, "tokens": TOKENS, "B": len(lengths)}
    rows = [
        {**r, **setting, "mode": "bwd", "S": None, "rel_err": max(rels) if r["ours"] else None}
        for r in harness.report(title, ours, peers, flops)
    ]

    # The same tokens as B = TOKENS // S sequences of length S: the dense hand-scheduled backward
    # (example_gqa_bwd.py's `group` strategy runs it; here one kv head per query head) beside
    # the varlen one on that batch, both as their plain backward functions (no autograd).
    for S in dense_seqlens:
        B = TOKENS // S  # the first B·S tokens, when S does not divide them
        packed = [p[n][: B * S] for n in ("q", "k", "v")]
        equal_dout = p["dout"][: B * S]
        q, k, v, dout = (t.view(B, S, HEADS, DIM) for t in (*packed, equal_dout))
        out, lse = dense_bwd.attention_forward(q, k, v, causal, scale)
        cu_eq = torch.arange(0, B * S + 1, S, dtype=torch.int32, device="cuda")
        v_out, v_lse = bwd.attention_forward(*packed, cu_eq, cu_eq, S, causal, scale)
        dense_grads = dense_bwd.attention_backward(dout, q, k, v, out, lse, causal, scale)
        varlen_grads = bwd.attention_backward(
            equal_dout, *packed, v_out, v_lse, cu_eq, cu_eq, (S, S), causal, scale
        )
        rel = max(
            harness.check_close(f"d{n} equal", a.reshape(b.shape), b, 2e-2)
            for n, a, b in zip("qkv", dense_grads, varlen_grads, strict=True)
        )
        ours = {
            "tilelang dense": lambda q=q, k=k, v=v, dout=dout, out=out, lse=lse: (
                dense_bwd.attention_backward(dout, q, k, v, out, lse, causal, scale)
            ),
            "tilelang varlen equal": functools.partial(
                bwd.attention_backward,
                *(equal_dout, *packed, v_out, v_lse, cu_eq, cu_eq, (S, S), causal, scale),
            ),
        }
        flops = harness.attention_flops(B, HEADS, S, S, DIM, DIM, causal, backward=True)
        title = f"equal lengths bwd B{B} S{S} H{HEADS} D{DIM} causal={causal} {dtype_name}"
        rows += [
            {**r, **setting, "mode": "bwd-equal", "S": S, "B": B, "tokens": B * S, "rel_err": rel}
            for r in harness.report(title, ours, {}, flops)
        ]
    return rows


def _tflops(rows, **match):
    sel = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return sel[0]["tflops"] if sel else math.nan


def markdown(rows, dense_seqlens):
    """Two tables: forward (ours, FA3, dense at equal tokens and the ratios the issue asks
    for) and backward (ours against the padded SDPA peers, and against the dense backward at
    equal tokens)."""
    fwd_head = ["causal", "dtype", "tilelang varlen", "fa3 varlen", "ours ÷ FA3"]
    for S in dense_seqlens:
        fwd_head += [f"dense S{S}", f"varlen equal S{S}", f"varlen ÷ dense S{S}"]
    lines = ["| " + " | ".join(fwd_head) + " |", "|" + "---|" * len(fwd_head)]
    settings = list(dict.fromkeys((r["causal"], r["dtype"]) for r in rows))
    for causal, dtype in settings:
        here = [r for r in rows if (r["causal"], r["dtype"]) == (causal, dtype)]
        ours = _tflops(here, mode="fwd", impl="tilelang varlen")
        fa3 = _tflops(here, mode="fwd", impl="fa3 varlen")
        cells = [str(causal), dtype, f"{ours:.0f}", f"{fa3:.0f}", f"{ours / fa3:.2f}"]
        for S in dense_seqlens:
            dense = _tflops(here, mode="fwd-equal", S=S, impl="tilelang dense")
            equal = _tflops(here, mode="fwd-equal", S=S, impl="tilelang varlen equal")
            cells += [f"{dense:.0f}", f"{equal:.0f}", f"{ours / dense:.2f}"]
        lines.append("| " + " | ".join(cells).replace("nan", "—") + " |")

    peers = list(dict.fromkeys(r["impl"] for r in rows if r["mode"] == "bwd" and not r["ours"]))
    bwd_head = ["causal", "dtype", "tilelang varlen ms", "TFLOP/s"]
    bwd_head += [f"{p} ms" for p in peers] + [f"{p} ÷ ours (time)" for p in peers]
    for S in dense_seqlens:
        bwd_head += [f"dense S{S}", f"varlen equal S{S}", f"varlen ÷ dense S{S}"]
    lines += ["", "| " + " | ".join(bwd_head) + " |", "|" + "---|" * len(bwd_head)]
    for causal, dtype in settings:
        here = [r for r in rows if (r["causal"], r["dtype"], r["mode"]) == (causal, dtype, "bwd")]
        ms = {r["impl"]: r["ms"] for r in here}
        ours = ms.get("tilelang varlen", math.nan)
        cells = [str(causal), dtype, f"{ours:.3f}", f"{_tflops(here, impl='tilelang varlen'):.0f}"]
        cells += [f"{ms.get(p, math.nan):.3f}" for p in peers]
        cells += [f"{ms.get(p, math.nan) / ours:.2f}" for p in peers]
        equal = [
            r for r in rows if (r["causal"], r["dtype"], r["mode"]) == (causal, dtype, "bwd-equal")
        ]
        ours_tflops = _tflops(here, impl="tilelang varlen")
        for S in dense_seqlens:
            dense = _tflops(equal, S=S, impl="tilelang dense")
            varlen_equal = _tflops(equal, S=S, impl="tilelang varlen equal")
            cells += [f"{dense:.0f}", f"{varlen_equal:.0f}", f"{ours_tflops / dense:.2f}"]
        lines.append("| " + " | ".join(cells).replace("nan", "—") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=harness.DTYPES)
    p.add_argument(
        "--dense-seqlens",
        type=seqlen_arg,
        nargs="+",
        default=[2048, "matched", 4096],
        help="S of the equal-length dense batches (B = 16384 // S); 'matched': the S of equal "
        "attention work per token (ΣL² / ΣL of the random batch)",
    )
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    args = p.parse_args(argv)
    lengths = random_lengths()
    dense_seqlens = [matched_seqlen(lengths) if S == "matched" else S for S in args.dense_seqlens]
    harness.require_gpu("benchmarks/bench_varlen.py")
    fwd = load("examples/flash_attention/example_mha_fwd_varlen.py")
    dense = load("examples/flash_attention/example_mha_fwd_bshd.py")
    bwd = load("examples/flash_attention/example_gqa_bwd_tma_reduce_varlen.py")
    dense_bwd = bwd.fast_bwd  # example_mha_bwd_wgmma_pipelined.py, as the varlen script loaded it
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, lengths {lengths}")
    command = harness.command_line("benchmarks/bench_varlen.py", argv)
    start = harness.utc_now()

    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()

    def save(rows):  # after every setting: a run cut short keeps the rows it finished
        record = {"device": device, **harness.run_stamp(command, start), "lengths": lengths}
        return harness.write_record(args.out / "varlen.json", {**record, "rows": rows})

    rows = []
    for dtype in args.dtypes:
        for causal in (False, True):
            if "fwd" in args.modes:
                rows += forward_rows(fwd, dense, lengths, causal, dtype, dense_seqlens)
            if "bwd" in args.modes:
                rows += backward_rows(bwd, dense_bwd, lengths, causal, dtype, dense_seqlens)
            save(rows)

    record = save(rows)
    date = record["date"]
    table = (
        f"Varlen attention, TFLOP/s of useful work ({device}, {date}; {len(lengths)} sequences "
        f"of random length 1..{MAX_LEN}, {TOKENS} tokens, H{HEADS} D{DIM})\n\n"
        f"{harness.run_line(record)} The first table is the forward, the second the backward "
        "alone.\n\n" + markdown(rows, dense_seqlens)
    )
    (args.out / "varlen.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
