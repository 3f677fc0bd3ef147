"""The rules every script applies to its input, the same way on the command line and in the
torch-facing function: which --arch a script offers, which sizes and head dims it takes. Refusals
are one-line argparse errors (exit code 2) or ValueErrors naming the argument, found on a machine
without a GPU."""

import math

import numpy as np
import pytest
import torch
from helpers import load_script

HOPPER, BLACKWELL = ("sm_90a",), ("sm_100a",)
ARCHS = ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a")  # what a user might ask for
# script: (the --arch values it builds for, the head dims its attention function takes)
SCRIPTS = {
    "flash_attention/example_mha_fwd_bshd.py": (HOPPER, (64, 128, 256)),
    "flash_attention/example_mha_fwd_bhsd.py": (HOPPER, (64, 128, 256)),
    "flash_attention/example_gqa_fwd_bshd.py": (HOPPER, (64, 128, 256)),
    "flash_attention/example_mha_bwd_bshd.py": (HOPPER, (64, 128)),
    "flash_attention/example_mha_bwd_bhsd.py": (HOPPER, (64, 128)),
    "flash_attention/example_mha_bwd_wgmma_pipelined.py": (HOPPER, (64, 128)),
    # the generic (non-Hopper) tiles of default_config build there: test_gqa_bwd_builds_for_sm80
    "flash_attention/example_gqa_bwd.py": (("sm_80", "sm_89", "sm_90a", "sm_100a"), (64, 128, 192)),
    "flash_attention/example_gqa_bwd_tma_reduce.py": (HOPPER, (64, 128, 192)),
    "flash_attention/example_mha_fwd_varlen.py": (HOPPER, (64, 128)),
    "flash_attention/example_gqa_fwd_varlen.py": (HOPPER, (64, 128)),
    "flash_attention/example_gqa_bwd_tma_reduce_varlen.py": (HOPPER, (64, 128)),
    "attention_sink/example_gqa_sink_fwd_bhsd.py": (HOPPER, (64, 128)),
    "attention_sink/example_gqa_sink_fwd_varlen.py": (HOPPER, (64, 128)),
    "flash_attention_sm100/mha_fwd_bshd.py": (BLACKWELL, (64, 128)),
    "flash_attention_sm100/gqa_fwd_bshd.py": (BLACKWELL, (64, 128)),
    "flash_attention_sm100/mha_bwd_bshd.py": (BLACKWELL, (64, 128)),
    "flash_attention_sm100/gqa_bwd_bshd.py": (BLACKWELL, (64, 128)),
}
GEMMS = ["gemm_sm100/gemm_tcgen5mma.py", "gemm_sm100/gemm_tcgen5mma_ws.py"]


def refused(script, argv, capsys):
    """main(argv) stops in argparse: exit code 2, the reason on the last line of stderr."""
    with pytest.raises(SystemExit) as exc:
        load_script(script).main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- command line
@pytest.mark.parametrize("script", [*SCRIPTS, *GEMMS])
@pytest.mark.parametrize("arch", ARCHS)
def test_arch_choices_are_what_the_script_builds(script, arch, capsys):
    supported = SCRIPTS[script][0] if script in SCRIPTS else BLACKWELL
    parser = load_script(script).build_parser()
    assert parser.parse_args([]).arch == ("sm_100a" if supported == BLACKWELL else "sm_90a")
    if arch in supported:
        assert parser.parse_args(["--arch", arch]).arch == arch
    else:
        last = refused(script, ["--compile-only", "--arch", arch], capsys)
        assert "--arch" in last and "invalid choice" in last


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("dim", [32, 64, 96, 128, 192, 256])
def test_dim_choices_are_the_head_dims_attention_takes(script, dim, capsys):
    if dim in SCRIPTS[script][1]:
        assert load_script(script).build_parser().parse_args(["--dim", str(dim)]).dim == dim
    else:
        last = refused(script, ["--compile-only", "--dim", str(dim)], capsys)
        assert "--dim" in last and "invalid choice" in last


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag", ["--batch", "--heads", "--seq_len", "--seq_len_k"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_sizes_must_be_positive_integers(script, flag, value, capsys):
    last = refused(script, ["--compile-only", flag, value], capsys)
    assert flag in last and value in last


@pytest.mark.parametrize("script", GEMMS)
@pytest.mark.parametrize("flag", ["--m", "--n", "--k"])
def test_gemm_sizes_must_be_positive_integers(script, flag, capsys):
    assert flag in refused(script, ["--compile-only", flag, "0"], capsys)


def test_gqa_bwd_builds_for_sm80(capsys):
    """The one Hopper script that offers other archs: all its kernels build for one of them."""
    argv = ["--compile-only", "--arch", "sm_80", "--heads", "8", "--seq_len", "255", "--causal"]
    load_script("flash_attention/example_gqa_bwd.py").main(argv)
    assert "built for sm_80" in capsys.readouterr().out


