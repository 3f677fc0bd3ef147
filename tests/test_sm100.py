"""SM100 (Blackwell) scripts: every kernel compiled for sm_100a and its generated code inspected
(TCGEN05 MMA, TMEM, mbarriers, shared memory within the limit), command lines, validation and
references on CPU; numerics on a Blackwell GPU only (markers ``gpu`` and capability (10, 0))."""

import importlib
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import load_script, rel_err

harness = importlib.import_module("harness")  # examples/, put on sys.path by helpers

MHA_FWD = "flash_attention_sm100/mha_fwd_bshd.py"
GQA_FWD = "flash_attention_sm100/gqa_fwd_bshd.py"
MHA_BWD = "flash_attention_sm100/mha_bwd_bshd.py"
GQA_BWD = "flash_attention_sm100/gqa_bwd_bshd.py"
GEMM = "gemm_sm100/gemm_tcgen5mma.py"
GEMM_WS = "gemm_sm100/gemm_tcgen5mma_ws.py"
ATTN_SCRIPTS = [MHA_FWD, GQA_FWD, MHA_BWD, GQA_BWD]
SM100 = harness.target_for("sm_100a")
SMEM_LIMIT = 232448  # SM100: dynamic shared memory per block
# A ragged, causal, Sq != Sk problem: masks, tails and bottom-right alignment all compile.
B, H, HKV, SQ, SK, D = 2, 8, 2, 1000, 900, 128
SCALE = 1 / math.sqrt(D)


def _built(kernel):
    return {"src": kernel.get_kernel_source(), "smem": harness.dynamic_smem_bytes(kernel)}


