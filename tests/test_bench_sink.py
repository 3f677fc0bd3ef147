"""benchmarks/bench_sink.py on the CPU: its rows and flags, the pre-timing check, the tables from a
fake result list, and the FlexAttention backward it times — autograd through Flex's output and its
lse gives the sink scripts' reference gradients, dsinks included, and the lse's gradient is
needed for that."""

import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, rel_err

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_sink as bench  # noqa: E402


def test_rows_and_flags():
    assert bench.WINDOWED == [
        (1, 64, 8, 4096, 64, (128, 0)),
        (1, 64, 8, 8192, 64, (128, 0)),
        (2, 32, 8, 8192, 128, (1024, 0)),
    ]
    assert bench.SINK_COST == [(4, 32, 8, 4096, 128, (-1, -1)), (1, 64, 8, 8192, 64, (-1, -1))]
    for _, H, Hkv, S, D, window in bench.ROWS:
        assert H % Hkv == 0 and D in (64, 128) and S % 128 == 0
        names = bench.names(window)
        assert names[0] == bench.OURS and bench.DENSE in names
        windowed = window != (-1, -1)  # windowed: beside Flex; else: with and without sinks
        assert (bench.FLEX in names) == windowed and (bench.NO_SINKS in names) != windowed
        assert (bench.COMPILED in names) == windowed
    args = bench.build_parser().parse_args([])
    assert args.out is None and not args.build_only
    args = bench.build_parser().parse_args(["--out", "res", "--build-only"])
    assert str(args.out) == "res" and args.build_only and args.rows is None
    assert bench.build_parser().parse_args(["--rows", "0", "1"]).rows == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_main_without_gpu_says_so():
    with pytest.raises(SystemExit) as exc:
        bench.main(["--build-only"])
    assert "no CUDA GPU" in str(exc.value.code)


def fake_impl(out, grads, bshd=False):
    """(forward, backward) returning fixed tensors; ``bshd``: as the dense kernel, transposed."""
    if bshd:
        out, grads = out.transpose(1, 2), [g.transpose(1, 2) for g in grads]
    return (lambda: out), (lambda: grads)


def test_check_compares_ours_with_the_peer_computing_the_same():
    g = torch.Generator().manual_seed(0)
    out, dq, dk, dv = (torch.randn(2, 4, 32, 16, generator=g) for _ in range(4))
    dsinks = torch.randn(4, generator=g)
    ours = fake_impl(out, [dq, dk, dv, dsinks])
    dense = fake_impl(out, [dq, dk, dv], bshd=True)  # transposed back by check
    bench.check({bench.OURS: ours, bench.FLEX: ours, bench.DENSE: dense})
    bench.check(
        {bench.OURS: ours, bench.NO_SINKS: fake_impl(out, [dq, dk, dv]), bench.DENSE: dense}
    )
    for wrong in ([dq, dk, dv, dsinks + 1], [dq, dk * 1.05, dv, dsinks]):
        with pytest.raises(AssertionError):
            bench.check({bench.OURS: ours, bench.FLEX: fake_impl(out, wrong), bench.DENSE: dense})
    with pytest.raises(AssertionError):  # without sinks, the dense kernel is the reference
        no_sinks = fake_impl(out, [dq * 1.05, dk, dv])
        bench.check({bench.OURS: ours, bench.NO_SINKS: no_sinks, bench.DENSE: dense})


def fake_records():
    """One record per row, mode and implementation, as measure() writes them; ours 1 ms (2 ms
    backward), ours compiled 0.5×, Flex 2.5×, dense 4× slower, no sinks 0.8×, and on windowed
    rows the graph replays (fwd, bwd, fwd+bwd: ours 0.25, 0.5, 0.75 ms, Flex 2× slower); Flex
    missing for the last windowed backward, plain and graphed (a peer that failed: report()
    leaves it out)."""
    records = []
    for B, H, Hkv, S, D, window in bench.ROWS:
        for mode, base in (("fwd", 1.0), ("bwd", 2.0)):
            factors = {bench.OURS: 1.0, bench.COMPILED: 0.5, bench.FLEX: 2.5, bench.NO_SINKS: 0.8}
            factors[bench.DENSE] = 4.0
            for impl in bench.names(window):
                if impl in (bench.FLEX, bench.FLEX_GRAPH) and (mode, S, D) == ("bwd", 8192, 128):
                    continue
                ms = base * factors[impl]
                records.append(
                    {"mode": mode, "B": B, "H": H, "Hkv": Hkv, "S": S, "D": D,
                     "window": list(window), "sinks": impl != bench.NO_SINKS,
                     "impl": impl, "ms": ms, "tflops": 100 / ms, "ratio": factors[impl]}
                )  # fmt: skip
        if window == (-1, -1):
            continue
        for mode, base in (("fwd", 0.25), ("bwd", 0.5), ("fwd+bwd", 0.75)):
            for impl, factor in ((bench.OURS_GRAPH, 1.0), (bench.FLEX_GRAPH, 2.0)):
                if impl == bench.FLEX_GRAPH and (mode, S, D) == ("bwd", 8192, 128):
                    continue
                records.append(
                    {"mode": mode, "B": B, "H": H, "Hkv": Hkv, "S": S, "D": D,
                     "window": list(window), "sinks": True, "impl": impl, "ms": base * factor,
                     "tflops": 100 / (base * factor), "ratio": factor}
                )  # fmt: skip
    return records


