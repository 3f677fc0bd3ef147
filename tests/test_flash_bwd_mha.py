"""MHA backward scripts (BSHD, BHSD, and the hand-scheduled one where its API is the same):
reference gradients, command lines, sm_90a builds, bad input (CPU) and the gradient matrix on a
GPU (marker ``gpu``). The hand-scheduled kernel's own build and GPU checks are in
test_flash_bwd_fast.py."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import load_script, rel_err

BSHD = "flash_attention/example_mha_bwd_bshd.py"
BHSD = "flash_attention/example_mha_bwd_bhsd.py"
PIPELINED = "flash_attention/example_mha_bwd_wgmma_pipelined.py"
SCRIPTS = [BSHD, BHSD, PIPELINED]
PLAIN = [BSHD, BHSD]  # the scripts on TileLang's automatic pipeline


def make_inputs(script, B, Sq, Sk, H, D, dtype=torch.float32, device="cpu", scale=1.0):
    """q, k, v (leaves requiring grad) and dout in the script's layout; normal values, q and k
    times ``scale`` (scale 10 gives large logits)."""
    g = torch.Generator(device=device).manual_seed(B * 1000 + Sq * 7 + Sk + D)

    def randn(S, s=1.0):
        shape = (B, H, S, D) if script == BHSD else (B, S, H, D)
        return (torch.randn(shape, generator=g, device=device) * s).to(dtype)

    q, k, v = randn(Sq, scale), randn(Sk, scale), randn(Sk)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), randn(Sq)


def seq_slice(script, t, start, stop=None):
    """t[..., start:stop along the sequence dim, ...] in the script's layout."""
    return t[:, :, start:stop] if script == BHSD else t[:, start:stop]


def sdpa_math(q, k, v, causal, script):
    """Torch's math SDPA with an explicit bottom-right causal mask, in the script's layout."""
    if script != BHSD:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = None
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if script == BHSD else out.transpose(1, 2)


