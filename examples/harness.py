"""Command-line, checking and timing plumbing shared by the example scripts.

Nothing here is part of the lesson: each script keeps its kernels, its torch-facing function and
its reference to itself, and only its ``main`` leans on this module for the parts that are the same
everywhere (flags, the no-GPU message, compile-only builds, error metrics, timing and the peers
we compare against).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- command line
def positive_int(text: str) -> int:
    """argparse type for a size: an empty problem has no kernel to build or time."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


# What --tune does, in every script that has a tune space (docs/CONVENTIONS.md, "Command line").
TUNE_HELP = (
    "benchmark every entry of the script's tune_configs side by side in one run (one report), "
    "then check the fastest"
)


def base_parser(
    description: str,
    *,
    archs: tuple[str, ...],
    dims: tuple[int, ...] | None = None,
    dim: int = 128,
    seq_len: int = 4096,
    tune: bool = True,
) -> argparse.ArgumentParser:
    """The flags every attention script shares (docs/CONVENTIONS.md, "Command line").
    ``archs``: the targets the script builds for (the first is the default); ``dims``: the head
    dims it supports; ``tune``: whether it has a ``tune_configs`` space (else no ``--tune``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--seq_len", type=positive_int, default=seq_len, help="query length")
    p.add_argument(
        "--seq_len_k", type=positive_int, default=None, help="key length (default: --seq_len)"
    )
    p.add_argument("--dim", type=int, choices=dims, default=dim, help="head dimension")
    p.add_argument("--causal", action="store_true", help="causal mask, aligned bottom-right")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the benchmark")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="build every kernel for --arch and print a summary; needs no GPU",
    )
    p.add_argument("--arch", choices=archs, default=archs[0], help="target for --compile-only")
    if tune:
        p.add_argument("--tune", action="store_true", help=TUNE_HELP)
    return p


def require_gpu(script: str, arch: str = "sm_90a", capability: tuple[int, int] | None = None):
    """Exit with one clear line when the GPU this script needs is absent."""
    hint = f"use `python {script} --compile-only --arch {arch}` to build the kernels without one"
    if not torch.cuda.is_available():
        sys.exit(f"{script}: no CUDA GPU found; {hint}.")
    if capability is not None and torch.cuda.get_device_capability() != capability:
        name = torch.cuda.get_device_name()
        sys.exit(f"{script}: needs compute capability {capability}, found {name}; {hint}.")


# ----------------------------------------------------------------------------- compile-only
def target_for(arch: str) -> dict:
    return {"kind": "cuda", "arch": arch}


def compile_for(jit_fn, arch: str, *args, **kwargs):
    """Build a ``@tilelang.jit`` kernel for ``arch`` without a GPU (nvcc only)."""
    import tilelang

    program = jit_fn.get_tir(*args, **kwargs)
    return tilelang.compile(program, target=target_for(arch), pass_configs=jit_fn.pass_configs)


def describe_source(name: str, source: str) -> str:
    """One summary line: which Hopper/Blackwell features the generated CUDA uses."""
    features = {
        "wgmma": "wgmma" in source,
        "tma": "tma_load" in source,
        "tma-store": "tma_store" in source,
        "bulk-reduce": "cp.reduce.async.bulk" in source or "tma_store_add" in source,
        "tcgen05": "tcgen05" in source,
        "tmem": "tmem" in source.lower(),
        "atomics": "atomic" in source.lower(),
    }
    used = ", ".join(k for k, v in features.items() if v) or "plain CUDA"
    return f"  {name}: {len(source.splitlines())} lines of CUDA; uses {used}"


# ----------------------------------------------------------------------------- correctness
def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out−ref‖/‖ref‖ over the reference's finite entries (docs/CONVENTIONS.md, "Correctness");
    inf unless out's non-finite entries are exactly the reference's (same places, same
    infinities, never NaN)."""
    out, ref = out.float(), ref.float()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(out[~finite], ref[~finite]):
        return math.inf
    diff = (out[finite] - ref[finite]).double()
    return (diff.norm() / ref[finite].double().norm().clamp_min(1e-30)).item()


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float) -> float:
    """Relative error ‖out−ref‖/‖ref‖ must stay under ``rtol``; NaN/Inf never pass. The
    tolerances the scripts use are in docs/CONVENTIONS.md, "Correctness"."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    rel = rel_error(out, ref)
    if math.isinf(rel):
        raise AssertionError(f"{name}: NaN/Inf where the reference has none, or the reverse")
    finite = torch.isfinite(ref)
    diff = out.float()[finite] - ref.float()[finite]
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    print(f"  {name:<8} max|diff| {max_abs:.3e}   rel {rel:.3e}   (tol {rtol:g})")
    if not rel < rtol:
        raise AssertionError(f"{name}: relative error {rel:.3e} exceeds {rtol:g}")
    return rel


# ----------------------------------------------------------------------------- timing
def bench_ms(fn) -> float:
    """Median milliseconds of ``fn()`` (warm-up and compile happen before timing)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def attention_flops(batch, heads, seq_q, seq_k, dim_qk, dim_v, causal, backward=False) -> float:
    """2·B·H·Sq·Sk·(Dqk+Dv), halved for causal, ×2.5 for the backward (docs/CONVENTIONS.md,
    "Benchmarks")."""
    flops = 2.0 * batch * heads * seq_q * seq_k * (dim_qk + dim_v)
    if causal and seq_q == seq_k:
        flops *= 0.5  # the convention every FlashAttention benchmark uses
    elif causal:
        # bottom-right aligned: count the visible part of the Sq×Sk rectangle
        visible = sum(max(0, min(seq_k, i + 1 + seq_k - seq_q)) for i in range(seq_q))
        flops *= visible / (seq_q * seq_k)
    return flops * (2.5 if backward else 1.0)


