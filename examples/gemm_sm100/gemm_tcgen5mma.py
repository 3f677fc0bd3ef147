"""GEMM on Blackwell (SM100) with TCGEN05 MMA: ``C = A @ B`` for ``A [M, K]``, ``B [K, N]``.

What it shows: the accumulator of a TCGEN05 MMA lives in tensor memory (TMEM, ``T.alloc_tmem``),
not in registers; one thread issues the MMA (``T.tcgen05_gemm``), which runs asynchronously and
arrives on an mbarrier when done (``mbar=``); ``T.mbarrier_wait_parity`` waits for it. Only the
epilogue moves the tile TMEM → registers → shared → global. This is the plain version — load,
multiply, wait, repeat; gemm_tcgen5mma_ws.py overlaps the loads with the MMAs.

Tiles are checked against SM100's 232448 bytes of shared memory per block (``smem_bytes``).
Status: tests/test_sm100.py compiles it for sm_100a and inspects the generated code; it has
not been run on Blackwell hardware yet. On a B200, ``main`` checks against torch.matmul and
benchmarks.

API:

    matmul(a, b, tiles=None)

    a: (M, K), b: (K, N), both float16 or both bfloat16, on a CUDA device.
    tiles: dict of block_M, block_N, block_K; default ``DEFAULT_TILES``.
    Returns c = a @ b: (M, N), in a's dtype (accumulated in float32).

Run:
    python examples/gemm_sm100/gemm_tcgen5mma.py --m 8192 --n 8192 --k 8192
    python examples/gemm_sm100/gemm_tcgen5mma.py --compile-only --arch sm_100a  # no GPU
"""

import argparse
import pathlib
import sys

import tilelang
import tilelang.language as T
import torch

PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one block may use on SM100 (227 KB)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@tilelang.jit(pass_configs=PASS_CONFIGS)
def gemm(M, N, K, dtype="bfloat16", block_M=128, block_N=256, block_K=64):
    accum_dtype = "float32"

    @T.prim_func
    def gemm(
        A: T.Tensor([M, K], dtype),
        B: T.Tensor([K, N], dtype),
        C: T.Tensor([M, N], dtype),
    ):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128) as (bx, by):
            A_shared = T.alloc_shared([block_M, block_K], dtype)
            B_shared = T.alloc_shared([block_K, block_N], dtype)
            C_shared = T.alloc_shared([block_M, block_N], dtype)
            C_tmem = T.alloc_tmem([block_M, block_N], accum_dtype)  # 128 lanes × 256 columns
            mma_done = T.alloc_barrier(1)
            C_local = T.alloc_fragment([block_M, block_N], accum_dtype)

            for k in T.serial(T.ceildiv(K, block_K)):
                T.copy(A[by * block_M, k * block_K], A_shared)
                T.copy(B[k * block_K, bx * block_N], B_shared)
                # clear_accum on the first K step starts the sum; later steps add into TMEM.
                T.tcgen05_gemm(A_shared, B_shared, C_tmem, clear_accum=k == 0, mbar=mma_done)
                # The next copy overwrites A_shared/B_shared: wait until the MMA has read them.
                T.mbarrier_wait_parity(mma_done, k % 2)

            T.copy(C_tmem, C_local)  # tcgen05.ld
            T.copy(C_local, C_shared)
            T.copy(C_shared, C[by * block_M, bx * block_N])

    return gemm


DEFAULT_TILES = dict(block_M=128, block_N=256, block_K=64)


def smem_bytes(block_M, block_N, block_K, elem_bytes=2):
    """A tile (M·K) + B tile (K·N) + C staging tile (M·N), 16-bit elements:
    128·64 + 64·256 + 128·256 = 57344 elements = 114688 bytes, under SM100's 232448."""
    return (block_M * block_K + block_K * block_N + block_M * block_N) * elem_bytes


def check_tiles(tiles):
    need = smem_bytes(**tiles)
    if need > SMEM_LIMIT:
        raise ValueError(f"{tiles}: {need} bytes of shared memory > {SMEM_LIMIT}")
    if tiles["block_N"] > 512:
        raise ValueError(f"{tiles}: the fp32 accumulator needs block_N <= 512 TMEM columns")


def matmul(a, b, tiles=None):
    """``a [M, K] @ b [K, N]`` (fp16/bf16, CUDA) with the TCGEN05 kernel."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b must be [M, K], [K, N]; got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise ValueError(f"a and b must share a float16/bfloat16 dtype, got {a.dtype}, {b.dtype}")
    tiles = tiles or DEFAULT_TILES
    check_tiles(tiles)
    dtype = "float16" if a.dtype == torch.float16 else "bfloat16"
    kernel = gemm(a.shape[0], b.shape[1], a.shape[1], dtype, **tiles)
    c = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    kernel(a.contiguous(), b.contiguous(), c)
    return c


def ref_program(a, b):
    return (a.float() @ b.float()).to(a.dtype)


def _harness():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for size in ("--m", "--n", "--k"):
        p.add_argument(size, type=_harness().positive_int, default=8192)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the benchmark")
    p.add_argument("--compile-only", action="store_true", help="build for --arch; needs no GPU")
    p.add_argument("--arch", choices=("sm_100a",), default="sm_100a")
    return p


def main(argv=None):
    harness = _harness()
    args = build_parser().parse_args(argv)
    script = pathlib.Path(__file__).name
    check_tiles(DEFAULT_TILES)
    if args.compile_only:
        kernel = harness.compile_for(gemm, args.arch, args.m, args.n, args.k, args.dtype)
        print(f"{script}: built for {args.arch} with {DEFAULT_TILES}")
        print(harness.describe_source("gemm", kernel.get_kernel_source()))
        return

    harness.require_gpu(script, arch="sm_100a", capability=(10, 0))
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    a = torch.randn(args.m, args.k, device="cuda", dtype=dtype)
    b = torch.randn(args.k, args.n, device="cuda", dtype=dtype)
    if args.check:
        # fp32 accumulation in both; the bf16/fp16 rounding of C dominates the difference
        harness.check_close("C", matmul(a, b), ref_program(a, b), rtol=1e-2)
    if args.bench:
        flops = 2.0 * args.m * args.n * args.k
        title = f"gemm M{args.m} N{args.n} K{args.k} {args.dtype}"
        harness.report(
            title, {"tilelang": lambda: matmul(a, b)}, {"torch.matmul": lambda: a @ b}, flops
        )


if __name__ == "__main__":
    main()
