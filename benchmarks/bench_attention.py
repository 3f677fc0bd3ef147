"""Sweep our attention kernels against their peers in one process, on one GPU.

Shapes: S in {1024, ..., 16384} at 16k tokens per batch (B = 16384 / S), H = 32 for D = 128 and
H = 64 for D = 64, causal and not, fp16 and bf16. Peers on the same inputs: SDPA FLASH (FA2),
SDPA cuDNN and, for bf16 forward, FlashAttention-3. Forward: example_mha_fwd_bshd.py; backward
(the backward pass alone, 2.5× the forward FLOPs): example_mha_bwd_bshd.py. Each of our rows is
checked against cuDNN's output (or gradients) before it is timed, so a fast wrong kernel cannot
make the table.

Writes ``<out>/<mode>.json`` (one record per implementation and shape), ``<out>/<mode>.md`` (the
table the README shows) and ``<out>/<mode>.png`` (TFLOP/s against S, one line per
implementation), for mode fwd and bwd.

    python benchmarks/bench_attention.py --out benchmarks/results --modes fwd bwd
"""

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import harness  # noqa: E402

SEQLENS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384


def load(relpath):
    spec = importlib.util.spec_from_file_location(pathlib.Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(dims, dtypes, seqlens):
    """(B, H, S, D, causal, dtype name) for every row of the sweep."""
    return [
        (TOKENS // S, 32 if D == 128 else 64, S, D, causal, dtype)
        for D in dims
        for dtype in dtypes
        for causal in (False, True)
        for S in seqlens
    ]


def prebuild(build, shapes):
    """Compile every kernel of the sweep up front, in parallel (nvcc runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda shape: build(*shape), shapes))


def build_forward(mha, B, H, S, D, causal, dtype):
    cfg = mha.default_config(D, causal, mha.device_arch("cuda"), S)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count  # as attention() passes
    mha.flashattn_fwd(B, H, S, S, D, causal, D**-0.5, dtype, **cfg, num_sms=num_sms)


def build_backward(bwd, B, H, S, D, causal, dtype):
    arch = bwd.device_arch("cuda")
    bwd.flashattn_fwd(B, H, S, S, D, causal, D**-0.5, dtype, **bwd.forward_config(D, arch))
    cfg = bwd.default_config(D, causal, arch)
    bwd.flashattn_bwd(B, H, S, S, D, causal, D**-0.5, dtype, **cfg)


def forward_rows(dims, dtypes, seqlens):
    mha = load("examples/flash_attention/example_mha_fwd_bshd.py")
    shapes = sweep(dims, dtypes, seqlens)
    prebuild(lambda *shape: build_forward(mha, *shape), shapes)
    return [row for shape in shapes for row in forward_shape(mha, *shape)]


def forward_shape(mha, B, H, S, D, causal, dtype_name):
    torch.manual_seed(0)
    dtype = harness.DTYPES[dtype_name]
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(3))
    scale = D**-0.5
    peers = harness.sdpa_peers(q, k, v, causal, scale)
    out = mha.attention(q, k, v, causal=causal, softmax_scale=scale)
    rel = harness.check_close("out", out, peers["sdpa_cudnn"](), rtol=1e-2)
    ours = {"tilelang": lambda: mha.attention(q, k, v, causal, scale)}
    flops = harness.attention_flops(B, H, S, S, D, D, causal)
    title = f"fwd B{B} H{H} S{S} D{D} causal={causal} {dtype_name}"
    shape = {"mode": "fwd", "B": B, "H": H, "S": S, "D": D, "causal": causal, "dtype": dtype_name}
    return [
        {**r, **shape, "rel_err_vs_cudnn": rel if r["ours"] else None}
        for r in harness.report(title, ours, peers, flops)
    ]


def backward_rows(dims, dtypes, seqlens):
    bwd = load("examples/flash_attention/example_mha_bwd_bshd.py")
    shapes = sweep(dims, dtypes, seqlens)
    prebuild(lambda *shape: build_backward(bwd, *shape), shapes)
    return [row for shape in shapes for row in backward_shape(bwd, *shape)]


def backward_shape(bwd, B, H, S, D, causal, dtype_name):
    torch.manual_seed(0)
    dtype = harness.DTYPES[dtype_name]
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(4))
    scale = D**-0.5
    out, lse = bwd.attention_forward(q, k, v, causal, scale)
    _, peers = harness.sdpa_backward_peers(q, k, v, dout, causal, scale)
    grads = bwd.attention_backward(dout, q, k, v, out, lse, causal, scale)
    ref = peers["sdpa_cudnn"]()
    rels = [harness.check_close(n, g, r, 2e-2) for n, g, r in zip("qkv", grads, ref, strict=True)]
    ours = {"tilelang": lambda: bwd.attention_backward(dout, q, k, v, out, lse, causal, scale)}
    flops = harness.attention_flops(B, H, S, S, D, D, causal, backward=True)
    title = f"bwd B{B} H{H} S{S} D{D} causal={causal} {dtype_name}"
    shape = {"mode": "bwd", "B": B, "H": H, "S": S, "D": D, "causal": causal, "dtype": dtype_name}
    return [
        {**r, **shape, "rel_err_vs_cudnn": max(rels) if r["ours"] else None}
        for r in harness.report(title, ours, peers, flops)
    ]


def markdown(rows, mode):
    """One line per (D, causal, dtype, S): TFLOP/s of each implementation, ours ÷ cuDNN and ÷
    the best peer."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    head = "| D | causal | dtype | S | B×H | " + " | ".join(impls)
    head += " | ours ÷ cuDNN | ours ÷ best peer |"
    lines = [head, "|" + "---|" * (len(impls) + 7)]
    keys = list(dict.fromkeys((r["D"], r["causal"], r["dtype"], r["S"]) for r in rows))
    for D, causal, dtype, S in keys:
        group = [
            r for r in rows if (r["D"], r["causal"], r["dtype"], r["S"]) == (D, causal, dtype, S)
        ]
        tf = {r["impl"]: r["tflops"] for r in group}
        ours = next(r for r in group if r["ours"])
        peer_best = max(r["tflops"] for r in group if not r["ours"])
        cells = [f"{tf[i]:.0f}" if i in tf else "—" for i in impls]
        ratio_cudnn = ours["tflops"] / tf["sdpa_cudnn"] if "sdpa_cudnn" in tf else float("nan")
        lines.append(
            f"| {D} | {causal} | {dtype} | {S} | {ours['B']}×{ours['H']} | "
            + " | ".join(cells)
            + f" | {ratio_cudnn:.2f} | {ours['tflops'] / peer_best:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path, mode):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["D"], r["dtype"], r["causal"]) for r in rows))
    cols = 4
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (D, dtype, causal) in zip(axes.flat, panels, strict=False):
        sel = [r for r in rows if (r["D"], r["dtype"], r["causal"]) == (D, dtype, causal)]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = sorted((r["S"], r["tflops"]) for r in sel if r["impl"] == impl)
            style = "-o" if impl == "tilelang" else "--."
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode} D{D} {dtype} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("sequence length (16k tokens per batch)", fontsize=8)
        ax.set_ylabel("TFLOP/s", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{torch.cuda.get_device_name()} — {datetime.date.today()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=harness.DTYPES)
    p.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    args = p.parse_args(argv)
    harness.require_gpu("benchmarks/bench_attention.py")
    args.out.mkdir(parents=True, exist_ok=True)
    device, date = torch.cuda.get_device_name(), str(datetime.date.today())
    runners = {"fwd": (forward_rows, "Forward"), "bwd": (backward_rows, "Backward alone")}
    for mode in args.modes:
        run, title = runners[mode]
        rows = run(args.dims, args.dtypes, args.seqlens)
        with open(args.out / f"{mode}.json", "w") as f:
            json.dump({"device": device, "date": date, "rows": rows}, f, indent=1)
        table = f"{title}, TFLOP/s ({device}, {date})\n\n" + markdown(rows, mode)
        (args.out / f"{mode}.md").write_text(table)
        plot(rows, args.out / f"{mode}.png", title.lower())
        print(table)


if __name__ == "__main__":
    main()
