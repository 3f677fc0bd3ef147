"""Sweep our attention kernels against their peers in one process, on one GPU.

Shapes: S in {1024, ..., 16384} at 16k tokens per batch (B = 16384 / S), H = 32 for D = 128 and
H = 64 for D = 64, causal and not, fp16 and bf16. Peers on the same inputs: SDPA FLASH (FA2),
SDPA cuDNN and, for bf16 forward, FlashAttention-3. Forward: example_mha_fwd_bshd.py. Backward:
the hand-scheduled example_mha_bwd_wgmma_pipelined.py ("tilelang") beside the plain
example_mha_bwd_bshd.py ("tilelang plain"), timed twice: the backward pass alone (2.5× the
forward FLOPs, mode "bwd") and a training step, forward + backward (3.5×, mode "fwd+bwd"; each
of ours runs its own script's forward). GQA backward (mode "bwd_gqa", and "fwd+bwd_gqa"): 8 kv
heads (H32/Hkv8 at D = 128, H64/Hkv8 at D = 64), example_gqa_bwd.py's default strategy
("tilelang", the hand-scheduled ``group``) beside its ``atomic`` one, SDPA with ``enable_gqa``.
Each of our rows is checked against cuDNN's output (or gradients) before it is timed, so a fast
wrong kernel cannot make the table.

Writes ``<out>/<mode>.json`` (one record per implementation and shape; bwd.json holds the
"fwd+bwd" rows too, bwd_gqa.json the "fwd+bwd_gqa" ones; written again after every shape, so a
run cut short keeps the rows it finished), ``<out>/<mode>.md`` (the tables the README shows)
and ``<out>/<mode>.png`` (TFLOP/s against S, one line per implementation; fwd_bwd.png for the
training step).
``--render`` rebuilds the tables and plots from saved JSON files (several partial runs merge).
Each JSON records the command and the UTC time of its run, and the tables say them.

    python benchmarks/bench_attention.py --out benchmarks/results --modes fwd bwd bwd_gqa
    python benchmarks/bench_attention.py --render bwd_d128_*.json bwd_d64_*.json --out results
"""

import argparse
import importlib.util
import json
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import harness  # noqa: E402

SEQLENS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HEADS_KV = 8  # the GQA sweep's kv heads


def load(relpath):
    """Import a script by path, registered in sys.modules under its name: compiled code
    (dynamo) looks a custom operator's module up there when it traces the call. A script a
    sibling already imported is that module, so each operator runs one module's code."""
    name = pathlib.Path(relpath).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
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

    with ThreadPoolExecutor(min(16, os.cpu_count() or 8)) as pool:
        list(pool.map(lambda shape: build(*shape), shapes))


def build_forward(mha, B, H, S, D, causal, dtype):
    cfg = mha.default_config(D, causal, mha.device_arch("cuda"), S)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count  # as attention() passes
    mha.flashattn_fwd(B, H, S, S, D, causal, D**-0.5, dtype, **cfg, num_sms=num_sms)


def build_backward(fast, plain, B, H, S, D, causal, dtype):
    arch = plain.device_arch("cuda")
    plain.flashattn_fwd(B, H, S, S, D, causal, D**-0.5, dtype, **plain.forward_config(D, arch))
    plain.flashattn_bwd(B, H, S, S, D, causal, D**-0.5, dtype, **plain.default_config(arch))
    build_forward(fast.fwd, B, H, S, D, causal, dtype)
    kernels = fast.backward_kernels(S, S, D, causal, D**-0.5, dtype, fast.default_config(D, arch))
    for fn, args, kw in kernels.values():
        fn(B, H, *args, **kw)