def grads_of(fn, q, k, v, dout, **kw):
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(33, 33), (17, 40), (5, 5)])
def test_reference_grads_match_sdpa_math(script, causal, Sq, Sk):
    """Autograd through ref_program = autograd through torch's SDPA math, in float64."""
    mod = load_script(script)
    q, k, v, dout = make_inputs(script, 2, Sq, Sk, 3, 16, torch.float64)
    got = grads_of(mod.ref_program, q, k, v, dout, causal=causal)
    ref = grads_of(sdpa_math, q, k, v, dout, causal=causal, script=script)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_rows_without_keys(script):
    """Causal, Sq > Sk: the first Sq−Sk rows see no key → out 0 and dq 0 (never NaN); the other
    rows, and dk, dv, are those of the problem without the empty rows."""
    mod = load_script(script)
    Sq, Sk = 12, 5
    q, k, v, dout = make_inputs(script, 2, Sq, Sk, 2, 16, torch.float64)
    out, dq, dk, dv = grads_of(mod.ref_program, q, k, v, dout, causal=True)
    assert torch.all(seq_slice(script, out, 0, Sq - Sk) == 0)
    assert torch.all(seq_slice(script, dq, 0, Sq - Sk) == 0)
    q_tail = seq_slice(script, q, Sq - Sk).detach().requires_grad_()
    dout_tail = seq_slice(script, dout, Sq - Sk)
    ref = grads_of(sdpa_math, q_tail, k, v, dout_tail, causal=True, script=script)
    got = (seq_slice(script, out, Sq - Sk), seq_slice(script, dq, Sq - Sk), dk, dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_softmax_scale(script):
    mod = load_script(script)
    q, k, v, _ = make_inputs(script, 1, 8, 8, 2, 16, torch.float64)
    a = mod.ref_program(q, k, v, softmax_scale=0.5)
    b = mod.ref_program(q * (0.5 * 4.0), k, v)  # default scale is 1/sqrt(16) = 1/4
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_grads_batch_chunked(script):
    """reference_grads (one batch entry at a time, float32) = autograd over the whole batch."""
    mod = load_script(script)
    q, k, v, dout = make_inputs(script, 3, 9, 14, 2, 16, torch.float64)
    got = mod.reference_grads(q, k, v, dout, True, 0.3)
    ref = grads_of(mod.ref_program, q, k, v, dout, causal=True, softmax_scale=0.3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_command_line(script):
    parser = load_script(script).build_parser()
    assert parser.parse_args([]).causal is False
    assert parser.parse_args(["--causal"]).causal is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--causal", "False"])  # a store_true flag takes no value
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float32"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_unsupported_dim_is_a_command_line_error(script, capsys):
    with pytest.raises(SystemExit):
        load_script(script).main(["--dim", "256", "--compile-only"])
    assert "--dim" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script", SCRIPTS)
def test_main_without_gpu_says_so(script):
    with pytest.raises(SystemExit) as exc:
        load_script(script).main(["--seq_len", "128"])
    assert "--compile-only" in str(exc.value.code)


@pytest.mark.parametrize("script", PLAIN)
def test_default_config_is_in_tune_space(script):
    mod = load_script(script)
    for seq_q in (None, 17, 4096):
        assert mod.default_config("sm_90a", seq_q) in mod.tune_configs()


@pytest.mark.parametrize("dim", [64, 128])
def test_pipelined_default_config_is_in_tune_space(dim):
    mod = load_script(PIPELINED)
    assert mod.default_config(dim, "sm_90a") in mod.tune_configs(dim)


@pytest.mark.parametrize("script", PLAIN)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_kernel_builds_for_sm90(script, dim, causal):
    """Forward, preprocess, backward and postprocess build for sm_90a with the default tiles,
    ragged Sq != Sk. The forward and backward GEMMs are WGMMA fed by TMA loads; dQ goes out as
    vectorised float32 atomics (the whole-tile atomic add, not one scalar atomic per element)."""
    mod = load_script(script)
    src = mod.compile_all(2, 4, 1000, 777, dim, causal, "bfloat16", "sm_90a")
    assert set(src) == {
        "flashattn_fwd",
        "flashattn_bwd_preprocess",
        "flashattn_bwd",
        "flashattn_bwd_postprocess",
    }
    for name in ("flashattn_fwd", "flashattn_bwd"):
        assert "wgmma" in src[name], f"{name}: T.gemm on shared operands should become WGMMA"
        assert "tma_load" in src[name], f"{name}: tile copies should become TMA loads"
    bwd = src["flashattn_bwd"]
    assert "wgmma_rs" in bwd, "dV += Pᵀ dO and dK += dSᵀ Q take their A operand from registers"
    assert re.search(r"AtomicAddx[24]\(", bwd), "dQ atomics should be vectorised"
    assert "atomic" not in src["flashattn_fwd"].lower()
    assert "wait_wgmma<1>" not in bwd  # T.gemm waits for its own WGMMA


@pytest.mark.parametrize("script", PLAIN)
def test_short_query_config_builds_for_sm90(script):
    """Fewer queries than a 64-query step (Sq=17, D=128) once failed in ptxas: the default
    config must step 32 queries there, and that kernel must build."""
    mod = load_script(script)
    assert mod.default_config("sm_90a", seq_q=17)["block_N"] == 32
    assert mod.default_config("sm_90a", seq_q=4096)["block_N"] == 64
    src = mod.compile_all(1, 4, 17, 17, 128, False, "bfloat16", "sm_90a")
    assert "wgmma" in src["flashattn_bwd"]


@pytest.mark.parametrize("script", PLAIN)
def test_single_key_block_causal_builds_for_sm90(script):
    """Causal, one key block, Sq > Sk (D=128, Sq 255, Sk 17): ptxas once ran out of registers
    here while bx was the constant 0 of a grid of extent 1. The grid now has a second thread
    block, which leaves at once (its keys start past Sk)."""
    mod = load_script(script)
    src = mod.compile_all(2, 4, 255, 17, 128, True, "bfloat16", "sm_90a")["flashattn_bwd"]
    assert "if (((int)blockIdx.x) < 1) {" in src


@pytest.mark.parametrize("script", [BSHD])
def test_tune_space_builds_for_sm90(script):
    """Every configuration ``--tune`` compares builds at D=128 (the tighter head dim)."""
    import harness

    mod = load_script(script)
    for cfg in mod.tune_configs():
        args = (1, 4, 1000, 1000, 128, True, 1 / math.sqrt(128), "float16")
        src = harness.compile_for(mod.flashattn_bwd, "sm_90a", *args, **cfg).get_kernel_source()
        assert "wgmma" in src and "AtomicAdd" in src, cfg


@pytest.mark.parametrize("script", PLAIN)
def test_compile_only_main(script, capsys):
    # the same shapes as test_every_kernel_builds_for_sm90: TileLang's kernel cache serves them
    argv = ["--compile-only", "--batch", "2", "--heads", "4", "--seq_len", "1000"]
    argv += ["--seq_len_k", "777", "--dim", "64", "--dtype", "bfloat16"]
    load_script(script).main(argv)
    out = capsys.readouterr().out
    assert "built for sm_90a" in out
    for name in ("flashattn_fwd", "flashattn_bwd_preprocess", "flashattn_bwd:"):
        assert name in out
    assert "flashattn_bwd_postprocess" in out


def _bad_inputs(script):
    """(description, q, k, v, expected message fragment) for every rejected input."""
    q, k, v, _ = make_inputs(script, 1, 16, 16, 4, 64, torch.float16)
    q, k, v = (t.detach() for t in (q, k, v))
    seq_dim = 2 if script == BHSD else 1
    head_dim = 1 if script == BHSD else 2
    k2, v2 = (t.narrow(head_dim, 0, 2) for t in (k, v))
    strided = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    return [
        ("float32", q.float(), k, v, "float16 or bfloat16"),
        ("mixed dtypes", q, k.bfloat16(), v, "share a dtype"),
        ("rank 3", q[0], k, v, "q must be"),
        ("k/v shapes differ", q, k, v.narrow(seq_dim, 0, 8), "same shape"),
        ("head dim 32", q[..., :32], k[..., :32], v[..., :32], "head dim"),
        ("head dim 256", *(torch.cat([t, t, t, t], -1) for t in (q, k, v)), "head dim"),
        ("head dim mismatch", q, k[..., :32], v[..., :32], "k must be"),
        ("strided last dim", q, strided, v, "last dimension"),
        ("MHA given fewer kv heads", q, k2, v2, "heads"),
        ("CPU tensors", q, k, v, "CUDA tensor"),
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_raises_value_error_naming_argument(script):
    mod = load_script(script)
    for what, q, k, v, fragment in _bad_inputs(script):
        with pytest.raises(ValueError, match=fragment):
            mod.attention(q, k, v)
            pytest.fail(f"accepted bad input: {what}")


# ----------------------------------------------------------------------------- GPU
def _gpu_cases():
    """A covering set of the gradient matrix: S in {17, 255, 1000, 4096}, batch 1 and 2, D 64
    and 128, causal and not, fp16 and bf16, Sq != Sk both ways, large logits; each script."""
    f16, bf16 = torch.float16, torch.bfloat16
    cases = []  # (script, B, Sq, Sk, H, D, causal, dtype, input scale)
    for D in (64, 128):
        for S in (17, 255, 1000, 4096):
            for causal in (False, True):
                dtype = (f16, bf16)[(S + D // 64 + causal) % 2]
                B = 1 if S in (17, 4096) else 2
                cases.append((BSHD, B, S, S, 2 if S == 4096 else 4, D, causal, dtype, 1))
    cases += [
        (BSHD, 2, 255, 1000, 4, 128, True, f16, 1),  # fewer queries than keys
        (BSHD, 1, 1000, 255, 4, 64, True, bf16, 1),  # 745 rows see no key: out 0, dq 0
        (BSHD, 2, 1000, 17, 4, 128, True, bf16, 1),  # 983 rows see no key
        (BSHD, 2, 255, 17, 4, 128, True, f16, 1),  # one key block: a grid of two thread blocks
        (BSHD, 1, 17, 4096, 4, 128, False, bf16, 1),
        (BSHD, 2, 1000, 1000, 4, 128, True, bf16, 10),  # large logits
        (BSHD, 2, 1000, 1000, 4, 64, False, f16, 10),
    ]
    for D, S, causal, dtype in (
        (64, 17, True, f16),
        (128, 17, False, bf16),
        (64, 1000, False, bf16),
        (128, 1000, True, f16),
    ):
        cases.append((BHSD, 2, S, S, 4, D, causal, dtype, 1))
    cases += [
        (BHSD, 2, 255, 1000, 4, 64, True, bf16, 1),
        (BHSD, 1, 1000, 255, 4, 128, True, f16, 1),
        (BHSD, 2, 255, 17, 4, 128, True, bf16, 1),
    ]
    return cases


def _case_id(case):
    script, B, Sq, Sk, H, D, causal, dtype, scale = case
    name = script.split("example_mha_bwd_")[1].removesuffix(".py")
    dt = "f16" if dtype == torch.float16 else "bf16"
    c = "causal" if causal else "full"
    return f"{name}-B{B}-Sq{Sq}-Sk{Sk}-H{H}-D{D}-{c}-{dt}" + ("-x10" if scale != 1 else "")


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=_case_id)
def test_gradients_match_reference(case, poisoned_empty):
    """out, dq, dk, dv against autograd through ref_program in float32; every buffer the
    kernels write starts as NaN (poisoned_empty), so an unwritten element fails."""
    script, B, Sq, Sk, H, D, causal, dtype, scale = case
    mod = load_script(script)
    q, k, v, dout = make_inputs(script, B, Sq, Sk, H, D, dtype, "cuda", scale)
    out, dq, dk, dv = grads_of(mod.attention, q, k, v, dout, causal=causal)
    ref_out, ref_dq, ref_dk, ref_dv = mod.reference_grads(q, k, v, dout, causal, D**-0.5)
    assert rel_err(out, ref_out) < 1e-2  # fp16/bf16 forward
    for name, got, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert got.dtype == dtype and got.shape == ref.shape, name
        err = rel_err(got, ref)
        assert err < 2e-2, f"{name}: relative error {err:.3e}"  # fp16/bf16 gradients
    if causal and Sq > Sk:  # rows that see no key: exactly 0, never NaN
        assert torch.all(seq_slice(script, out, 0, Sq - Sk) == 0)
        assert torch.all(seq_slice(script, dq, 0, Sq - Sk) == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
def test_expanded_dout_and_softmax_scale(script, poisoned_empty):
    """loss = out.sum(): autograd hands the backward a stride-0 dout; and a non-default scale."""
    mod = load_script(script)
    q, k, v, _ = make_inputs(script, 2, 300, 300, 4, 128, torch.bfloat16, "cuda")
    out = mod.attention(q, k, v, causal=True, softmax_scale=0.05)
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref = mod.reference_grads(q, k, v, torch.ones_like(out), True, 0.05)
    for name, got, expect in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[1:], strict=True):
        assert rel_err(got, expect) < 2e-2, name  # fp16/bf16 gradients


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
def test_empty_sequences(script):
    """Sk = 0: out 0, dq 0; Sq = 0: empty out, dk = dv = 0. Nothing is launched."""
    mod = load_script(script)
    q, k, v, dout = make_inputs(script, 2, 5, 0, 4, 64, torch.float16, "cuda")
    out, dq, dk, dv = grads_of(mod.attention, q, k, v, dout)
    assert torch.all(out == 0) and torch.all(dq == 0) and dk.numel() == 0
    q, k, v, dout = make_inputs(script, 2, 0, 7, 4, 64, torch.float16, "cuda")
    out, dq, dk, dv = grads_of(mod.attention, q, k, v, dout)
    assert out.shape == q.shape and torch.all(dk == 0) and torch.all(dv == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("extra", [[], ["--causal", "--dtype", "bfloat16", "--seq_len_k", "700"]])
def test_main_small(script, extra, capsys):
    argv = ["--batch", "1", "--heads", "4", "--seq_len", "300", "--dim", "64", *extra]
    load_script(script).main(argv)
    out = capsys.readouterr().out
    for name in ("out ", "dq ", "dk ", "dv "):
        assert name in out
    assert "forward+backward" in out and "tilelang" in out
