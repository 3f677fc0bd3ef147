"""Attention sinks and sliding windows against FlexAttention and our dense kernel, in one process.

bf16, causal, one random sink logit per query head (``randn · 2``, as the sink scripts' main).
Each row is timed forward alone and backward alone (``torch.autograd.grad`` on a graph built
once and kept, ``retain_graph=True``, as ``harness.sdpa_backward_peers`` does):

- windowed rows (``WINDOWED``), four implementations:
  - "tilelang": the sink scripts' ``attention`` (example_gqa_sink_fwd_bhsd.py forward alone,
    example_gqa_sink_bwd_bhsd.py for the graph whose backward is timed: dq, dk, dv, dsinks);
  - "tilelang compiled": the same inside ``torch.compile`` (``fullgraph``, ``dynamic=False``),
    as FlexAttention runs: the same custom operators, without eager autograd's work on the
    host around each call, which is what bounds a narrow window's short rows;
  - "flex_attention": the forward script's ``flex_peer`` (the window as a block mask, the sink
    by rescaling Flex's output with its lse: ``out · sigmoid(lse − sink)``), compiled whole —
    flex_attention and the rescale in one graph (``fullgraph``, ``dynamic=False``). Its
    backward is autograd through the output *and* the lse: the lse carries the sink's share of
    every row, so dq and dk need its gradient (PyTorch's compiled Flex backward takes one and
    folds it into its ``delta``). Dropping it would leave dq and dk about 5% off at these
    windows, which the check below catches; tests/test_bench_sink.py checks the gradients on
    the CPU;
  - "tilelang graphed" and "flex_attention graphed" (windowed rows): "tilelang" and
    "flex_attention" captured in CUDA graphs (``torch.cuda.graph``) and timed as graph
    replays, the same kernels with no host work between them, as a training step under CUDA
    graphs runs them. At window 128 an eager call's host work (PyTorch's custom-operator and
    autograd layers, the launches) takes longer than its kernels; these rows compare the GPU
    work. A backward alone cannot be captured (its autograd graph was built outside the
    capture, on another stream), so the forward alone and forward + backward (the graph built
    inside the call) are captured, and the backward's time is their difference;
  - "tilelang dense causal": our dense GQA kernels on BSHD copies made outside the timing,
    doing the whole causal triangle (forward: example_gqa_fwd_bshd.py, what the forward
    script's ``dense_peer`` runs for GQA; backward: example_gqa_bwd.py, its default strategy);
- sink-cost rows (``SINK_COST``, no window): "tilelang" with and without sinks (the same
  scripts; "tilelang no sinks" passes ``sinks=None``), beside the dense kernel.

TFLOP/s count the attended (query, key) pairs only (``window_flops``; ×2.5 for the backward)
for every implementation of a row, the dense kernel included, so they compare as times.
Before a row is timed, ours is checked against the peer that computes the same function —
FlexAttention with window and sinks, or, without them, the dense kernel — output 1e-2,
gradients 2e-2 (relative).

Every TileLang kernel is built first, in parallel threads (``bench_attention.prebuild``), by
running each implementation once; ``--build-only`` then also compiles FlexAttention (the
checks run every implementation once) and times nothing, so a later run finds every cache
(TileLang's, Inductor's) warm. ``--out DIR`` writes ``DIR/sink.json`` (device, date, rows:
mode, shape, window, sinks, impl, ms, tflops, ratio = this ms ÷ "tilelang" ms, the speed of
ours over this implementation) and ``DIR/sink.md`` (the tables).

    python benchmarks/bench_sink.py --build-only
    python benchmarks/bench_sink.py --out benchmarks/results
"""

import argparse
import datetime
import json
import pathlib
import sys
from types import SimpleNamespace

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import load, prebuild  # noqa: E402  (scripts imported by path)

import harness  # noqa: E402

# (B, H, Hkv, S, D, window)
WINDOWED = [
    (1, 64, 8, 4096, 64, (128, 0)),
    (1, 64, 8, 8192, 64, (128, 0)),
    (2, 32, 8, 8192, 128, (1024, 0)),
]
SINK_COST = [(4, 32, 8, 4096, 128, (-1, -1)), (1, 64, 8, 8192, 64, (-1, -1))]
ROWS = WINDOWED + SINK_COST
OURS, NO_SINKS, COMPILED = "tilelang", "tilelang no sinks", "tilelang compiled"
FLEX, DENSE = "flex_attention", "tilelang dense causal"
OURS_GRAPH, FLEX_GRAPH = "tilelang graphed", "flex_attention graphed"
GRADS = ("dq", "dk", "dv", "dsinks")