def sdpa_peers(q, k, v, causal: bool, softmax_scale: float, layout: str = "bshd") -> dict:
    """Forward peers on the same inputs: SDPA's FLASH (= FA2) and cuDNN backends, and FA3.

    SDPA's causal mask is aligned top-left, so for Sq != Sk causal runs it is not a peer.
    FA3's forward is bf16-only here and optional: skipped cleanly when not importable.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if (
        causal
        and q.shape[-3 if layout == "bshd" else -2] != k.shape[-3 if layout == "bshd" else -2]
    ):
        return {}
    to_bhsd = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    qh, kh, vh = to_bhsd(q), to_bhsd(k), to_bhsd(v)
    gqa = qh.shape[1] != kh.shape[1]

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=causal, scale=softmax_scale, enable_gqa=gqa
                )
            return to_bhsd(out)  # back to the caller's layout (a transpose is its own inverse)

        return run

    peers = {
        "sdpa_flash(FA2)": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    fa3 = fa3_forward()
    if fa3 is not None and q.dtype == torch.bfloat16:
        qs, ks, vs = (x if layout == "bshd" else x.transpose(1, 2) for x in (q, k, v))
        peers["fa3"] = lambda: fa3(qs, ks, vs, softmax_scale=softmax_scale, causal=causal)
    return peers


def fa3_forward():
    try:
        from fa3_fwd_interface import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def report(title: str, ours: dict, peers: dict, flops: float, rounds: int = 3) -> list[dict]:
    """Time ours and every peer in this one run; print ms, TFLOP/s and ratio to the best peer.

    The implementations take turns for ``rounds`` rounds and each keeps its median, so a clock
    or thermal drift during the run does not favour whichever went first.
    """
    fns = {**ours, **peers}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if times[name] is None:
                continue
            try:
                times[name].append(bench_ms(fn))
            except Exception as err:  # a peer without a kernel for this shape: say so, go on
                print(f"  {name:<26} unavailable: {type(err).__name__}: {str(err).splitlines()[0]}")
                times[name] = None
    rows = [
        {"impl": name, "ms": statistics.median(t), "ours": name in ours}
        for name, t in times.items()
        if t
    ]
    for r in rows:
        r["tflops"] = flops / r["ms"] * 1e-9
    best_peer = max((r["tflops"] for r in rows if not r["ours"]), default=math.nan)
    print(f"{title}  ({torch.cuda.get_device_name()})")
    for r in rows:
        r["ratio_to_best_peer"] = r["tflops"] / best_peer  # NaN when no peer ran
        has_peer = not math.isnan(best_peer)
        tag = f"{r['ratio_to_best_peer']:5.2f}x best peer" if r["ours"] and has_peer else ""
        print(f"  {r['impl']:<26} {r['ms']:8.3f} ms {r['tflops']:8.1f} TFLOP/s  {tag}")
    return rows


def fastest(rows: list[dict]) -> str:
    """``--tune``'s pick: the name of the fastest of our rows in a ``report``."""
    return min((r for r in rows if r["ours"]), key=lambda r: r["ms"])["impl"]


