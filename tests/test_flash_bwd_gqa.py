"""GQA backward scripts (example_gqa_bwd.py with --strategy group/atomic/split, and
example_gqa_bwd_tma_reduce.py): references, command lines, sm_90a builds and their generated code,
bad input (CPU), and the gradient matrix on a GPU (marker ``gpu``)."""

import functools
import math
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import fresh_plans, load_script

GQA_BWD = "flash_attention/example_gqa_bwd.py"
TMA_BWD = "flash_attention/example_gqa_bwd_tma_reduce.py"
SCRIPTS = [GQA_BWD, TMA_BWD]
# (script, strategy) for everything that runs a backward; the TMA script has one way only.
VARIANTS = [(GQA_BWD, "group"), (GQA_BWD, "atomic"), (GQA_BWD, "split"), (TMA_BWD, None)]


def run_attention(mod, strategy, *args, **kwargs):
    if strategy is not None:
        kwargs["strategy"] = strategy
    return mod.attention(*args, **kwargs)


def make_inputs(B, Sq, Sk, H, Hkv, Dqk, Dv, dtype=torch.float64, device="cpu", scale=1.0):
    """q, k, v, dout (BSHD), normal random values times ``scale`` (dout unscaled)."""
    g = torch.Generator(device=device).manual_seed(B * 1000 + Sq * 7 + Sk + Dqk + H)
    shapes = [(B, Sq, H, Dqk), (B, Sk, Hkv, Dqk), (B, Sk, Hkv, Dv)]
    q, k, v = ((torch.randn(s, generator=g, device=device) * scale).to(dtype) for s in shapes)
    dout = torch.randn(B, Sq, H, Dv, generator=g, device=device).to(dtype)
    return q, k, v, dout