@pytest.fixture(scope="module")
def built():
    """Every distinct SM100 kernel, compiled once for sm_100a (lazily, one per key)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _built(_BUILDERS[name]())
        return cache[name]

    return get


def _mha_fwd(variant):
    mod = load_script(MHA_FWD)
    args = (B, H, SQ, SK, D, True, SCALE, "bfloat16")
    kernel, got = mod.build_forward(variant, args, target=SM100)
    assert got == variant
    return kernel


def _gqa_fwd(variant):
    args = (B, H, HKV, SQ, SK, D, True, SCALE, "float16")
    return load_script(GQA_FWD).build_forward(variant, args, target=SM100)


def _bwd(script):
    mod = load_script(script)
    hkv = HKV if script == GQA_BWD else H
    mod.check_bwd_config(D, **mod.BWD_CONFIG)
    args = (B, H, hkv, SQ, SK, D, True, SCALE, "bfloat16")
    return mod._compile(mod.flashattn_bwd, args, mod.BWD_CONFIG, SM100)


def _gemm(script):
    mod = load_script(script)
    return harness.compile_for(
        mod.gemm, "sm_100a", 1000, 1000, 1000, "bfloat16", **mod.DEFAULT_TILES
    )


_BUILDERS = {
    "mha_ss": lambda: _mha_fwd("ss"),
    "mha_ts": lambda: _mha_fwd("ts"),
    "mha_wasp": lambda: _mha_fwd("wasp"),
    "gqa_ss": lambda: _gqa_fwd("ss"),
    "gqa_ts": lambda: _gqa_fwd("ts"),
    "mha_bwd": lambda: _bwd(MHA_BWD),
    "gqa_bwd": lambda: _bwd(GQA_BWD),
    "gemm": lambda: _gemm(GEMM),
    "gemm_ws": lambda: _gemm(GEMM_WS),
}


# ----------------------------------------------------------------------------- sm_100a builds
@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_kernel_uses_tcgen05_tmem_and_fits_shared_memory(built, name):
    k = built(name)
    assert "tcgen05mma" in k["src"], "GEMMs must lower to TCGEN05 MMA on sm_100a"
    assert "tmem_allocate" in k["src"], "accumulators must live in tensor memory"
    assert "tcgen05_ld" in k["src"], "results come back from TMEM with tcgen05.ld"
    assert 0 < k["smem"] <= SMEM_LIMIT, f"{k['smem']} bytes of dynamic shared memory"
    # every TMEM allocation together fits the 512 columns of one SM
    cols = [int(c) for c in re.findall(r"tmem_allocate\(.*?, (\d+)\)", k["src"])]
    assert cols and sum(cols) <= 512, cols


@pytest.mark.parametrize(
    "name,script,variant",
    [("mha_ss", MHA_FWD, "ss"), ("mha_ts", MHA_FWD, "ts"), ("mha_wasp", MHA_FWD, "wasp")],
)
def test_shared_memory_budget_bounds_the_kernel(built, name, script, variant):
    """The budget function is an upper bound on what the compiled kernel asks for."""
    mod = load_script(script)
    cfg = mod.default_config(variant)
    assert built(name)["smem"] <= mod.smem_bytes(variant, D, **cfg) <= SMEM_LIMIT


def test_gemm_budgets_bound_the_kernels(built):
    for name, script in (("gemm", GEMM), ("gemm_ws", GEMM_WS)):
        mod = load_script(script)
        assert built(name)["smem"] <= mod.smem_bytes(**mod.DEFAULT_TILES) <= SMEM_LIMIT


def test_ss_and_ts_differ_in_gemm2_operand(built):
    ss, ts = built("mha_ss")["src"], built("mha_ts")["src"]
    assert "tcgen05mma_ts" not in ss and "tcgen05mma_ss" in ss  # both GEMMs shared × shared
    assert "tcgen05mma_ts" in ts, "ts reads P from TMEM in GEMM 2"
    assert "tcgen05_st" in ts, "ts stores P into TMEM"
    assert "__launch_bounds__(128" in ss and "__launch_bounds__(256" in ts
    gqa_ss, gqa_ts = built("gqa_ss")["src"], built("gqa_ts")["src"]
    assert "tcgen05mma_ts" not in gqa_ss and "tcgen05mma_ts" in gqa_ts


def test_wasp_is_warp_specialized_with_primed_barriers(built):
    src = built("mha_wasp")["src"]
    assert "__launch_bounds__(256" in src
    assert "tcgen05mma_ts" in src, "GEMM 2 reads P from TMEM"
    assert "tma_load" in src, "the DMA warp issues TMA loads"
    # the roles: DMA warp 4, MMA warp 5, softmax warps 0-3
    assert "(128 <= ((int)threadIdx.x)) && (((int)threadIdx.x) < 160)" in src
    assert "(160 <= ((int)threadIdx.x)) && (((int)threadIdx.x) < 192)" in src
    # priming: each K/V stage's empty barrier gets one arrival before any role starts waiting
    prime = src.index("kv_empty[s].arrive()")
    assert prime < src.index("kv_empty[(k & 1)].wait(")
    assert re.search(r"for \(int s = 0; s < 2; \+\+s\) \{\s*kv_empty\[s\]\.arrive\(\);", src)
    assert prime < src.index("s_free[0].wait(")
    # the MMA commits stage release and GEMM-2 completion on mbarriers
    assert "tcgen05_mma_arrive((&(kv_empty[(k_1 & 1)])))" in src
    assert "tcgen05_mma_arrive((&(o_full[0])))" in src
    # softmax correction and epilogue wait on GEMM 2 (o_full) right before each read of O
    o_reads = [m.start() for m in re.finditer(r"tcgen05_ld_32dp32bNx<\d+, false>\(O_tmem", src)]
    assert len(o_reads) == 2
    for pos in o_reads:
        before = src[:pos]
        assert before.rfind("o_full[0].wait(") > before.rfind("p_full[0].arrive()") or (
            before.rfind("o_full[0].wait(") > before.rfind("s_free[0].arrive()")
        )


def test_backward_kernels_use_atomics_for_dq_and_gqa_dkdv(built):
    mha, gqa = built("mha_bwd")["src"], built("gqa_bwd")["src"]
    for src in (mha, gqa):
        assert "AtomicAdd" in src and "dQ" in src
        assert len(re.findall(r"tcgen05mma\w*<", src)) == 5, "five GEMMs per step"
    # GQA sums dK/dV over a group's query heads with atomics; MHA stores them
    assert re.search(r"AtomicAdd\w*\(\(&\(dK\[", gqa) and re.search(r"AtomicAdd\w*\(\(&\(dV\[", gqa)
    assert not re.search(r"AtomicAdd\w*\(\(&\(dK\[", mha)


def test_gemm_ws_uses_mbarrier_ring(built):
    src = built("gemm_ws")["src"]
    assert "tma_load" in src
    assert re.search(r"for \(int s = 0; s < 3; \+\+s\) \{\s*consumed\[s\]\.arrive\(\);", src)
    assert "tcgen05_mma_arrive((&(tmem_full[0])))" in src


# ----------------------------------------------------------------------------- wasp fallback
def test_wasp_failure_falls_back_to_ts(monkeypatch, capsys):
    mod = load_script(MHA_FWD)

    class Broken:
        pass_configs = mod.PASS_CONFIGS

        def get_tir(self, *args, **kwargs):
            raise RuntimeError("layout inference failed (forced by the test)")

        __call__ = get_tir

    monkeypatch.setattr(mod, "flashattn_fwd_wasp", Broken())
    args = (1, 2, 256, 256, 64, False, 0.125, "float16")
    kernel, got = mod.build_forward("wasp", args, target=SM100)
    err = capsys.readouterr().err
    assert got == "ts"
    assert "warning" in err and "wasp" in err and "forced by the test" in err
    assert "tcgen05mma_ts" in kernel.get_kernel_source()
    assert "__launch_bounds__(256" in kernel.get_kernel_source()


def test_named_wrappers_pin_their_variant(monkeypatch):
    mod = load_script(MHA_FWD)
    seen = []
    monkeypatch.setattr(mod, "flashattn_fwd", lambda *a, **kw: seen.append(kw["variant"]))
    mod.flashattn_ss(1, 2, 3)
    mod.flashattn_ts(1, 2, 3)
    assert seen == ["ss", "ts"] and mod.flashattn_ss is not mod.flashattn_ts


def test_budgets_refuse_oversized_tiles():
    fwd, ws = load_script(MHA_FWD), load_script(GEMM_WS)
    with pytest.raises(ValueError, match="shared memory"):
        fwd.check_config("wasp", 128, dict(block_M=128, block_N=128, num_stages=4))
    with pytest.raises(ValueError, match="shared memory"):
        ws.check_tiles(dict(block_M=128, block_N=256, block_K=64, num_stages=4))


# ----------------------------------------------------------------------------- command lines
def test_variant_choices():
    for script, ok, bad in ((MHA_FWD, "wasp", "xx"), (GQA_FWD, "ts", "wasp")):
        parser = load_script(script).build_parser()
        assert parser.parse_args(["--variant", ok]).variant == ok
        with pytest.raises(SystemExit):
            parser.parse_args(["--variant", bad])


@pytest.mark.parametrize("script", [GQA_FWD, GQA_BWD])
@pytest.mark.parametrize("groups", ["0", "-2", "5"])
def test_groups_validated(script, groups, capsys):
    with pytest.raises(SystemExit):
        load_script(script).main(["--heads", "32", "--groups", groups, "--compile-only"])
    assert "--groups" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script", ATTN_SCRIPTS + [GEMM, GEMM_WS])
def test_main_without_gpu_points_at_compile_only(script):
    with pytest.raises(SystemExit) as exc:
        load_script(script).main([])
    msg = str(exc.value.code)
    assert "--compile-only --arch sm_100a" in msg and "\n" not in msg


def test_compile_only_main_gemm(capsys):
    load_script(GEMM).main(["--compile-only", "--m", "256", "--n", "256", "--k", "128"])
    out = capsys.readouterr().out
    assert "built for sm_100a" in out and "tcgen05" in out and "tmem" in out


# ----------------------------------------------------------------------------- references
def _inputs(Sq, Sk, Hq, Hkv, Dh=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, Sq, Hq, Dh), (2, Sk, Hkv, Dh), (2, Sk, Hkv, Dh)]
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def _sdpa(q, k, v, causal):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    groups = qh.shape[1] // kh.shape[1]
    kh, vh = (t.repeat_interleave(groups, dim=1) for t in (kh, vh))
    mask = None
    if causal:
        Sq, Sk = qh.shape[2], kh.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("script", ATTN_SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(17, 17), (9, 30), (1, 5)])
def test_reference_matches_sdpa_math(script, causal, Sq, Sk):
    hkv = 2 if "gqa" in script else 4
    q, k, v = _inputs(Sq, Sk, 4, hkv)
    out = load_script(script).ref_program(q, k, v, causal=causal)
    torch.testing.assert_close(out, _sdpa(q, k, v, causal), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("script", [MHA_BWD, GQA_BWD])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_reference_grads_match_autograd_of_sdpa(script, causal):
    hkv = 2 if script == GQA_BWD else 4
    q, k, v = (t.requires_grad_() for t in _inputs(12, 20, 4, hkv))
    dout = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(load_script(script).ref_program(q, k, v, causal), (q, k, v), dout)
    want = torch.autograd.grad(_sdpa(q, k, v, causal), (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_gemm_reference():
    for script in (GEMM, GEMM_WS):
        a, b = torch.randn(33, 17).bfloat16(), torch.randn(17, 9).bfloat16()
        want = torch.matmul(a.double(), b.double()).bfloat16()  # fp32 accumulation, bf16 out
        torch.testing.assert_close(load_script(script).ref_program(a, b), want)


@pytest.mark.parametrize("script", ATTN_SCRIPTS)
def test_bad_input_is_value_error(script):
    mod = load_script(script)
    hkv = 2 if "gqa" in script else 4
    q, k, v = (t.half() for t in _inputs(16, 16, 4, hkv, Dh=64))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        mod.attention(q.float(), k, v)
    with pytest.raises(ValueError, match="head dim"):
        mod.attention(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="CUDA tensor"):
        mod.attention(q, k, v)
    if "gqa" in script:
        q3 = _inputs(16, 16, 3, 2, Dh=64)[0].half()
        with pytest.raises(ValueError, match="H % Hkv"):
            mod.attention(q3, k, v)


# ----------------------------------------------------------------------------- Blackwell GPU
def _is_sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)


blackwell = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _is_sm100(), reason="needs an SM100 (Blackwell) GPU"),
]


@pytest.mark.parametrize("variant", ["ss", "ts", "wasp"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (255, 255), (1000, 1000), (17, 300), (300, 17)])
@pytest.mark.usefixtures("poisoned_empty")
def test_gpu_mha_forward(variant, causal, Sq, Sk):
    mod = load_script(MHA_FWD)
    q, k, v = (t.cuda().bfloat16() for t in _inputs(Sq, Sk, 4, 4, Dh=128, dtype=torch.float32))
    out, lse = mod.attention(q, k, v, causal, return_lse=True, variant=variant)
    ref, ref_lse = mod.ref_program(q, k, v, causal, return_lse=True)
    assert rel_err(out, ref) < 1e-2  # fp16/bf16 forward
    assert rel_err(lse, ref_lse) < 1e-3  # fp32 statistics


for _m in blackwell:
    test_gpu_mha_forward = _m(test_gpu_mha_forward)


@pytest.mark.parametrize("variant", ["ss", "ts"])
@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.usefixtures("poisoned_empty")
def test_gpu_gqa_forward(variant, groups, causal):
    mod = load_script(GQA_FWD)
    inputs = _inputs(1000, 1000, 8, 8 // groups, Dh=64, dtype=torch.float32)
    q, k, v = (t.cuda().half() for t in inputs)
    out = mod.attention(q, k, v, causal, variant=variant)
    assert rel_err(out, mod.ref_program(q, k, v, causal)) < 1e-2  # fp16/bf16 forward


@pytest.mark.parametrize("script", [MHA_BWD, GQA_BWD])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(255, 255), (1000, 1000), (100, 300)])
def test_gpu_backward(script, causal, Sq, Sk):
    mod = load_script(script)
    hkv = 2 if script == GQA_BWD else 8
    inputs = _inputs(Sq, Sk, 8, hkv, Dh=128, dtype=torch.float32)
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in inputs)
    dout = torch.randn_like(q)
    out = mod.attention(q, k, v, causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = mod.ref_program(q, k, v, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert rel_err(out, ref) < 1e-2  # forward
    for g, rg in zip(grads, ref_grads, strict=True):
        assert rel_err(g, rg) < 2e-2  # gradients


@pytest.mark.parametrize("script", [GEMM, GEMM_WS])
def test_gpu_gemm(script):
    mod = load_script(script)
    a = torch.randn(1000, 777, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(777, 1500, device="cuda", dtype=torch.bfloat16)
    assert rel_err(mod.matmul(a, b), torch.matmul(a.float(), b.float())) < 1e-2


for _t in ("test_gpu_gqa_forward", "test_gpu_backward", "test_gpu_gemm"):
    for _m in blackwell:
        globals()[_t] = _m(globals()[_t])