def scripts():
    # The forward script first: the backward script imports it by name and gets this module.
    return SimpleNamespace(
        fwd=load("examples/attention_sink/example_gqa_sink_fwd_bhsd.py"),
        bwd=load("examples/attention_sink/example_gqa_sink_bwd_bhsd.py"),
        dense=load("examples/flash_attention/example_gqa_bwd.py"),
    )


def inputs(B, H, Hkv, S, D):
    """q, k, v (BHSD), sinks and the upstream gradient dout: seeded, the same for every impl."""
    g = torch.Generator(device="cuda").manual_seed(0)  # one of its own: prebuild uses threads

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dtype)

    q, k, v = randn(B, H, S, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D)
    sinks = randn(H, dtype=torch.float32) * 2
    return SimpleNamespace(q=q, k=k, v=v, sinks=sinks, dout=randn(B, H, S, D), scale=D**-0.5)


def leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors if t is not None]


def backward_alone(out, xs, dout):
    return lambda: torch.autograd.grad(out, xs, dout, retain_graph=True)


# Each implementation: (forward alone, backward alone), two callables.
def ours(m, x, window, sinks, compiled=False):
    """Eager, or (``compiled``) inside torch.compile as FlexAttention runs: the same custom
    operators, without eager autograd's per-call work on the host around them."""

    def forward(*qkvs):
        return m.fwd.attention(*qkvs, window, True, x.scale)

    def differentiable(*qkvs):
        return m.bwd.attention(*qkvs, window, True, x.scale)

    if compiled:
        forward, differentiable = (
            torch.compile(f, fullgraph=True, dynamic=False) for f in (forward, differentiable)
        )
    xs = leaves(x.q, x.k, x.v, sinks)
    out = differentiable(*xs[:3], xs[3] if sinks is not None else None)
    return lambda: forward(x.q, x.k, x.v, sinks), backward_alone(out, xs, x.dout)


def flex(m, x, window):
    def compiled(*qkvs):
        run = m.fwd.flex_peer(*qkvs, window, True, x.scale)
        return torch.compile(run, fullgraph=True, dynamic=False)

    xs = leaves(x.q, x.k, x.v, x.sinks)
    return compiled(x.q, x.k, x.v, x.sinks), backward_alone(compiled(*xs)(), xs, x.dout)


def dense(m, x):
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (x.q, x.k, x.v, x.dout))  # BSHD
    xs = leaves(q, k, v)
    out = m.dense.attention(*xs, True, x.scale)
    return (
        lambda: m.dense.fast_fwd.attention(q, k, v, True, x.scale),
        backward_alone(out, xs, dout),
    )


BUILDERS = {
    OURS: lambda m, x, window: ours(m, x, window, x.sinks),
    NO_SINKS: lambda m, x, window: ours(m, x, window, None),
    COMPILED: lambda m, x, window: ours(m, x, window, x.sinks, compiled=True),
    FLEX: flex,
    DENSE: lambda m, x, window: dense(m, x),
}