def sdpa_math(q, k, v, causal):
    """Torch's math SDPA (BSHD in and out) with kv heads repeated and a bottom-right mask."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    mask = None
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def grads_of(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


# ----------------------------------------------------------------------------- CPU: references
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "Sq,Sk,H,Hkv,Dqk,Dv", [(33, 33, 4, 2, 32, 32), (17, 40, 8, 2, 48, 32), (5, 5, 4, 4, 16, 16)]
)
def test_reference_grads_match_sdpa_math(script, causal, Sq, Sk, H, Hkv, Dqk, Dv):
    """ref_program's out and autograd dq/dk/dv equal SDPA math's in float64 (GQA, Sq ≤ Sk)."""
    mod = load_script(script)
    q, k, v, dout = make_inputs(2, Sq, Sk, H, Hkv, Dqk, Dv)
    ours = grads_of(lambda *t: mod.ref_program(*t, causal=causal), q, k, v, dout)
    ref = grads_of(lambda *t: sdpa_math(*t, causal), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_rows_without_keys(script):
    """Causal, Sq > Sk: the first Sq-Sk query rows see no key → out 0, dq 0, all grads finite;
    the other rows match SDPA math on the rows that do see keys."""
    mod = load_script(script)
    Sq, Sk = 11, 4
    q, k, v, dout = make_inputs(1, Sq, Sk, 4, 2, 16, 16)
    out, dq, dk, dv = grads_of(lambda *t: mod.ref_program(*t, causal=True), q, k, v, dout)
    assert torch.all(out[:, : Sq - Sk] == 0) and torch.all(dq[:, : Sq - Sk] == 0)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    # Rows without keys contribute nothing: dropping them must leave dk, dv unchanged.
    tail = [t[:, Sq - Sk :] for t in (q, dout)]
    ref = grads_of(lambda *t: sdpa_math(*t, True), tail[0], k, v, tail[1])
    for name, a, b in zip(
        ("out", "dq", "dk", "dv"), (out[:, Sq - Sk :], dq[:, Sq - Sk :], dk, dv), ref, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_grads_chunked_by_batch_equal_direct(script):
    """reference_grads (one batch entry at a time, float32) equals one float32 autograd pass."""
    mod = load_script(script)
    q, k, v, dout = make_inputs(3, 9, 12, 4, 2, 16, 8, dtype=torch.float16)
    got = mod.reference_grads(q, k, v, dout, True, 0.3)
    f32 = [t.float() for t in (q, k, v, dout)]
    want = grads_of(lambda *t: mod.ref_program(*t, causal=True, softmax_scale=0.3), *f32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------- CPU: command line
@pytest.mark.parametrize("script", SCRIPTS)
def test_flags(script):
    parser = load_script(script).build_parser()
    args = parser.parse_args([])
    assert args.causal is False and args.dim_v is None
    assert parser.parse_args(["--causal"]).causal is True
    for bad in (["--causal", "False"], ["--dtype", "float32"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_strategy_choices():
    mod = load_script(GQA_BWD)
    parser = mod.build_parser()
    assert parser.parse_args([]).strategy is None  # default_strategy decides
    assert parser.parse_args(["--strategy", "split"]).strategy == "split"
    assert parser.parse_args(["--strategy", "group"]).strategy == "group"
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy", "sum"])  # an unknown value is an argparse error
    assert "--strategy" not in load_script(TMA_BWD).build_parser().format_help()


def test_default_strategy():
    """The hand-scheduled backward where it builds (Hopper, 64/64 and 128/128), else atomic."""
    pick = load_script(GQA_BWD).default_strategy
    assert pick(64, 64) == pick(128, 128) == "group"
    assert pick(192, 128) == "atomic"
    assert pick(128, 128, "sm_100a") == "atomic"


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "group", "--dim", "192", "--dim_v", "128"],
        ["--strategy", "group", "--arch", "sm_100a"],
    ],
)
def test_main_rejects_group_where_it_does_not_build(argv, capsys):
    with pytest.raises(SystemExit):
        load_script(GQA_BWD).main(["--compile-only", *argv])
    assert "--strategy group" in capsys.readouterr().err


def test_group_strategy_code():
    """group: one thread block walks every query head of its group, so dK/dV leave by plain
    stores (no atomics at all); dQ by one bulk reduce-add per step, at the step's query head."""
    mod = load_script(GQA_BWD)
    src = mod.compile_all(2, 8, 2, 1000, 1000, 128, 128, True, "bfloat16", "group", "sm_90a")
    bwd = src["flash_bwd"]
    assert "atomicAdd" not in bwd and "AtomicAdd" not in bwd
    assert bwd.count("tl::tma_store_add(") == 1 and "wgmma" in bwd
    # kv head blockIdx.y, group of 4 query heads: the step's head is blockIdx.y * 4 + g, g the
    # loop over the group (dQ_accum: 131072 floats a head, 4 · 131072 a kv head).
    assert re.search(r"blockIdx\.y\) \* 524288\)+ \+ \(g_\d+ \* 131072\)", bwd)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "argv,fragment",
    [(["--groups", "5"], "--groups"), (["--dim", "192"], "--dim"), (["--dim_v", "96"], "--dim")],
)
def test_main_rejects_bad_flags(script, argv, fragment, capsys):
    with pytest.raises(SystemExit):
        load_script(script).main(["--heads", "32", "--compile-only", *argv])
    assert fragment in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script", SCRIPTS)
def test_main_without_gpu_says_so(script):
    with pytest.raises(SystemExit) as exc:
        load_script(script).main(["--seq_len", "128"])
    assert "--compile-only" in str(exc.value.code)


# ----------------------------------------------------------------------------- CPU: builds
@functools.cache
def bwd_source(script, strategy, Dqk, Dv, causal, seq=1000, cfg=None):
    """CUDA source of the backward kernel for sm_90a, built once per configuration."""
    import harness

    mod = load_script(script)
    cfg = dict(cfg) if cfg else mod.default_config(Dqk, Dv, "sm_90a")
    args = (2, 8, 2, seq, seq, Dqk, Dv, causal, 1 / math.sqrt(Dqk), "bfloat16")
    if strategy is not None:
        args = (*args, strategy)
    return harness.compile_for(mod.flashattn_bwd, "sm_90a", *args, **cfg).get_kernel_source()