def test_markdown_tables():
    text = bench.markdown(fake_records(), "NVIDIA H100 80GB HBM3", "2026-11-23 04:00 UTC")
    lines = text.splitlines()
    assert (
        lines[0]
        == "# Attention sinks and sliding windows — NVIDIA H100 80GB HBM3, 2026-11-23 04:00 UTC"
    )
    rows = [line for line in lines if line.startswith("| fwd") or line.startswith("| bwd")]
    windowed, graphs, cost = rows[:6], rows[6:15], rows[15:]
    assert len(windowed) == 6 and len(graphs) == 9 and len(cost) == 4
    first = windowed[0].split(" | ")
    assert first[:3] == ["| fwd", "B1 H64 Hkv8 S4096 D64", "(128, 0)"]
    assert first[3] == "1.000 ms, 100 TFLOP/s" and first[4] == "0.500 ms, 200 TFLOP/s"
    assert first[5] == "2.500 ms, 40 TFLOP/s"
    assert first[-3:] == ["2.50", "5.00", "4.00 |"]  # ours, ours compiled ÷ Flex; ours ÷ dense
    last = windowed[-1].split(" | ")  # Flex missing: dashes, not an error
    assert last[0] == "| bwd" and last[5] == "—" and last[-3:] == ["—", "—", "4.00 |"]
    graph = graphs[0].split(" | ")  # ours graphed, Flex graphed, Flex ÷ ours
    assert graph[3:] == ["0.250 ms, 400 TFLOP/s", "0.500 ms, 200 TFLOP/s", "2.00 |"]
    modes = [line.split(" | ")[0] for line in graphs]
    assert modes == ["| fwd", "| bwd", "| fwd+bwd"] * 3
    assert graphs[-2].split(" | ")[-1] == "— |"  # the missing Flex backward, graphed
    bwd_cost = cost[1].split(" | ")
    assert bwd_cost[:2] == ["| bwd", "B4 H32 Hkv8 S4096 D128"]
    assert bwd_cost[4] == "1.25" and bwd_cost[-1] == "4.00 |"  # with ÷ without; ours ÷ dense


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backward_goes_through_its_lse(monkeypatch):
    """bench.flex as the benchmark builds it, on the CPU: Flex refuses gradients there
    (``_validate_device``) but its reference autograd runs anyway, and torch.compile runs with
    the ``aot_eager`` backend (the joint forward/backward graph Inductor compiles on a GPU,
    executed eagerly). Its output and dq, dk, dv, dsinks match the sink scripts' reference;
    with the lse detached, dq and dk miss it by far more than the benchmark's 2e-2."""
    import torch.nn.attention.flex_attention as fa

    m = bench.scripts()
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    compile_ = torch.compile
    aot_eager = {"backend": "aot_eager"}  # flex_attention's own (eager) calls name a backend
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**aot_eager, **kw}))
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D, window = 1, 4, 2, 256, 64, (64, 0)
    q, dout = (torch.randn(B, H, S, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g) * 2
    x = SimpleNamespace(q=q, k=k, v=v, sinks=sinks, dout=dout, scale=D**-0.5)
    forward, backward = bench.flex(m, x, window)

    ref_inputs = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref = m.bwd.ref_program(*ref_inputs, window, True, x.scale)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
    assert rel_err(forward(), ref) < 1e-5
    grads = backward()
    for name, got, want in zip(bench.GRADS, grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-5, name

    # The same rescale with the lse detached: dsinks unchanged, dq and dk wrong.
    xs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    visible = m.fwd.window_mask(S, S, window, True)
    mask = fa.create_block_mask(lambda b, h, i, j: visible[i, j], None, None, S, S, device="cpu")
    out, aux = fa.flex_attention(
        *xs[:3], block_mask=mask, scale=x.scale, enable_gqa=True, return_aux=fa.AuxRequest(lse=True)
    )
    keep = torch.sigmoid(aux.lse.detach() - xs[3][None, :, None])
    detached = torch.autograd.grad(out * keep[..., None], xs, dout)
    errors = [rel_err(got, want) for got, want in zip(detached, ref_grads, strict=True)]
    assert errors[0] > 2e-2 and errors[1] > 2e-2 and errors[3] < 1e-5, errors
