"""Small ragged causal forwards + backwards of the hand-scheduled backward — MHA, and GQA
(example_gqa_bwd.py's group strategy, four query heads a kv head) — for compute-sanitizer (not
collected by pytest). On an H100, from the repository root:

    python tests/sanitize_case.py                      # compile once (TileLang caches it)
    compute-sanitizer --tool memcheck python tests/sanitize_case.py
    compute-sanitizer --tool racecheck python tests/sanitize_case.py
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import load_script  # noqa: E402

mha = load_script("flash_attention/example_mha_bwd_wgmma_pipelined.py")
gqa = load_script("flash_attention/example_gqa_bwd.py")
for name, attention, H, Hkv in (("MHA", mha.attention, 2, 2), ("GQA", gqa.attention, 4, 1)):
    for D in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (
            torch.randn(1, S, heads, D, generator=g, device="cuda", dtype=torch.bfloat16)
            for S, heads in ((200, H), (333, Hkv), (333, Hkv), (200, H))
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        print(f"{name} D{D}: finite", all(bool(torch.isfinite(t).all()) for t in (out, *grads)))