BUILDS = [  # (script, strategy, Dqk, Dv, causal): every variant, every head-dim pair once
    (GQA_BWD, "atomic", 64, 64, True),
    (GQA_BWD, "atomic", 128, 128, False),
    (GQA_BWD, "split", 128, 128, True),
    (GQA_BWD, "split", 192, 128, False),
    (GQA_BWD, "atomic", 192, 128, True),
    (TMA_BWD, None, 64, 64, False),
    (TMA_BWD, None, 128, 128, True),
    (TMA_BWD, None, 192, 128, True),
]


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: "-".join(map(str, b[1:])))
def test_backward_builds_for_sm90_with_wgmma_and_tma(build):
    src = bwd_source(*build)
    assert "wgmma" in src, "the K·Qᵀ, V·dOᵀ, dv and dk GEMMs should lower to WGMMA on sm_90a"
    assert "tma_load" in src, "Q, dO, K, V tiles should arrive by TMA on sm_90a"


def atomic_calls(src, buffer):
    """The atomic-add template names the kernel applies to ``buffer`` (e.g. {'AtomicAddx4'})."""
    return set(re.findall(r"\b(AtomicAdd\w*)\(\(?&\(?" + buffer + r"\[", src))


@pytest.mark.parametrize("Dqk,Dv", [(128, 128), (192, 128)])
def test_atomic_strategy_code(Dqk, Dv):
    """dK/dV: one regional atomic per tile, vectorized to four-float atomics. dQ: the annotated
    dq_layout puts columns d and d+1 32 floats apart, so its atomics must stay scalar — a
    vectorized dQ atomic would mean the layout-blind vectorization bug is back."""
    src = bwd_source(GQA_BWD, "atomic", Dqk, Dv, Dqk != 128)
    assert atomic_calls(src, "dK") == {"AtomicAddx4"}
    assert atomic_calls(src, "dV") == {"AtomicAddx4"}
    assert atomic_calls(src, "dQ") == {"AtomicAdd"}
    # ... and each dQ atomic's address takes the parity bit of the column times 32 (dq_layout).
    dq_lines = [line for line in src.splitlines() if "AtomicAdd((&(dQ[" in line]
    assert dq_lines and all("& 1) * 32)" in line for line in dq_lines)


def test_split_strategy_code():
    """split: every group member writes its own dK/dV slice — no atomics on dK/dV."""
    src = bwd_source(GQA_BWD, "split", 192, 128, False)
    assert atomic_calls(src, "dK") == set() and atomic_calls(src, "dV") == set()
    assert atomic_calls(src, "dQ") == {"AtomicAdd"}


@pytest.mark.parametrize("Dqk,Dv", [(128, 128), (192, 128)])
def test_tma_reduce_code(Dqk, Dv):
    """dQ goes out by TMA reduce-add (no per-element dQ atomics); dK/dV by vectorized regional
    atomics; and TileLang's tma_store_add template is the bulk-tensor reduce instruction."""
    src = bwd_source(TMA_BWD, None, Dqk, Dv, True)
    assert re.search(r"tl::tma_store_add\(dQ_desc,", src), "dQ should use the TMA reduce-add"
    assert atomic_calls(src, "dQ") == set()
    assert atomic_calls(src, "dK") == {"AtomicAddx4"}
    assert atomic_calls(src, "dV") == {"AtomicAddx4"}
    import tilelang

    header = pathlib.Path(tilelang.__file__).parent / "src/tl_templates/cuda/copy_sm90.h"
    text = header.read_text()
    body = text[text.index("TL_DEVICE void tma_store_add(const CUtensorMap") :]
    assert "cp.reduce.async.bulk.tensor" in body.split("TL_DEVICE", 2)[1]


def test_tune_space_builds_for_sm90():
    """Every configuration tune_configs offers builds (D 128 and the 192/128 pair)."""
    mod = load_script(GQA_BWD)
    for Dqk, Dv in ((128, 128), (192, 128)):
        for cfg in mod.tune_configs(Dqk, Dv):
            if cfg == mod.default_config(Dqk, Dv, "sm_90a"):
                continue  # built by the tests above
            src = bwd_source(GQA_BWD, "atomic", Dqk, Dv, True, 255, tuple(sorted(cfg.items())))
            assert "wgmma" in src, cfg