def graphed(fn):
    """``fn`` captured in a CUDA graph (after three warm-up calls on a side stream, as
    torch.cuda.graph asks): returns the graph's replay, which runs the same kernels on the same
    tensors with no host work between them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def names(window):
    return [OURS, COMPILED, FLEX, DENSE] if window != (-1, -1) else [OURS, NO_SINKS, DENSE]


def warm(m, row, name):
    """Build one implementation of one row and run it once: compiles its kernels."""
    forward, backward = BUILDERS[name](m, inputs(*row[:5]), row[5])
    forward(), backward()
    torch.cuda.synchronize()


def check(impls, what=""):
    """Ours against the peer computing the same function (the dense kernel's BSHD results
    transposed back); runs every implementation once, which also compiles FlexAttention."""
    results = {name: (forward(), backward()) for name, (forward, backward) in impls.items()}
    out, grads = results[DENSE]
    results[DENSE] = (out.transpose(1, 2), [g.transpose(1, 2) for g in grads])
    a, b = (OURS, FLEX) if FLEX in impls else (NO_SINKS, DENSE)
    (out_a, grads_a), (out_b, grads_b) = results[a], results[b]
    print(f"check {what}: {a} against {b}")
    harness.check_close("out", out_a, out_b, rtol=1e-2)
    for name, ga, gb in zip(GRADS, grads_a, grads_b, strict=False):  # no dsinks: three
        harness.check_close(name, ga, gb, rtol=2e-2)


def measure(m, row, build_only=False):
    B, H, Hkv, S, D, window = row
    x = inputs(B, H, Hkv, S, D)
    impls = {name: BUILDERS[name](m, x, window) for name in names(window)}
    what = f"B{B} H{H} Hkv{Hkv} S{S} D{D} window={window} causal bf16"
    check(impls, what)
    if build_only:
        return []
    flops = m.fwd.window_flops(B, H, S, S, D, window, True)
    shape = {"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D, "window": list(window)}
    records = []
    for mode, which, scale in (("fwd", 0, 1.0), ("bwd", 1, 2.5)):
        runs = {name: fns[which] for name, fns in impls.items()}
        ours_runs = {name: runs.pop(name) for name in (OURS, NO_SINKS, COMPILED) if name in runs}
        rows = harness.report(f"{mode} {what}", ours_runs, runs, flops * scale)
        ms = {r["impl"]: r["ms"] for r in rows}
        for r in rows:
            sinks = r["impl"] in (OURS, COMPILED, FLEX)
            ratio = r["ms"] / ms.get(OURS, float("nan"))
            cols = {"sinks": sinks, "impl": r["impl"], "ms": r["ms"], "tflops": r["tflops"]}
            records.append({"mode": mode, **shape, **cols, "ratio": ratio})
    if FLEX in impls:
        records += graph_records(m, x, window, impls, flops, shape, what)
    return records


def training_step(m, x, window, impl):
    """Forward and backward in one call, the autograd graph built inside it (so a CUDA graph
    captured around the call holds both): ours, the sink scripts' ``attention``; Flex, ``flex``'s
    compiled function."""
    xs = leaves(x.q, x.k, x.v, x.sinks)
    if impl == OURS:
        return lambda: torch.autograd.grad(m.bwd.attention(*xs, window, True, x.scale), xs, x.dout)
    run = m.fwd.flex_peer(*xs, window, True, x.scale)
    compiled = torch.compile(run, fullgraph=True, dynamic=False)
    return lambda: torch.autograd.grad(compiled(), xs, x.dout)


def graph_records(m, x, window, impls, flops, shape, what):
    """A windowed row as CUDA graph replays: forward alone, forward + backward, and the
    backward as their difference (records with the same fields as ``measure``'s; ratio: this
    ms ÷ ours graphed ms)."""
    ms = {}
    for mode, pick, scale in (("fwd", 0, 1.0), ("fwd+bwd", 1, 3.5)):
        runs = {}
        for name, graph_name in ((OURS, OURS_GRAPH), (FLEX, FLEX_GRAPH)):
            fn = impls[name][0] if pick == 0 else training_step(m, x, window, name)
            runs[graph_name] = graphed(fn)
        ours_runs = {OURS_GRAPH: runs.pop(OURS_GRAPH)}
        for r in harness.report(f"{mode} graphed {what}", ours_runs, runs, flops * scale):
            ms[mode, r["impl"]] = r["ms"]
    for impl in (OURS_GRAPH, FLEX_GRAPH):
        if ("fwd", impl) in ms and ("fwd+bwd", impl) in ms:
            ms["bwd", impl] = ms["fwd+bwd", impl] - ms["fwd", impl]
    records = []
    for mode, scale in (("fwd", 1.0), ("bwd", 2.5), ("fwd+bwd", 3.5)):
        for impl in (OURS_GRAPH, FLEX_GRAPH):
            if (mode, impl) in ms:
                t = ms[mode, impl]
                cols = {"sinks": True, "impl": impl, "ms": t, "tflops": flops * scale / t * 1e-9}
                ratio = t / ms.get((mode, OURS_GRAPH), float("nan"))
                records.append({"mode": mode, **shape, **cols, "ratio": ratio})
    return records


def markdown(records, device, date):
    """Two tables: windowed rows (ours ÷ Flex, ours ÷ dense causal: speed ratios) and the sink
    cost (time with sinks ÷ time without)."""
    cells = {}
    for r in records:
        key = (r["mode"], f"B{r['B']} H{r['H']} Hkv{r['Hkv']} S{r['S']} D{r['D']}")
        cells.setdefault((*key, tuple(r["window"])), {})[r["impl"]] = r

    def timing(row, impl):
        r = row.get(impl)
        return f"{r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s" if r else "—"

    def speedup(row, impl):  # ours over impl
        return f"{row[impl]['ratio']:.2f}" if impl in row and OURS in row else "—"

    lines = [
        f"# Attention sinks and sliding windows — {device}, {date}",
        "",
        f"benchmarks/bench_sink.py, one process, torch {torch.__version__}; bf16, causal, sinks "
        "on unless stated. TFLOP/s count the attended (query, key) pairs only (`window_flops`, "
        "×2.5 for the backward), for the dense kernel too (it does the whole causal triangle). "
        "“ours ÷ X” is X's time ÷ ours (> 1: ours is faster).",
        "",
        "| mode | shape | window | ours | ours compiled | FlexAttention | dense causal "
        "| ours ÷ Flex | ours compiled ÷ Flex | ours ÷ dense causal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, shape, window), row in cells.items():
        if window != (-1, -1) and mode != "fwd+bwd":
            both = FLEX in row and COMPILED in row
            compiled = f"{row[FLEX]['ms'] / row[COMPILED]['ms']:.2f}" if both else "—"
            lines.append(
                f"| {mode} | {shape} | {window} | {timing(row, OURS)} | {timing(row, COMPILED)} "
                f"| {timing(row, FLEX)} | {timing(row, DENSE)} | {speedup(row, FLEX)} "
                f"| {compiled} | {speedup(row, DENSE)} |"
            )
    lines += [
        "",
        "The windowed rows as CUDA graph replays (the same kernels, no host work between "
        "them); bwd: forward + backward minus forward.",
        "",
        "| mode | shape | window | ours graphed | FlexAttention graphed | ours ÷ Flex, graphed |",
        "|---|---|---|---|---|---|",
    ]
    for (mode, shape, window), row in cells.items():
        if window != (-1, -1):
            both = OURS_GRAPH in row and FLEX_GRAPH in row
            graph_ratio = f"{row[FLEX_GRAPH]['ms'] / row[OURS_GRAPH]['ms']:.2f}" if both else "—"
            lines.append(
                f"| {mode} | {shape} | {window} | {timing(row, OURS_GRAPH)} "
                f"| {timing(row, FLEX_GRAPH)} | {graph_ratio} |"
            )
    lines += [
        "",
        "Sink cost: the same kernels with and without sinks, no window.",
        "",
        "| mode | shape | with sinks | without sinks | time with ÷ without | dense causal "
        "| ours ÷ dense causal |",
        "|---|---|---|---|---|---|---|",
    ]
    for (mode, shape, window), row in cells.items():
        if window == (-1, -1):
            both = OURS in row and NO_SINKS in row
            cost = f"{row[OURS]['ms'] / row[NO_SINKS]['ms']:.2f}" if both else "—"
            lines.append(
                f"| {mode} | {shape} | {timing(row, OURS)} | {timing(row, NO_SINKS)} | {cost} | "
                f"{timing(row, DENSE)} | {speedup(row, DENSE)} |"
            )
    return "\n".join(lines) + "\n"


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, help="write OUT/sink.json and OUT/sink.md")
    p.add_argument(
        "--build-only", action="store_true", help="compile and check every kernel, time nothing"
    )
    p.add_argument("--rows", type=int, nargs="+", help="only these rows (indices into ROWS)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    harness.require_gpu("benchmarks/bench_sink.py", capability=(9, 0))
    m = scripts()
    rows = [ROWS[i] for i in args.rows] if args.rows else ROWS
    # FlexAttention and our compiled rows compile later, in the checks: torch.compile stays in
    # the main thread.
    tasks = [(row, name) for row in rows for name in names(row[5]) if name not in (FLEX, COMPILED)]
    prebuild(lambda row, name: warm(m, row, name), tasks)
    records = [rec for row in rows for rec in measure(m, row, args.build_only)]
    if args.build_only:
        return
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    table = markdown(records, device, date)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "sink.json", "w") as f:
            json.dump({"device": device, "date": date, "rows": records}, f, indent=1)
        (args.out / "sink.md").write_text(table)


if __name__ == "__main__":
    main()
