"""The rules every script applies to its input, the same way on the command line and in the
torch-facing function: which --arch a script offers, which sizes and head dims it takes. Refusals
are one-line argparse errors (exit code 2) or ValueErrors naming the argument, found on a machine
without a GPU.

example_mha_bwd_wgmma_pipelined.py is left out here while it is being reworked."""

import pytest
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
    # the generic (non-Hopper) tiles of default_config build there: test_gqa_bwd_builds_for_sm80
    "flash_attention/example_gqa_bwd.py": (("sm_80", "sm_89", "sm_90a", "sm_100a"), (64, 128, 192)),
    "flash_attention/example_gqa_bwd_tma_reduce.py": (HOPPER, (64, 128, 192)),
    "flash_attention/example_mha_fwd_varlen.py": (HOPPER, (64, 128)),
    "flash_attention/example_gqa_fwd_varlen.py": (HOPPER, (64, 128)),
    "flash_attention/example_gqa_bwd_tma_reduce_varlen.py": (HOPPER, (64, 128)),
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