@pytest.mark.parametrize(
    "script,argv",
    [
        (GQA_BWD, ["--strategy", "split", "--dim", "64"]),
        (TMA_BWD, ["--dim", "192", "--dim_v", "128", "--causal"]),
    ],
)
def test_compile_only_main(script, argv, capsys):
    load_script(script).main(["--compile-only", "--seq_len", "255", "--groups", "8", *argv])
    out = capsys.readouterr().out
    assert "built for sm_90a" in out
    assert re.search(r"flashattn_bwd\S*: .*wgmma", out)
    for name in ("flashattn_fwd", "preprocess", "postprocess"):
        assert name in out


# ----------------------------------------------------------------------------- CPU: bad input
def _bad_inputs(script):
    """(description, q, k, v, kwargs, expected message fragment) for every rejected input."""
    q, k, v, _ = make_inputs(1, 16, 16, 4, 2, 128, 128, torch.float16)
    v192 = make_inputs(1, 16, 16, 4, 2, 192, 128, torch.float16)
    cases = [
        ("float32", q.float(), k, v, {}, "float16 or bfloat16"),
        ("mixed dtypes", q, k.bfloat16(), v, {}, "share a dtype"),
        ("rank 3", q[0], k, v, {}, "q must be"),
        ("k/v lengths differ", q, k, v[:, :8], {}, "v must be"),
        ("k/v heads differ", q, k, v[:, :, :1], {}, "v must be"),
        ("Dqk mismatch", q, k[..., :64], v, {}, "k must be"),
        ("head dims 128/64", q, k, v[..., :64], {}, "head dims"),
        ("head dims 192/192", v192[0], v192[1], v192[0][:, :, :2], {}, "head dims"),
        ("head dim 48", q[..., :48], k[..., :48], v[..., :48], {}, "head dims"),
        ("H % Hkv", q[:, :, :3], k, v, {}, "H % Hkv"),
        ("strided last dim", q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, {}, "last"),
        ("CPU tensors", q, k, v, {}, "CUDA tensor"),
    ]
    if script == GQA_BWD:
        cases.append(("unknown strategy", q, k, v, {"strategy": "sum"}, "strategy"))
        group_192 = ("group at 192/128", *v192[:3], {"strategy": "group"}, "strategy 'group'")
        cases.append(group_192)
    return cases


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_raises_value_error_naming_argument(script):
    mod = load_script(script)
    for what, q, k, v, kwargs, fragment in _bad_inputs(script):
        with pytest.raises(ValueError, match=fragment):
            mod.attention(q, k, v, **kwargs)
            pytest.fail(f"accepted bad input: {what}")


# ----------------------------------------------------------------------------- GPU
# (B, H, Hkv, Sq, Sk, Dqk, Dv, causal, dtype, input scale). Ragged S (17, 255, 1000) exercise the
# 8-row padding of the dq_layout accumulator and every bounds check; groups 1/2/4/8; Sq < Sk and
# Sq > Sk (rows with no key) causal; ×10 inputs for large logits. Each row runs for all three
# variants (group: where it builds, 64/64 and 128/128): dQ of the atomic/split kernels goes
# through layout-annotated atomics, dK/dV of the atomic kernel and the TMA kernel through
# regional (vectorized) atomics — a vectorization that ignored a layout would show as a dQ error
# on every row; the group kernel walks a group's heads in one thread block.
GPU_CASES = [
    (1, 8, 8, 17, 17, 64, 64, False, torch.float16, 1),
    (2, 8, 4, 255, 255, 128, 128, True, torch.bfloat16, 1),
    (2, 8, 2, 1000, 1000, 64, 64, True, torch.float16, 1),
    (1, 16, 2, 4096, 4096, 128, 128, True, torch.bfloat16, 1),
    (2, 8, 1, 255, 1000, 192, 128, True, torch.float16, 1),
    (1, 8, 2, 1000, 255, 128, 128, True, torch.bfloat16, 1),
    (3, 4, 2, 1000, 1000, 192, 128, False, torch.bfloat16, 1),
    (1, 4, 4, 4096, 4096, 64, 64, False, torch.float16, 1),
    (2, 8, 2, 17, 255, 128, 128, False, torch.float16, 1),
    (1, 4, 2, 255, 255, 128, 128, True, torch.float16, 10),
    # D = 64 grids small enough that the group kernel takes 64 keys a thread block
    (1, 8, 2, 255, 17, 64, 64, True, torch.bfloat16, 1),
    (2, 8, 1, 777, 1000, 64, 64, False, torch.float16, 1),
    (1, 16, 2, 17, 300, 64, 64, True, torch.bfloat16, 10),
    # the group kernel's last wave in parts: 160 thread blocks, 28 in 4 parts (tail_split_plan)
    (1, 20, 5, 4096, 4096, 128, 128, False, torch.bfloat16, 1),
]