# ----------------------------------------------------------------------------- run records
def command_line(script: str, argv=None) -> str:
    """How a benchmark was started, as its results record it: ``python <script>`` and its
    arguments (``argv`` None: the process's own)."""
    return " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def run_stamp(command: str, start: datetime.datetime) -> dict:
    """What a benchmark's JSON records of its run: the command, and the UTC date and the time
    span from ``start`` to now."""
    end = utc_now()
    return {"command": command, "date": str(start.date()), "time": f"{start:%H:%M}–{end:%H:%M} UTC"}


def write_record(path, record: dict) -> dict:
    """A benchmark's JSON ``record`` to ``path`` (a ``pathlib.Path``) through a ``.part`` file
    renamed over it, so a run killed while writing keeps the last whole file. Benchmarks write
    after every shape, so a run cut short keeps the rows it finished. Returns ``record``."""
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(record, indent=1))
    partial.replace(path)
    return record


def run_line(record: dict) -> str | None:
    """The line a results table gives a run (``run_stamp``'s fields): None for a record written
    before runs kept them."""
    if "command" not in record:
        return None
    return f"`{record['command']}`, one process, {record['date']} {record['time']}."


# ----------------------------------------------------------------------------- backward scripts
def check_grads(grads: dict, refs: dict, rtol: float = 2e-2) -> dict:
    """check_close for every named gradient (fp16/bf16 gradients: relative error under 2e-2)."""
    return {name: check_close(name, grads[name], refs[name], rtol) for name in refs}


