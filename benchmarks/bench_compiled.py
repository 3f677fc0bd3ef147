"""Training step of a torch.compile'd model: our attention operator against SDPA's cuDNN backend.

The model is ``harness.TwoLayerModel``: two layers of QKV projection, attention, output
projection and residual add, H = 16 heads of D = 128 (width 2048), B = 16384 / S sequences of
length S (``--seqlens``, 2048 and 8192 by default), causal and not, bf16 (``--dtypes``). The
same model (same weights, same input) runs with example_mha_bwd_wgmma_pipelined.py's
``attention`` ("tilelang": the persistent forward and the hand-scheduled backward, as the custom
operators ``tl_attn::mha_bwd_wgmma_pipelined_forward`` / ``_backward``) and with
``torch.nn.functional.scaled_dot_product_attention`` pinned to cuDNN by ``sdpa_kernel``
("sdpa_cudnn"), each compiled with ``torch.compile(model, fullgraph=True, dynamic=False)`` and
eagerly. A training step is forward and backward: ``torch.autograd.grad`` of the output (against
a fixed random gradient) with respect to every weight; no optimizer.

Each shape compiles afresh (``torch._dynamo.reset()``), outside the timing; the compiled models
are checked against each other (output under 1e-2, gradients under 2e-2) before they are timed;
implementations take turns (``harness.report``: three rounds, median of
``triton.testing.do_bench`` medians). TFLOP/s count the whole step: per layer the projections
(6·tokens·width·4·width) and attention (3.5× its forward, docs/CONVENTIONS.md, "Benchmarks").

Prints one table (milliseconds per step); ``--out DIR`` also writes it to ``DIR/compiled.md``.

    python benchmarks/bench_compiled.py --out benchmarks/results
"""

import argparse
import copy
import datetime
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import load  # noqa: E402  (scripts imported by path)

import harness  # noqa: E402

TOKENS, HEADS, DIM = 16384, 16, 128
IMPLS = ("tilelang compiled", "sdpa_cudnn compiled", "tilelang eager", "sdpa_cudnn eager")


def cudnn_attention(q, k, v, causal):
    """SDPA on the model's [B, S, H, D] tensors, pinned to cuDNN (torch.compile traces the
    ``sdpa_kernel`` context, so the compiled graph calls cuDNN's kernels too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2)


def training_step(model, x, dout):
    params = list(model.parameters())

    def step():
        out = model(x)
        return (out, *torch.autograd.grad(out, params, dout))

    return step


def step_flops(B, S, causal, layers=2):
    width = HEADS * DIM
    projections = 6.0 * B * S * width * 4 * width
    return layers * (projections + 3.5 * harness.attention_flops(B, HEADS, S, S, DIM, DIM, causal))


def shape_rows(script, S, causal, dtype_name):
    torch._dynamo.reset()  # a fresh compile per shape, far from the recompile limit
    B, dtype = TOKENS // S, harness.DTYPES[dtype_name]
    torch.manual_seed(0)
    ours = harness.TwoLayerModel(script.attention, HEADS, DIM, causal).to("cuda", dtype)
    peer = copy.deepcopy(ours)
    peer.attention = cudnn_attention
    x = torch.randn(B, S, HEADS * DIM, device="cuda", dtype=dtype)
    dout = torch.randn_like(x)

    def compiled(model):
        return torch.compile(model, fullgraph=True, dynamic=False)

    steps = {
        "tilelang compiled": training_step(compiled(ours), x, dout),
        "sdpa_cudnn compiled": training_step(compiled(peer), x, dout),
        "tilelang eager": training_step(ours, x, dout),
        "sdpa_cudnn eager": training_step(peer, x, dout),
    }
    got, want = steps["tilelang compiled"](), steps["sdpa_cudnn compiled"]()  # compiles both
    names = ["out"] + [f"d{name}" for name, _ in ours.named_parameters()]
    for name, a, b, rtol in zip(names, got, want, [1e-2] + [2e-2] * (len(names) - 1), strict=True):
        harness.check_close(name, a, b, rtol)
    title = f"training step B{B} H{HEADS} S{S} D{DIM} causal={causal} {dtype_name}"
    ours_steps = {name: run for name, run in steps.items() if name.startswith("tilelang")}
    peer_steps = {name: run for name, run in steps.items() if name not in ours_steps}
    rows = harness.report(title, ours_steps, peer_steps, step_flops(B, S, causal))
    shape = {"S": S, "B": B, "causal": causal, "dtype": dtype_name}
    return [{**r, **shape} for r in rows]


def markdown(rows, device, date):
    lines = [
        f"Training step (forward + backward) of harness.TwoLayerModel, ms ({device}, {date}; "
        f"H{HEADS} D{DIM}, {TOKENS} tokens, torch {torch.__version__})",
        "",
        "| causal | dtype | S | B | " + " | ".join(IMPLS) + " | compiled: ours ÷ cuDNN |",
        "|" + "---|" * (len(IMPLS) + 5),
    ]
    for key in dict.fromkeys((r["causal"], r["dtype"], r["S"], r["B"]) for r in rows):
        ms = {r["impl"]: r["ms"] for r in rows if (r["causal"], r["dtype"], r["S"], r["B"]) == key}
        cells = [f"{ms[i]:.2f}" if i in ms else "—" for i in IMPLS]
        speed = ms.get("sdpa_cudnn compiled", float("nan")) / ms["tilelang compiled"]
        lines.append(
            "| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + f" | {speed:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, help="also write the table to OUT/compiled.md")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=harness.DTYPES)
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    args = p.parse_args(argv)
    if any(TOKENS % S for S in args.seqlens):
        p.error(f"--seqlens must divide {TOKENS}")
    harness.require_gpu("benchmarks/bench_compiled.py")
    fast = load("examples/flash_attention/example_mha_bwd_wgmma_pipelined.py")
    rows = [
        row
        for dtype in args.dtypes
        for causal in (False, True)
        for S in args.seqlens
        for row in shape_rows(fast, S, causal, dtype)
    ]
    table = markdown(rows, torch.cuda.get_device_name(), str(datetime.date.today()))
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compiled.md").write_text(table)


if __name__ == "__main__":
    main()