def _case_id(case):
    B, H, Hkv, Sq, Sk, Dqk, Dv, causal, dtype, scale = case
    tag = f"B{B}-H{H}-Hkv{Hkv}-Sq{Sq}-Sk{Sk}-D{Dqk}x{Dv}-{'causal' if causal else 'full'}"
    return tag + f"-{str(dtype)[6:]}" + (f"-x{scale}" if scale != 1 else "")


GPU_PARAMS = [
    pytest.param(variant, case, id=f"{variant[1] or 'tma_reduce'}-{_case_id(case)}")
    for variant in VARIANTS
    for case in GPU_CASES
    if not (variant[1] == "group" and case[5] == 192)
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,case", GPU_PARAMS)
def test_gradients_match_reference(variant, case, poisoned_empty):
    """out (rel < 1e-2) and dq, dk, dv (rel < 2e-2) against autograd through ref_program in
    float32; every buffer the kernels fill starts as NaN (poisoned_empty)."""
    from helpers import rel_err

    script, strategy = variant
    mod = load_script(script)
    B, H, Hkv, Sq, Sk, Dqk, Dv, causal, dtype, scale = case
    q, k, v, dout = make_inputs(B, Sq, Sk, H, Hkv, Dqk, Dv, dtype, "cuda", scale)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = run_attention(mod, strategy, q, k, v, causal=causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = mod.reference_grads(q, k, v, dout, causal, 1 / math.sqrt(Dqk))
    errors = {
        n: rel_err(a, b)
        for n, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref, strict=True)
    }
    assert errors["out"] < 1e-2, errors  # fp16/bf16 forward
    for name in ("dq", "dk", "dv"):
        assert errors[name] < 2e-2, errors  # fp16/bf16 gradients
    if causal and Sq > Sk:  # rows that see no key: out 0, dq 0 exactly
        assert torch.all(out[:, : Sq - Sk] == 0) and torch.all(dq[:, : Sq - Sk] == 0)


@pytest.mark.gpu
def test_wide_tail_gradients(monkeypatch, poisoned_empty):
    """A last wave over half the SMs in parts. The split count is only taken for walks of
    LONG_WALK steps or more, whose grids make a float32 reference of 7 GiB; LONG_WALK is
    lowered so that a small grid takes it: B1 H52/Hkv13 S2100 D128, 221 thread blocks, the
    last 89 in 4 parts."""
    from helpers import rel_err

    mod = load_script(GQA_BWD)
    monkeypatch.setattr(mod.fast_bwd, "LONG_WALK", 128)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if num_sms != 132:
        pytest.skip("the case's plan is for 132 SMs")
    assert mod.fast_bwd.tail_split_plan(221, 132, 33, groups=4) == (132, 89, 4)
    built, backward_kernels = [], mod.fast_bwd.backward_kernels

    def kernels_of_the_run(*args, **kwargs):  # what run_backward builds and launches
        kernels = backward_kernels(*args, **kwargs)
        built.append(set(kernels))
        return kernels

    monkeypatch.setattr(mod.fast_bwd, "backward_kernels", kernels_of_the_run)
    q, k, v, dout = make_inputs(1, 2100, 2100, 52, 13, 128, 128, torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with fresh_plans(mod.fast_bwd.backward_plan):  # a plan made before LONG_WALK changed is stale
        out = run_attention(mod, "group", q, k, v, causal=False)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert built and all("flash_bwd_post_tail" in names for names in built), built
    ref = mod.reference_grads(q, k, v, dout, False, 1 / math.sqrt(128))
    assert rel_err(out, ref[0]) < 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref[1:], strict=True):
        assert rel_err(got, want) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        (1, 8, 1, 1000, 777, 64, True, torch.bfloat16, 64, 2),
        (2, 8, 2, 255, 17, 64, True, torch.float16, 64, 4),
        (1, 16, 2, 777, 1000, 128, False, torch.bfloat16, 128, 8),
        (2, 8, 2, 1000, 1000, 128, True, torch.float16, 128, 2),
        # one thread block walks the whole group, 128 keys: at D = 64 under the diagonal its
        # turn at dQ is a branch on the step (an odd group: an odd step count, Sq != Sk)
        (2, 8, 2, 1000, 1000, 64, True, torch.float16, 128, 1),
        (1, 6, 2, 777, 1000, 64, True, torch.bfloat16, 128, 1),
        (1, 9, 3, 1000, 555, 64, True, torch.bfloat16, 128, 1),
    ],
    ids=lambda c: f"B{c[0]}-H{c[1]}-Hkv{c[2]}-Sq{c[3]}-Sk{c[4]}-D{c[5]}-causal{c[6]}-splits{c[9]}",
)
def test_head_splits_gradients(case, poisoned_empty):
    """The group kernel with its heads shared out over ``head_splits`` thread blocks a key block
    (float32 dK/dV parts summed after the kernel), or walked by one (splits 1): gradients
    against the reference."""
    from helpers import rel_err

    mod = load_script(GQA_BWD)
    B, H, Hkv, Sq, Sk, D, causal, dtype, block_M, splits = case
    q, k, v, dout = make_inputs(B, Sq, Sk, H, Hkv, D, D, dtype, "cuda")
    scale = 1 / math.sqrt(D)
    out, lse = mod.attention_forward(q, k, v, causal, scale)
    cfg = dict(mod.fast_bwd.default_config(D), block_M=block_M, head_splits=splits)
    dq, dk, dv = mod.fast_bwd.attention_backward(dout, q, k, v, out, lse, causal, scale, cfg)
    _, ref_dq, ref_dk, ref_dv = mod.reference_grads(q, k, v, dout, causal, scale)
    for name, got, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert got.dtype == dtype and got.shape == ref.shape, name
        assert rel_err(got, ref) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 4])