def build_gqa_backward(gqa, B, H, S, D, causal, dtype):
    arch, scale, Hkv = gqa.device_arch("cuda"), D**-0.5, HEADS_KV
    fwd_cfg = gqa.fast_fwd.default_config(D, causal, arch, S)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gqa.fast_fwd.flashattn_fwd(B, H, Hkv, S, S, D, causal, scale, dtype, **fwd_cfg, num_sms=num_sms)
    cfg = gqa.default_config(D, D, arch, "group")
    kernels = gqa.fast_bwd.backward_kernels(S, S, D, causal, scale, dtype, cfg, H // Hkv)
    for fn, args, kw in kernels.values():
        fn(B, H, *args, **kw)
    cfg = gqa.default_config(D, D, arch, "atomic")
    gqa.flashattn_bwd_preprocess(B, H, S, D, dtype)
    gqa.flashattn_bwd(B, H, Hkv, S, S, D, D, causal, scale, dtype, "atomic", **cfg)
    gqa.flashattn_bwd_postprocess(B, H, S, D, dtype)
    gqa.flashattn_bwd_postprocess_kv(B, Hkv, S, D, 1, dtype)


def timed_rows(shapes, time_shape, save):
    """The rows of ``time_shape`` for each shape in turn, handing the rows so far to ``save``
    after each one (``harness.write_record``)."""
    rows = []
    for shape in shapes:
        rows += time_shape(*shape)
        save(rows)
    return rows


def forward_rows(dims, dtypes, seqlens, build_only=False, save=lambda rows: None):
    mha = load("examples/flash_attention/example_mha_fwd_bshd.py")
    shapes = sweep(dims, dtypes, seqlens)
    prebuild(lambda *shape: build_forward(mha, *shape), shapes)
    if build_only:
        return []
    return timed_rows(shapes, lambda *shape: forward_shape(mha, *shape), save)


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


def backward_rows(dims, dtypes, seqlens, build_only=False, save=lambda rows: None):
    fast = load("examples/flash_attention/example_mha_bwd_wgmma_pipelined.py")
    plain = load("examples/flash_attention/example_mha_bwd_bshd.py")
    shapes = sweep(dims, dtypes, seqlens)
    prebuild(lambda *shape: build_backward(fast, plain, *shape), shapes)
    if build_only:
        return []
    impls = {"tilelang": fast, "tilelang plain": plain}
    return timed_rows(shapes, lambda *shape: backward_shape(impls, None, *shape), save)


def gqa_backward_rows(dims, dtypes, seqlens, build_only=False, save=lambda rows: None):
    gqa = load("examples/flash_attention/example_gqa_bwd.py")
    shapes = sweep(dims, dtypes, seqlens)
    prebuild(lambda *shape: build_gqa_backward(gqa, *shape), shapes)
    if build_only:
        return []

    class Strategy:  # example_gqa_bwd.py with one strategy, in the MHA scripts' interface
        def __init__(self, name):
            self.attention_forward = gqa.attention_forward
            self.attention_backward = lambda *a: gqa.attention_backward(*a, strategy=name)
            self.attention = lambda q, k, v, c, s: gqa.attention(q, k, v, c, s, name)

    impls = {"tilelang": Strategy("group"), "tilelang atomic": Strategy("atomic")}
    return timed_rows(shapes, lambda *shape: backward_shape(impls, HEADS_KV, *shape), save)


def backward_shape(impls, heads_kv, B, H, S, D, causal, dtype_name):
    """Backward alone and forward + backward of each of ``impls`` (name → module with
    attention_forward, attention_backward, attention) beside the peers; ``heads_kv`` None is
    MHA, else the rows' modes get the suffix "_gqa"."""
    torch.manual_seed(0)
    dtype = harness.DTYPES[dtype_name]
    Hkv = heads_kv or H
    q, dout = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    scale = D**-0.5
    peers_fwd_bwd, peers = harness.sdpa_backward_peers(q, k, v, dout, causal, scale)
    ref = peers["sdpa_cudnn"]()
    saved = {name: m.attention_forward(q, k, v, causal, scale) for name, m in impls.items()}
    ours = {
        name: lambda m=m, f=saved[name]: m.attention_backward(dout, q, k, v, *f, causal, scale)
        for name, m in impls.items()
    }
    rels = {}
    for name, run in ours.items():
        grads = run()
        rels[name] = max(
            harness.check_close(f"{name} d{n}", g, r, 2e-2)
            for n, g, r in zip("qkv", grads, ref, strict=True)
        )
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    steps = {
        name: (lambda m=m: torch.autograd.grad(m.attention(*leaves, causal, scale), leaves, dout))
        for name, m in impls.items()
    }
    fwd = harness.attention_flops(B, H, S, S, D, D, causal)
    shape = {"B": B, "H": H, "S": S, "D": D, "causal": causal, "dtype": dtype_name}
    suffix = "" if heads_kv is None else "_gqa"
    if heads_kv is not None:
        shape["Hkv"] = heads_kv
    rows = []
    for mode, runs, peer_runs, flops in (
        ("bwd" + suffix, ours, peers, 2.5 * fwd),
        ("fwd+bwd" + suffix, steps, peers_fwd_bwd, 3.5 * fwd),
    ):
        title = f"{mode} B{B} H{H} Hkv{Hkv} S{S} D{D} causal={causal} {dtype_name}"
        rows += [
            {**r, "mode": mode, **shape, "rel_err_vs_cudnn": rels.get(r["impl"])}
            for r in harness.report(title, runs, peer_runs, flops)
        ]
    return rows


def markdown(rows, mode):
    """One line per (D, causal, dtype, S): TFLOP/s of each implementation, each of ours ÷ cuDNN,
    and the first of ours ("tilelang") ÷ the best peer."""
    rows = [r for r in rows if r["mode"] == mode]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ours_impls = [i for i in impls if any(r["ours"] for r in rows if r["impl"] == i)]
    ratio_heads = [f"{i.replace('tilelang', 'ours')} ÷ cuDNN" for i in ours_impls]
    head = "| D | causal | dtype | S | B×H | " + " | ".join(impls + ratio_heads)
    head += " | ours ÷ best peer |"
    lines = [head, "|" + "---|" * (len(impls) + len(ratio_heads) + 6)]
    keys = list(dict.fromkeys((r["D"], r["causal"], r["dtype"], r["S"]) for r in rows))
    for D, causal, dtype, S in keys:
        group = [
            r for r in rows if (r["D"], r["causal"], r["dtype"], r["S"]) == (D, causal, dtype, S)
        ]
        tf = {r["impl"]: r["tflops"] for r in group}
        first = next(r for r in group if r["ours"])
        peer_best = max(r["tflops"] for r in group if not r["ours"])
        cells = [f"{tf[i]:.0f}" if i in tf else "—" for i in impls]
        cudnn = tf.get("sdpa_cudnn", float("nan"))
        cells += [f"{tf[i] / cudnn:.2f}" if i in tf else "—" for i in ours_impls]
        lines.append(
            f"| {D} | {causal} | {dtype} | {S} | {first['B']}×{first['H']} | "
            + " | ".join(cells)
            + f" | {first['tflops'] / peer_best:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path, mode, title, device, date):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["mode"] == mode]
    panels = list(dict.fromkeys((r["D"], r["dtype"], r["causal"]) for r in rows))
    cols = 4
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (D, dtype, causal) in zip(axes.flat, panels, strict=False):
        sel = [r for r in rows if (r["D"], r["dtype"], r["causal"]) == (D, dtype, causal)]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = sorted((r["S"], r["tflops"]) for r in sel if r["impl"] == impl)
            ours = any(r["ours"] for r in sel if r["impl"] == impl)
            style = "-o" if ours else "--."
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title} D{D} {dtype} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("sequence length (16k tokens per batch)", fontsize=8)
        ax.set_ylabel("TFLOP/s", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{device} — {date}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


TITLES = {
    "fwd": "Forward",
    "bwd": "Backward alone",
    "fwd+bwd": "Forward + backward",
    "bwd_gqa": "GQA backward alone",
    "fwd+bwd_gqa": "GQA forward + backward",
}
FILES = {m: m.replace("+", "_") for m in TITLES}  # fwd+bwd → fwd_bwd.png


def render(rows, out, device, date, runs=()):
    """Tables (``<mode>.md``) and plots for the rows' modes; bwd.md holds both backward tables.
    ``runs``: a line for each run the rows come from (``harness.run_line``), under each title."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    made = "".join(f"{line}\n\n" for line in runs if line)  # a paragraph each
    tables = {}
    for mode in modes:
        title = f"{TITLES[mode]}, TFLOP/s ({device}, {date})\n\n"
        tables[mode] = title + made + markdown(rows, mode)
        plot(rows, out / f"{FILES[mode]}.png", mode, TITLES[mode].lower(), device, date)
    if "fwd" in tables:
        (out / "fwd.md").write_text(tables["fwd"])
    for name, pair in (("bwd", ("bwd", "fwd+bwd")), ("bwd_gqa", ("bwd_gqa", "fwd+bwd_gqa"))):
        backward = [tables[m] for m in pair if m in tables]
        if backward:  # <name>.md holds the backward alone and the training step
            (out / f"{name}.md").write_text("\n".join(backward))
    return "\n".join(tables.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    modes = ["fwd", "bwd", "bwd_gqa"]
    p.add_argument("--modes", nargs="+", default=modes, choices=modes)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=harness.DTYPES)
    p.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    p.add_argument("--tag", default="", help="suffix of the JSON file names (partial runs)")
    p.add_argument("--build-only", action="store_true", help="only compile the sweep's kernels")
    p.add_argument(
        "--render", type=pathlib.Path, nargs="+", help="only rebuild tables and plots from JSON"
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        saved = [json.loads(path.read_text()) for path in args.render]
        rows = [r for s in saved for r in s["rows"]]
        runs = [harness.run_line(s) for s in saved]
        print(render(rows, args.out, saved[0]["device"], saved[0]["date"], runs))
        return
    harness.require_gpu("benchmarks/bench_attention.py")
    device = torch.cuda.get_device_name()
    command = harness.command_line("benchmarks/bench_attention.py", argv)
    runners = {"fwd": forward_rows, "bwd": backward_rows, "bwd_gqa": gqa_backward_rows}
    for mode in args.modes:
        start = harness.utc_now()
        path = args.out / f"{mode}{args.tag}.json"

        def save(rows, start=start, path=path):
            record = {"device": device, **harness.run_stamp(command, start), "rows": rows}
            return harness.write_record(path, record)

        rows = runners[mode](args.dims, args.dtypes, args.seqlens, args.build_only, save)
        if args.build_only:
            continue
        record = save(rows)
        print(render(rows, args.out, device, record["date"], [harness.run_line(record)]))


if __name__ == "__main__":
    main()