def sdpa_backward_peers(q, k, v, dout, causal: bool, softmax_scale: float, layout: str = "bshd"):
    """SDPA FLASH (= FA2) and cuDNN on the same inputs: (forward+backward, backward alone),
    two name → callable dicts for ``report``.

    GQA inputs (fewer k/v heads) go through ``enable_gqa``; a backend that rejects it, or the
    shape, is still listed and reported as unavailable. SDPA's causal mask is aligned top-left,
    so for Sq != Sk causal runs there are no peers. The graph for "backward alone" is built here
    once (outside any timing) and kept.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq_dim = 1 if layout == "bshd" else 2
    if causal and q.shape[seq_dim] != k.shape[seq_dim]:
        return {}, {}
    to_bhsd = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    gqa = q.shape[3 - seq_dim] != k.shape[3 - seq_dim]

    def forward(backend):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(
                *(to_bhsd(t) for t in leaves),
                is_causal=causal,
                scale=softmax_scale,
                enable_gqa=gqa,
            )

    dout_h = to_bhsd(dout)
    fwd_bwd, bwd = {}, {}
    for name, backend in (
        ("sdpa_flash(FA2)", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        fwd_bwd[name] = lambda b=backend: torch.autograd.grad(forward(b), leaves, dout_h)
        try:
            out = forward(backend)
        except Exception as err:  # reported as unavailable by `report`, like any other failure

            def unavailable(err=err):
                raise err

            bwd[name] = unavailable
            continue
        bwd[name] = lambda o=out: torch.autograd.grad(o, leaves, dout_h, retain_graph=True)
    return fwd_bwd, bwd


# ----------------------------------------------------------------------------- SM100 inspection
def dynamic_smem_bytes(kernel) -> int:
    """Dynamic shared memory (bytes) a compiled TileLang kernel is launched with.

    TileLang's generated host code passes it as the last integer launch argument before the
    kernel call (after grid and block sizes); read it from there.
    """
    import re

    host = kernel.get_host_source()
    call = re.search(r"\w*_kernel\w*_packed == NULL", host)  # the kernel launch, not set_device
    if call is None:
        raise ValueError("no kernel launch found in the host source")
    sizes = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", host[: call.start()])
    if not sizes:
        raise ValueError("no launch arguments found in the host source")
    return int(sizes[-1])


# ----------------------------------------------------------------------------- varlen scripts
def fa3_varlen_forward():
    """FlashAttention-3's ``flash_attn_varlen_func`` when importable and shaped like FA3's
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, ...);
    None otherwise, so callers skip it cleanly."""
    import inspect

    try:
        from fa3_fwd_interface import flash_attn_varlen_func
    except ImportError:
        return None
    try:
        params = inspect.signature(flash_attn_varlen_func).parameters
    except (TypeError, ValueError):
        return None
    expected = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    if list(params)[: len(expected)] != expected or not {"softmax_scale", "causal"} <= set(params):
        print("fa3_fwd_interface.flash_attn_varlen_func has an unexpected signature: skipped")
        return None
    return flash_attn_varlen_func


def varlen_flops(cu_seqlens_q, cu_seqlens_k, heads, dim_qk, dim_v, causal, backward=False):
    """FLOPs of a packed batch: ``attention_flops`` summed over the sequences."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lengths = zip(
        (b - a for a, b in zip(bounds_q[:-1], bounds_q[1:], strict=True)),
        (b - a for a, b in zip(bounds_k[:-1], bounds_k[1:], strict=True)),
        strict=True,
    )
    return sum(
        attention_flops(1, heads, lq, lk, dim_qk, dim_v, causal, backward)
        for lq, lk in lengths
        if lq > 0 and lk > 0
    )


# ----------------------------------------------------------------------------- torch.compile
class TwoLayerModel(torch.nn.Module):
    """The toy model that tests/test_custom_ops.py and benchmarks/bench_compiled.py compile: two
    layers of QKV projection, ``attention(q, k, v, causal)`` (on ``layout`` "bshd" or "bhsd"),
    output projection and residual add, on ``x [B, S, heads * dim]``. ``heads_kv`` (default
    ``heads``) fewer than ``heads`` projects k and v to fewer heads, for the GQA scripts."""

    def __init__(self, attention, heads, dim, causal, layout="bshd", layers=2, heads_kv=None):
        super().__init__()
        self.attention, self.dim = attention, dim
        self.heads = [heads, heads_kv or heads, heads_kv or heads]  # of q, k, v
        self.causal, self.layout = causal, layout
        width, qkv_width = heads * dim, sum(self.heads) * dim
        linear = torch.nn.Linear
        self.qkv = torch.nn.ModuleList(linear(width, qkv_width, bias=False) for _ in range(layers))
        self.proj = torch.nn.ModuleList(linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        B, S, width = x.shape
        for qkv, proj in zip(self.qkv, self.proj, strict=True):
            parts = qkv(x).split([h * self.dim for h in self.heads], dim=-1)
            q, k, v = (t.view(B, S, h, self.dim) for t, h in zip(parts, self.heads, strict=True))
            if self.layout == "bhsd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = self.attention(q, k, v, self.causal)
            if self.layout == "bhsd":
                out = out.transpose(1, 2)
            x = x + proj(out.reshape(B, S, width))
        return x