def test_head_splits_through_attention(splits, poisoned_empty):
    """``attention(config=...)`` (strategy group) with and without ``head_splits`` in the
    config: the autograd formula's settings carry it to the backward (an eager call, through
    EagerAttention); gradients against the reference."""
    from helpers import rel_err

    mod = load_script(GQA_BWD)
    q, k, v, dout = make_inputs(1, 300, 300, 8, 2, 64, 64, torch.bfloat16, "cuda")
    cfg = mod.fast_bwd.default_config(64)
    cfg = {key: cfg[key] for key in ("block_M", "block_N", "num_stages", "dq_stages")}
    if splits:
        cfg["head_splits"] = splits
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = mod.attention(q, k, v, True, strategy="group", config=cfg)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = mod.reference_grads(q.detach(), k.detach(), v.detach(), dout, True, 64**-0.5)[1:]
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert rel_err(got, want) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script,argv",
    [
        (GQA_BWD, ["--strategy", "atomic", "--causal"]),
        (GQA_BWD, ["--causal", "--dtype", "bfloat16"]),  # default: group
        (GQA_BWD, ["--strategy", "split", "--dim", "192", "--dim_v", "128"]),
        (TMA_BWD, ["--causal", "--dtype", "bfloat16"]),
    ],
)
def test_main_small(script, argv, capsys):
    """main() at a small size: the check passes (it raises otherwise) and both reports print."""
    load_script(script).main(["--batch", "1", "--heads", "8", "--seq_len", "512", *argv])
    out = capsys.readouterr().out
    assert "backward B1 H8" in out and "forward+backward B1 H8" in out
    assert "TFLOP/s" in out
