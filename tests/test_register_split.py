"""The hand-scheduled Hopper forwards split the register file with setmaxnreg: the producer
warpgroup gives registers up, the consumers take them. setmaxnreg only moves registers within
the allocation a thread block got at launch (65536 over ctas_per_sm thread blocks, a thread's
share rounded down to 8); a request beyond it waits forever. These CPU checks read the split
from each kernel's TIR for every number of consumer warpgroups a config can ask for, and the
GPU test runs the four-warpgroup tiles (block_M = 256), which hung the GPU before the split was
computed from the launch allocation."""

import re

import pytest
import torch
from helpers import load_script, rel_err

SCALE = 0.125
# script: (the kernel factory's name, its arguments before the tiles at D = 64)
FORWARDS = {
    "flash_attention/example_mha_fwd_bshd.py": ("flashattn_fwd", (1, 8, 700, 700, 64, True)),
    "flash_attention/example_mha_fwd_bhsd.py": ("flashattn_fwd", (1, 8, 700, 700, 64, True)),
    "flash_attention/example_gqa_fwd_bshd.py": ("flashattn_fwd", (1, 8, 2, 700, 700, 64, True)),
    "flash_attention/example_mha_fwd_varlen.py": ("flashattn_fwd_varlen", (8, 64, True)),
    "flash_attention/example_gqa_fwd_varlen.py": ("flashattn_fwd_varlen", (8, 2, 64, True)),
    "attention_sink/example_gqa_sink_fwd_bhsd.py": (
        "flashattn_fwd",
        (1, 8, 2, 700, 700, 64, 128, 0, True),
    ),
    "attention_sink/example_gqa_sink_fwd_varlen.py": (
        "flashattn_fwd_varlen",
        (8, 2, 64, 128, 0, True),
    ),
}
SINK_BHSD = "attention_sink/example_gqa_sink_fwd_bhsd.py"


def split(script, **tiles):
    """(threads, thread blocks an SM, producer registers, consumer registers) of the kernel's
    TIR for these tiles."""
    name, args = FORWARDS[script]
    kw = {"num_sms": 132} if name == "flashattn_fwd" else {}
    tir = getattr(load_script(script), name).get_tir(
        *args, SCALE, "bfloat16", block_N=64, num_stages=2, **tiles, **kw
    )
    src = tir.script()
    threads = int(re.search(r'"tl.launch_threads": \[(\d+), 1, 1\]', src).group(1))
    ctas = re.search(r'"tl.min_blocks_per_sm", (\d+)', src)
    producer, consumer = (int(r) for r in re.findall(r"T.set_max_nreg\((\d+), [01]\)", src))
    return threads, int(ctas.group(1)) if ctas else 1, producer, consumer


CASES = [(s, dict(block_M=bm)) for s in FORWARDS for bm in (64, 128, 192, 256)] + [
    (SINK_BHSD, dict(block_M=64, q_stages=2, ctas_per_sm=2))
]


@pytest.mark.parametrize("script,tiles", CASES, ids=lambda x: str(x))
def test_register_split_fits_the_launch_allocation(script, tiles):
    threads, ctas, producer, consumer = split(script, **tiles)
    assert threads == 2 * tiles["block_M"] + 128  # a consumer warpgroup per 64 rows, a producer
    assert ctas == tiles.get("ctas_per_sm", 1)
    allocation = 65536 // (ctas * threads) // 8 * 8 * threads
    assert producer == 24 and consumer % 8 == 0 and consumer <= 240
    assert 128 * producer + (threads - 128) * consumer <= allocation
    # and takes what is left, to the multiple of 8 below it (the 240 cap aside)
    assert consumer == 240 or 128 * producer + (threads - 128) * (consumer + 8) > allocation


@pytest.mark.parametrize("ctas_per_sm,block_M", [(3, 64), (2, 128), (0, 64)])
def test_sink_forward_thread_blocks_an_sm(ctas_per_sm, block_M):
    """Two thread blocks an SM only with 64-row tiles (the measured pairing); other counts are
    refused before anything is built."""
    with pytest.raises(ValueError, match="ctas_per_sm"):
        split(SINK_BHSD, block_M=block_M, ctas_per_sm=ctas_per_sm)


@pytest.mark.gpu
@pytest.mark.parametrize("script", list(FORWARDS)[:3])
def test_four_consumer_warpgroups_run(script):
    """block_M = 256 (four consumer warpgroups at 112 registers) finishes and is correct: a
    ragged causal case with Sq != Sk against the script's reference."""
    mod = load_script(script)
    B, H, Sq, Sk, D = 2, 4, 300, 333, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    heads_kv = H // 2 if "gqa" in script else H

    def randn(S, heads):
        shape = (B, heads, S, D) if "bhsd" in script else (B, S, heads, D)
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.float16)

    q, k, v = randn(Sq, H), randn(Sk, heads_kv), randn(Sk, heads_kv)
    cfg = dict(mod.default_config(D, True, "sm_90a", Sk), block_M=256, block_N=64)
    out, lse = mod.attention(q, k, v, causal=True, return_lse=True, config=cfg)
    ref_out, ref_lse = mod.ref_program(q, k, v, causal=True, return_lse=True)
    assert rel_err(out, ref_out) < 1e-2
    assert rel_err(lse, ref_lse) < 1e-4
