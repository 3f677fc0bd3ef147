"""One small ragged causal forward + backward of the hand-scheduled backward, for
compute-sanitizer (not collected by pytest). On an H100, from the repository root:

    python tests/sanitize_case.py                      # compile once (TileLang caches it)
    compute-sanitizer --tool memcheck python tests/sanitize_case.py
    compute-sanitizer --tool racecheck python tests/sanitize_case.py
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import load_script  # noqa: E402

mod = load_script("flash_attention/example_mha_bwd_wgmma_pipelined.py")
for D in (64, 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, S, 2, D, generator=g, device="cuda", dtype=torch.bfloat16)
        for S in (200, 333, 333, 200)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = mod.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    print(f"D{D}: finite", all(bool(torch.isfinite(t).all()) for t in (out, *grads)))