# ----------------------------------------------------------------------------- torch-facing
def arguments(script, B=2, Sq=5, Sk=7, D=64, Hkv=None, device="cpu", dtype=torch.float16):
    """Valid keyword arguments for the script's attention function (``attention_varlen`` for the
    packed scripts: B sequences of Sq queries and Sk keys)."""
    H, Hkv = 4, (2 if "gqa" in script else 4) if Hkv is None else Hkv
    pairs = script.endswith(("example_gqa_bwd.py", "example_gqa_bwd_tma_reduce.py"))
    Dv = 128 if pairs and D == 192 else D  # their (Dqk, Dv) pairs: 192 goes with 128

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    if "varlen" in script:
        cu_q, cu_k = (
            torch.tensor([S * b for b in range(B + 1)], dtype=torch.int32) for S in (Sq, Sk)
        )
        return dict(
            q=randn(B * Sq, H, D), k=randn(B * Sk, Hkv, D), v=randn(B * Sk, Hkv, Dv),
            cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
            max_seqlen_q=Sq, max_seqlen_k=Sk,
        )  # fmt: skip
    if "bhsd" in script:
        return dict(q=randn(B, H, Sq, D), k=randn(B, Hkv, Sk, D), v=randn(B, Hkv, Sk, Dv))
    return dict(q=randn(B, Sq, H, D), k=randn(B, Sk, Hkv, D), v=randn(B, Sk, Hkv, Dv))


def call(script, **kwargs):
    mod = load_script(script)
    return (mod.attention_varlen if "varlen" in script else mod.attention)(**kwargs)


NOT_A_SCALE = [math.nan, math.inf, -math.inf, 0, -1, -0.5, "abc", "0.5", [0.5], torch.tensor(0.5)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_softmax_scale_must_be_a_finite_positive_number(script):
    """Refused before any tensor is looked at (the tensors here are not even tensors), so the
    message names softmax_scale on any machine; a good scale gets as far as the device check."""
    blank = {name: None for name in arguments(script)}
    for scale in NOT_A_SCALE:
        with pytest.raises(ValueError, match="softmax_scale"):
            call(script, **blank, softmax_scale=scale)
            pytest.fail(f"accepted softmax_scale={scale!r}")
    for scale in (None, 0.125, 2, np.float32(0.5)):
        with pytest.raises(ValueError, match="CUDA tensor"):
            call(script, **arguments(script), softmax_scale=scale)


@pytest.mark.parametrize("script", SCRIPTS)
def test_causal_must_be_a_bool(script):
    blank = {name: None for name in arguments(script)}
    for causal in ("False", "True", 0, 1, None):
        with pytest.raises(ValueError, match="causal"):
            call(script, **blank, causal=causal)
            pytest.fail(f"accepted causal={causal!r}")
    for causal in (False, True):
        with pytest.raises(ValueError, match="CUDA tensor"):
            call(script, **arguments(script), causal=causal)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("dim", [32, 64, 96, 128, 192, 256])
def test_attention_takes_the_head_dims_the_command_line_offers(script, dim):
    expect = "CUDA tensor" if dim in SCRIPTS[script][1] else "head dim"
    with pytest.raises(ValueError, match=expect):
        call(script, **arguments(script, D=dim))


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "gqa" in s])
def test_no_kv_heads_is_a_value_error(script):
    with pytest.raises(ValueError, match=r"H % Hkv"):
        call(script, **arguments(script, Hkv=0))


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "varlen" in s])
@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_must_be_contiguous(script, name):
    """A strided view would be read as if dense by the kernel's host code."""
    kwargs = arguments(script)
    kwargs[name] = torch.stack([kwargs[name], kwargs[name]], dim=1)[:, 0]  # same values, stride 2
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        call(script, **kwargs)
    kwargs[name] = kwargs[name].contiguous()
    with pytest.raises(ValueError, match="CUDA tensor"):
        call(script, **kwargs)


EMPTY = {
    "B=0": dict(B=0),
    "Sq=0": dict(Sq=0),
    "Sk=0": dict(Sk=0),
    "B=Sq=Sk=0": dict(B=0, Sq=0, Sk=0),
}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("empty", EMPTY)
def test_empty_inputs_are_valid_input(script, empty):
    """One rule for every script: an empty batch or sequence is accepted (the device check, the
    last, is all that is left on a CPU); what it returns is tested on a GPU below."""
    with pytest.raises(ValueError, match="CUDA tensor"):
        call(script, **arguments(script, **EMPTY[empty]))


@pytest.mark.gpu
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("empty", EMPTY)
def test_empty_inputs_return_empty_or_zero_outputs_without_a_kernel(script, empty, monkeypatch):
    """B = 0 or Sq = 0: correctly shaped empty outputs; Sk = 0 with queries: every row sees no
    key, so out 0 and lse +inf; gradients (backward scripts) 0 in the inputs' shapes. No kernel
    is built or launched, so this runs on any GPU (the SM100 scripts' too)."""
    from tilelang.jit import JITImpl

    mod = load_script(script)
    for name, value in vars(mod).items():  # building any kernel fails the test
        if isinstance(value, JITImpl) or name in ("build_forward", "build_kernels"):
            monkeypatch.setattr(mod, name, lambda *a, _n=name, **kw: pytest.fail(f"{_n} called"))
    kwargs = arguments(script, device="cuda", **EMPTY[empty])
    q, k, v = (kwargs[n] for n in "qkv")
    if "bwd" in script:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = call(script, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        for t, g in zip((q, k, v), grads, strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype and torch.all(g == 0)
    else:
        out, lse = call(script, **kwargs, return_lse=True)
        if "varlen" in script:
            rows = (q.shape[1], q.shape[0])  # [H, total_q]
        else:
            rows = q.shape[:3] if "bhsd" in script else (q.shape[0], q.shape[2], q.shape[1])
        assert lse.shape == rows and lse.dtype == torch.float32
        assert torch.all(torch.isposinf(lse))
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    assert torch.all(out == 0)
