"""The hand-scheduled Hopper backward (example_mha_bwd_wgmma_pipelined.py): its generated code
holds the schedule, fits the SM and spills nothing (CPU, sm_90a builds), and every gradient
matches the reference on a GPU (marker ``gpu``; conftest's watchdog turns a deadlocked kernel
into a failed run instead of a hung one).

Its reference, command line and bad-input checks are shared with the plain scripts in
test_flash_bwd_mha.py."""

import math
import re
import subprocess

import pytest
import torch
from helpers import fresh_plans, load_script, record_launches, rel_err

FAST = "flash_attention/example_mha_bwd_wgmma_pipelined.py"
SMEM_LIMIT = 232448  # bytes of shared memory one thread block may use on an H100
# Programmatic dependent launch in CUDA source: a grid waiting for the one ahead of it, and a
# grid letting the next one launch.
WAIT, TRIGGER = "cudaGridDependencySynchronize()", "cudaTriggerProgrammaticLaunchCompletion()"


def ptxas_report(source, arch="sm_90a"):
    """Compile generated CUDA with ``ptxas -v``, the flags TileLang uses; return its report."""
    import os
    import tempfile

    from tilelang.contrib import nvcc

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cu")
        with open(path, "w") as f:
            f.write(source)
        cmd = [nvcc.get_nvcc_compiler(), "-cubin", "-O3", "-arch", arch, "--use_fast_math"]
        cmd += ["-Xptxas", "-v", "-w", "-o", os.path.join(tmp, "k.cubin"), path]
        cmd += nvcc.default_compile_options()
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def assert_clean_build(kernel, threads=384, producer_regs=24, consumer_regs=240):
    """What every hand-scheduled Hopper build promises, read from ``ptxas -v``: no spills and no
    stack; set_max_nreg's split fits the launch's registers (the consumers' rise must come from
    the producer's drop, or they wait for it forever: a deadlock, not an error); ptxas does not
    serialize the WGMMA pipeline (it does when a branch reads an accumulator of a GEMM still in
    flight); shared memory fits an H100 thread block. Returns the report."""
    import harness

    report = ptxas_report(kernel.get_kernel_source())
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    launch = int(re.search(r"Used (\d+) registers", report).group(1))
    assert 128 * producer_regs + (threads - 128) * consumer_regs <= launch * threads
    assert "Potential Performance Loss" not in report, report
    static = int(re.search(r"(\d+) bytes smem", report).group(1))
    assert harness.dynamic_smem_bytes(kernel) + static <= SMEM_LIMIT
    return report


def build(mod, B, H, S, D, causal, dtype="float16", **cfg):
    import harness

    cfg = cfg or mod.default_config(D)
    args = (B, H, S, S, D, causal, 1 / math.sqrt(D), dtype)
    return harness.compile_for(mod.flash_bwd, "sm_90a", *args, **cfg)


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_generated_code_holds_the_schedule(dim, causal):
    """Ragged Sq != Sk, default tiles: the four kernels build, and the backward kernel is the
    hand-written schedule (producer/consumer registers, mbarriers, asynchronous WGMMA waited
    with a non-zero count, one named barrier a step, the TMA reduce-add of dQ)."""
    mod = load_script(FAST)
    # Causal, 777 queries against 1000 keys: key block 0 (every query sees key 0) reaches every
    # query block, so the key blocks 0 and 8 (store_stride: p = 8, the key block count) store
    # dQ in a launch of their own and the prep zeroes nothing. 1000 queries against 777 keys
    # (7 key blocks, a stride not taken): one launch after the zeroing prep.
    Sq, Sk = (777, 1000) if causal else (1000, 777)
    src = mod.compile_all(2, 4, Sq, Sk, dim, causal, "bfloat16", "sm_90a")
    names = {"flash_fwd", "flash_bwd_prep", "flash_bwd", "flash_bwd_post"}
    assert set(src) == names | ({"flash_bwd_store"} if causal else set())
    assert ("*(float4*)(dQ_accum" in src["flash_bwd_prep"]) != causal  # zeroing, by vectors
    bwd = src["flash_bwd"]
    assert "__launch_bounds__(384, 1)" in bwd  # two consumer warpgroups + the producer
    assert "warpgroup_reg_dealloc<24>" in bwd and "warpgroup_reg_alloc<240>" in bwd
    assert "tma_load" in bwd and ".expect_transaction(" in bwd and ".wait(" in bwd
    # Each consumer warpgroup's own loop, two steps a turn (warpgroup 0 computes dQ on even
    # steps, 1 on odd ones) and, where the step count is known only at run time (causal), an odd
    # last step: four or six copies of the step, half of them with dQ. In each copy S/dP, dV
    # and dK are issued asynchronously, with two waits that leave one GEMM running (dPᵀ after
    # Sᵀ, dK after dV) and two in full (dPᵀ, dK); a copy with dQ also waits for its GEMM.
    copies = 6 if causal else 4  # without causal, 1000 queries: 16 steps, an even count
    assert bwd.count("wgmma_rs") == copies * 2  # dV and dK take P and dS from registers
    assert bwd.count("wait_wgmma<1>") == copies * 2
    assert bwd.count("wait_wgmma<0>") == copies * 2 + copies // 2
    # One named barrier a step and one before the epilogue, per warpgroup; then each
    # warpgroup's own barrier before its rows of dK/dV leave shared memory.
    assert bwd.count("__sync_thread_partial(8, 256)") == copies + 2
    assert bwd.count("__sync_thread_partial(9, 128)") == bwd.count("(10, 128)") == 1
    assert "fence_proxy_async" in bwd
    # dQ: stored in accumulator order by 16-byte vectors, then one bulk reduce-add (the 1-D
    # form: shared address, global address, byte count) a step, and no per-thread atomics.
    assert bwd.count("*(float4*)(((float*)dq_shared)") == copies // 2
    assert re.search(
        r"tma_store_add\(\(&\(\(\(float\*\)dq_shared\)\[[^]]*\]\)\), \(&\(dQ_accum\[", bwd
    )
    assert "AtomicAdd" not in bwd
    assert "tma_load" in src["flash_fwd"] and "wgmma" in src["flash_fwd"]
    # Programmatic dependent launch: the prep lets the backward kernel launch early, which waits
    # for the prep's end before its first load and lets the postprocess launch early, which
    # waits for the backward kernel's end before it reads the dQ tiles.
    prep, post = src["flash_bwd_prep"], src["flash_bwd_post"]
    assert TRIGGER in prep and WAIT not in prep
    for kernel in [bwd] + ([src["flash_bwd_store"]] if causal else []):
        assert kernel.index(TRIGGER) < kernel.index(WAIT) < kernel.index("tma_load(")
    assert TRIGGER not in post and post.index(WAIT) < post.index("= *(float4*)(dQ_accum")
    if causal:  # the same schedule, storing each tile with one bulk copy instead
        store = src["flash_bwd_store"]
        assert "tma_store_add" not in store and "wait_wgmma<1>" in store
        assert re.search(
            r"tma_store\(\(&\(dQ_accum\[[^]]*\]\)\), \(&\(\(\(float\*\)dq_shared", store
        )


@pytest.mark.parametrize("dim,causal", [(128, False), (128, True), (64, False), (64, True)])
def test_no_spills_and_fits_shared_memory(dim, causal):
    """At a benchmark shape (S = 4096, where a shared code path for both warpgroups once spilled
    its WGMMA descriptors): ptxas spills nothing, no stack, and the kernel's shared memory fits
    an H100 thread block."""
    mod = load_script(FAST)
    kernel = build(mod, 4, 32, 4096, dim, causal)
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)


@pytest.mark.parametrize(
    "dim,seq_q,seq_k,block_M",
    [(128, 255, 17, 128), (128, 300, 1, 128), (128, 448, 17, 128), (64, 500, 17, 128)]
    + [(64, 500, 17, 64), (64, 512, 64, 64), (64, 1000, 64, 64)],
)
def test_single_key_block_causal_builds(dim, seq_q, seq_k, block_M):
    """Causal, one key block, more queries than keys: the key block sees one query block, a
    compile-time constant, so dQ_accum's address is a head's stride times the head plus a
    constant. TileLang 0.1.15 rejected such builds ("Can't fetch the lanes of a scalable
    vector") while that address was an ``address_of``; as ``access_ptr`` they build clean,
    with a grid of exactly the key blocks."""
    import harness

    mod = load_script(FAST)
    args = (2, 8, seq_q, seq_k, dim, True, dim**-0.5, "bfloat16")
    cfg = dict(mod.default_config(dim), block_M=block_M)
    kernel = harness.compile_for(mod.flash_bwd, "sm_90a", *args, **cfg)
    assert "blockIdx.x) < " not in kernel.get_kernel_source()
    threads = 384 if block_M == 128 else 256
    assert_clean_build(kernel, threads, mod.PRODUCER_REGS, mod.CONSUMER_REGS)


def test_loops_that_may_not_run_sit_under_a_test():
    """TileLang 0.1.15 runs a loop whose count is at most 1 but may be 0 once anyway (its
    simplifier takes the loop's own ``i < count`` for count >= 1): a three-line kernel shows it.
    A causal grid of three query blocks of 128 (S = 300, 128 keys a thread block) gives the
    two-steps loop the counts 1, 1 and 0: unguarded, the last key block ran two steps, waited
    for a Q tile the producer never loads and deadlocked. Both consumer warpgroups now test the
    count first (``may_run``)."""
    import tilelang
    import tilelang.language as T

    import harness

    def tiny(guarded):
        @T.prim_func
        def kernel(A: T.Tensor((4,), "float32")):
            with T.Kernel(3, threads=32) as bx:
                if guarded:
                    if (3 - bx) // 2 > 0:
                        for _ in T.serial((3 - bx) // 2):
                            A[bx] = A[bx] + 1.0
                else:
                    for _ in T.serial((3 - bx) // 2):  # 1, 1, 0
                        A[bx] = A[bx] + 1.0

        src = tilelang.compile(kernel, target=harness.target_for("sm_90a")).get_kernel_source()
        return src.split("__launch_bounds__")[-1]  # the kernel's body

    assert "if (" not in tiny(False)  # the body, run by every thread block
    assert "if (" in tiny(True)
    mod = load_script(FAST)
    cfg = dict(mod.default_config(64), block_M=128, block_N=128)
    src = build(mod, 2, 4, 300, 64, True, "bfloat16", **cfg).get_kernel_source()
    assert src.count("if (((int)blockIdx.x) < 2) {") == 2, "each consumer tests its steps"


@pytest.mark.parametrize("seq_q,seq_k,causal", [(150, 150, True), (150, 1000, False)])
def test_short_walks_at_d128_branch_on_the_step(seq_q, seq_k, causal):
    """A dense D = 128 walk of at most three query blocks (``branch_turns``): one copy of the
    step a warpgroup, its turn at dQ a branch on the step. Two steps a turn there, with the odd
    last step, spilled 140-248 bytes (serializing the WGMMAs where causal)."""
    import harness

    mod = load_script(FAST)
    args = (2, 4, seq_q, seq_k, 128, causal, 1 / math.sqrt(128), "bfloat16")
    kernel = harness.compile_for(mod.flash_bwd, "sm_90a", *args, **mod.default_config(128))
    assert kernel.get_kernel_source().count("wgmma_rs") == 2 * 2  # dV and dK, one copy each
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)


@pytest.mark.parametrize("seq_len,causal", [(1024, True), (1000, True), (1024, False)])
def test_group_walks_nest_their_loops(seq_len, causal):
    """A walk over a GQA group's four heads: heads, then query blocks, as two loops in the
    producer's warps, and (causal, each head of an even number of query blocks) heads, then
    turns, in each consumer warpgroup, so that no step divides by the walk's length to find
    its head or query block; a clean build."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(128), head_splits=1)
    kernel = build(mod, 1, 16, seq_len, 128, causal, "bfloat16", groups=4, **cfg)
    src = kernel.get_kernel_source()
    assert not re.search(r" [%/] \(", src), "a step divides by a run-time value"
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)


@pytest.mark.parametrize("causal", [False, True])
def test_one_consumer_warpgroup_builds_clean(causal):
    """block_M = 64 (D = 64): one consumer warpgroup (256 threads) computes every step's dQ;
    no spills, no serialized WGMMA, and set_max_nreg's split fits its launch."""
    mod = load_script(FAST)
    kernel = build(mod, 1, 8, 2048, 64, causal, **dict(mod.default_config(64), block_M=64))
    assert_clean_build(kernel, 256, mod.PRODUCER_REGS, mod.CONSUMER_REGS)
    assert "__launch_bounds__(256" in kernel.get_kernel_source()


@pytest.mark.parametrize("dim,block_M,causal", [(64, 64, True), (128, 128, False)])
def test_head_splits_build_clean_and_write_float32_parts(dim, block_M, causal):
    """head_splits = 2 (a group of 8 over two thread blocks a key block): clean build, the grid
    twice as tall, dK and dV float32 parts with the part's offset from the grid row."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(dim), block_M=block_M, head_splits=2)
    kernel = build(mod, 1, 32, 2048, dim, causal, "bfloat16", groups=8, **cfg)
    assert_clean_build(kernel, block_M * 2 + 128, mod.PRODUCER_REGS, mod.CONSUMER_REGS)
    src = kernel.get_kernel_source()
    # (a kernel that waits on the grid before it, T.pdl_sync, loses __restrict__ in TileLang)
    assert re.search(r"(?<!const) float\* (__restrict__ )?dK\b", src)
    assert re.search(r"(?<!const) float\* (__restrict__ )?dV\b", src)
    assert "(((int)blockIdx.y) & 1) * " in src  # the part: the grid row's low bit


@pytest.mark.parametrize("heads,groups,causal", [(32, 8, True), (24, 3, True), (32, 8, False)])
def test_group_walk_at_d64_causal_branches_on_the_step(heads, groups, causal):
    """At D = 64 under the diagonal, a thread block walking several heads (128 keys, the whole
    group) takes one copy of the step a warpgroup, its turn at dQ a branch on the step's parity;
    without a mask the loop keeps two steps a turn (two copies a warpgroup: the group makes the
    step count even). Both build clean."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(64), block_M=128, head_splits=1)
    kernel = build(mod, 1, heads, 2048, 64, causal, "bfloat16", groups=groups, **cfg)
    src = kernel.get_kernel_source()
    copies = 2 if causal else 4  # dV and dK take P and dS from registers in each copy
    assert src.count("wgmma_rs") == copies * 2 and src.count("wait_wgmma<1>") == copies * 2
    parity = re.search(r"if \(\(i_\d+ % 2\) == 0\)", src) and re.search(
        r"if \(\(i_\d+ & 1\) == 1\)", src
    )
    assert bool(parity) == causal
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("splits", [1, 4])
def test_head_split_parts_are_summed_in_one_launch(layout, splits):
    """With head_splits the backward adds flash_bwd_post_kv, which sums the float32 dK and dV
    parts and casts them in one launch (ragged Sk: the last rows under a bounds test); without,
    it has no such kernel."""
    import harness

    mod = load_script(FAST)
    cfg = dict(mod.default_config(64), head_splits=splits)
    kernels = mod.backward_kernels(300, 1000, 64, True, 0.125, "bfloat16", cfg, 8, (-1, -1), layout)
    assert ("flash_bwd_post_kv" in kernels) == (splits > 1)
    if splits > 1:
        factory, args, kw = kernels["flash_bwd_post_kv"]
        src = harness.compile_for(factory, "sm_90a", 2, 16, *args, **kw).get_kernel_source()
        # (it waits on the grid before it, T.pdl_sync, so TileLang drops __restrict__)
        assert re.search(r"const float\* (__restrict__ )?dK_parts", src)
        assert re.search(r"bfloat16_t\* (__restrict__ )?dV\b", src)
        assert "float4" in src and "< 125" in src  # 16-byte loads; 1000 keys = 125 × 8 rows
        # launched while the postprocess runs: it waits before it reads a part
        assert src.index(WAIT) < src.index("*(float4*)(dK_parts")


def test_packed_kernels_chain_by_programmatic_dependent_launch():
    """The packed (``thd``) prep lets the backward kernel launch early and the packed
    postprocess waits for the backward kernel before it reads the dQ tiles, as in the dense
    layouts (the schedule test above)."""
    import harness

    mod = load_script(FAST)
    kernels = mod.backward_kernels(None, None, 64, True, 0.125, "bfloat16", mod.default_config(64),
                                   4, (-1, -1), "thd")  # fmt: skip
    src = {}
    for name, (factory, args, kw) in kernels.items():
        src[name] = harness.compile_for(factory, "sm_90a", None, 8, *args, **kw).get_kernel_source()
    prep, bwd, post = src["flash_bwd_prep"], src["flash_bwd_varlen"], src["flash_bwd_post"]
    assert TRIGGER in prep and WAIT not in prep
    assert bwd.index(TRIGGER) < bwd.index(WAIT) < bwd.index("tma_load(")
    assert TRIGGER not in post and post.index(WAIT) < post.index("*(float4*)(dQ_accum")


@pytest.mark.parametrize("kw", [dict(groups=8, head_splits=3), dict(groups=1, head_splits=2)])
def test_head_splits_must_divide_the_group(kw):
    mod = load_script(FAST)
    with pytest.raises(ValueError, match="head_splits"):
        build(mod, 1, 8, 1024, 128, False, "bfloat16", **kw)


@pytest.mark.parametrize("dim,block_M", [(128, 64), (64, 32), (64, 192)])
def test_block_M_outside_the_built_forms_raises(dim, block_M):
    """At D = 128 one warpgroup would serialize its WGMMAs (too few registers): refused."""
    mod = load_script(FAST)
    with pytest.raises(ValueError, match="block_M"):
        build(mod, 1, 8, 1024, dim, False, **dict(mod.default_config(dim), block_M=block_M))


@pytest.mark.parametrize(
    "grid,block_M",
    [  # (batch, kv heads, groups, Sk, causal, window bounded on the left, SMs)
        ((1, 4, 1, 2048, False, False, 132), 64),  # 64 thread blocks of 128 keys
        ((1, 4, 8, 2048, True, False, 132), 64),
        ((1, 8, 1, 4096, True, False, 132), 64),  # 256, one head's causal walks
        ((1, 8, 1, 4096, False, False, 132), 64),  # 256 full walks of one head
        ((1, 8, 4, 4096, False, False, 132), 128),  # 256 full walks of a group
        ((1, 8, 4, 4096, True, False, 132), 128),  # 256, GQA: head splits instead
        ((2, 8, 1, 4096, True, False, 132), 128),  # 512: the GPU is full
        ((1, 8, 1, 4096, True, False, 100), 128),  # 256 on fewer SMs
        ((1, 2, 8, 4096, False, True, 132), 64),  # a window, 64 blocks: SMs left idle
        ((1, 8, 8, 2048, False, True, 132), 128),  # a window, 128 blocks
    ],
)
def test_small_grid_takes_64_keys_a_thread_block(grid, block_M):
    """default_config's shape-aware choice (``small_grid``), at D = 64 only."""
    mod = load_script(FAST)
    grid = mod.Grid(*grid)
    assert mod.default_config(64, "sm_90a", grid)["block_M"] == block_M
    assert mod.default_config(128, "sm_90a", grid)["block_M"] == 128
    assert mod.default_config(64, "sm_90a")["block_M"] == 128


@pytest.mark.parametrize(
    "dim,grid,splits",
    [  # (batch, kv heads, groups, Sk, causal, window bounded on the left, SMs)
        (128, (1, 4, 8, 2048, True, False, 132), 8),  # 64 thread blocks
        (128, (1, 8, 4, 4096, True, False, 132), 4),  # 256
        (128, (1, 8, 4, 8192, True, False, 132), 2),  # 512
        (128, (2, 8, 4, 8192, True, False, 132), 1),  # 1024: eight an SM already
        (128, (1, 8, 4, 16384, True, False, 132), 2),  # 1024, but key block 0 walks 1024 steps
        (64, (1, 8, 8, 16384, True, False, 132), 2),  # the same at D64 (128 queries a step)
        (64, (2, 8, 8, 8192, True, False, 132), 1),  # 1024 blocks, walks of 512 steps
        (128, (1, 16, 1, 65536, True, False, 132), 1),  # MHA: nothing to split
        (128, (1, 8, 6, 4096, True, False, 132), 2),  # 4 does not divide 6
        (128, (1, 4, 8, 2048, False, False, 132), 8),  # full walks on half the SMs
        (128, (1, 4, 8, 4096, False, False, 132), 1),  # full walks on 128 of 132 SMs
        (128, (1, 8, 8, 8192, False, True, 132), 1),  # a window
        (128, (1, 8, 1, 2048, True, False, 132), 1),  # MHA: one head a group
        (64, (1, 4, 8, 2048, True, False, 132), 8),  # 128 thread blocks of 64 keys
        (64, (1, 8, 8, 2048, True, False, 132), 8),  # 128 of 128 keys
        (64, (1, 8, 4, 4096, False, False, 132), 1),
    ],
)
def test_small_gqa_grids_split_the_group_heads(dim, grid, splits):
    """default_config's ``head_splits`` (``grid_head_splits``); none without a grid."""
    mod = load_script(FAST)
    assert mod.default_config(dim, "sm_90a", mod.Grid(*grid))["head_splits"] == splits
    assert mod.default_config(dim, "sm_90a")["head_splits"] == 1


@pytest.mark.parametrize(
    "dim,grid,interleave",
    [  # (batch, kv heads, groups, Sk, causal, window bounded on the left, SMs)
        (128, (4, 32, 1, 4096, True, False, 132), 4),  # 32 key blocks: 132 // 32 rows
        (128, (2, 32, 1, 8192, True, False, 132), 2),  # 64 key blocks
        (128, (1, 32, 1, 16384, True, False, 132), 1),  # 128: one row is a wave
        (128, (4, 8, 4, 4096, True, False, 132), 4),  # GQA: a row is one kv head
        (128, (1, 3, 1, 4096, True, False, 132), 3),  # every row, fewer than a wave holds
        (128, (1, 5, 1, 2048, True, False, 132), 5),
        (128, (1, 7, 1, 4096, True, False, 132), 1),  # 7 rows: no divisor from 2 to 4
        (128, (2, 32, 1, 8192, False, False, 132), 1),  # full walks: every one as long
        (128, (1, 8, 8, 8192, True, True, 132), 1),  # a window's band
        (64, (2, 64, 1, 8192, True, False, 132), 2),
    ],
)
def test_causal_grids_interleave_a_wave_of_rows(dim, grid, interleave):
    """default_config's ``interleave`` (``grid_interleave``); none without a grid."""
    mod = load_script(FAST)
    assert mod.default_config(dim, "sm_90a", mod.Grid(*grid))["interleave"] == interleave
    assert mod.default_config(dim, "sm_90a")["interleave"] == 1


@pytest.mark.parametrize(
    "dim,shape",  # (batch, heads, kv heads, Sk)
    [(128, (4, 32, 8, 4096)), (64, (1, 64, 8, 8192)), (128, (1, 32, 4, 2048))],
)
def test_window_of_the_diagonal_alone_takes_the_causal_grid(dim, shape):
    """The sink backward passes causal as the window (-1, 0) with ``causal=False``: its grid,
    and so its config (interleave, head splits), are the causal ones, not a full walk's."""
    mod = load_script(FAST)
    causal = mod.dense_grid(*shape, True, (-1, -1), 132)
    assert causal.causal and not causal.windowed
    assert mod.dense_grid(*shape, False, (-1, 0), 132) == causal
    config = mod.default_config(dim, "sm_90a", causal)
    assert config["interleave"] > 1 or config["head_splits"] > 1
    full = mod.default_config(dim, "sm_90a", mod.dense_grid(*shape, False, (-1, -1), 132))
    assert config != full
    assert not mod.dense_grid(*shape, False, (128, 0), 132).causal  # a band: windowed instead


def test_interleaved_grid_builds_clean_and_orders_rows_first():
    """interleave = 4 of 8 rows (B2 H4): the same clean build, on a grid of (4 rows, key
    blocks, 2 sets of rows), so the GPU starts key block 0 of four rows before key block 1 of
    any: K's load reads key block blockIdx.y of head blockIdx.x, batch entry blockIdx.z."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(128), interleave=4)
    kernel = build(mod, 2, 4, 1000, 128, True, "bfloat16", **cfg)
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)
    src = kernel.get_kernel_source()
    k_load = re.search(r"tma_load\(K_desc,[^;]*;", src).group(0)
    assert "(((int)blockIdx.y) * 128), ((int)blockIdx.x), ((int)blockIdx.z))" in k_load, k_load


def test_interleaved_adds_of_a_store_stride_build_clean():
    """The second launch of a store stride (p = 8: key blocks 1-7, 9-15, …) interleaved: K's
    load reads key block ``key_block(blockIdx.y)`` of head blockIdx.x."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(128), interleave=4)
    kernel = build(mod, 2, 4, 2048, 128, True, "bfloat16", key_stride=8, **cfg)
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)
    k_load = re.search(r"tma_load\(K_desc,[^;]*;", kernel.get_kernel_source()).group(0)
    assert "((int)blockIdx.y) / 7)" in k_load and "((int)blockIdx.y) % 7)" in k_load, k_load
    assert ", ((int)blockIdx.x), ((int)blockIdx.z))" in k_load, k_load


@pytest.mark.parametrize(
    "Sq,Sk,causal,launches",
    [
        (1000, 777, True, ["flash_bwd"]),  # rows that see no key: no store stride
        (1000, 1000, True, ["flash_bwd_store", "flash_bwd"]),  # two launches (p = 8): the adds
        (1000, 100, False, ["flash_bwd_store"]),  # one key block: one storing launch (p = 1)
    ],
)
def test_interleave_reaches_only_the_adding_launch(Sq, Sk, causal, launches):
    """backward_kernels hands ``interleave`` to the launch that adds (the single plain one, or
    the second of a store stride); the storing launch keeps its own grid order."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(128), interleave=8)
    kernels = mod.backward_kernels(Sq, Sk, 128, causal, 0.1, "bfloat16", cfg)
    assert [n for n in kernels if n in ("flash_bwd", "flash_bwd_store")] == launches
    for name in launches:
        assert kernels[name][2]["interleave"] == (8 if name == "flash_bwd" else 1), name


@pytest.mark.parametrize(
    "kw",
    [
        dict(interleave=3),
        dict(interleave=2, layout="thd"),
        dict(interleave=2, with_dq=False),
        dict(interleave=2, ordered_store=True, window=(64, 0)),
    ],
)
def test_interleave_outside_the_plain_launch_raises(kw):
    """interleave must divide the grid's rows (B2 H4: 8), and is for the plain dense launches
    (not packed, not without dQ, not the ordered store)."""
    mod = load_script(FAST)
    cfg = dict(mod.default_config(128), **kw)
    with pytest.raises(ValueError, match="interleave"):
        if cfg.pop("layout", None) == "thd":
            build_packed(mod, 128, True, **cfg)
        else:
            build(mod, 2, 4, 1000, 128, True, **cfg)


def test_tune_space_fits_shared_memory():
    """Every ``--tune`` configuration at D=128 builds and fits (80 queries a step leaves room
    for one dQ tile only)."""
    import harness

    mod = load_script(FAST)
    for cfg in mod.tune_configs(128):
        kernel = build(mod, 1, 4, 1000, 128, True, **cfg)
        assert harness.dynamic_smem_bytes(kernel) <= SMEM_LIMIT - 1024, cfg


def test_default_config_is_hopper_only(capsys):
    mod = load_script(FAST)
    with pytest.raises(ValueError, match="Hopper"):
        mod.default_config(128, "sm_100a")
    with pytest.raises(SystemExit) as exc:  # the command line offers sm_90a only
        mod.main(["--compile-only", "--arch", "sm_100a"])
    assert exc.value.code == 2 and "--arch" in capsys.readouterr().err


def test_compile_only_main(capsys):
    """``--compile-only`` builds the four kernels (the shapes of the schedule test above, so
    TileLang's kernel cache serves them) and names them."""
    argv = ["--compile-only", "--batch", "2", "--heads", "4", "--seq_len", "1000"]
    argv += ["--seq_len_k", "777", "--dim", "64", "--dtype", "bfloat16"]
    load_script(FAST).main(argv)
    out = capsys.readouterr().out
    assert "built for sm_90a" in out
    for name in ("flash_fwd:", "flash_bwd_prep:", "flash_bwd:", "flash_bwd_post:"):
        assert name in out
    assert "bulk-reduce" in out


def test_forward_is_the_persistent_sibling():
    """attention()'s forward pass is example_mha_fwd_bshd.py's kernel, imported, not a copy."""
    mod = load_script(FAST)
    assert mod.fwd.__file__.endswith("flash_attention/example_mha_fwd_bshd.py")
    assert not hasattr(mod, "flashattn_fwd")


@pytest.mark.parametrize("cols", [64, 80, 128])
def test_accumulator_order(cols):
    """``accumulator_index`` places a [64, cols] tile one-to-one onto 0 … 64·cols − 1, so that
    the four floats a thread holds in one 8-column group (rows r, r + 8; columns c, c + 1) are
    one 16-byte vector, and the 128 threads' vectors of a group are consecutive."""
    mod = load_script(FAST)
    index = {(r, c): mod.accumulator_index(r, c) for r in range(64) for c in range(cols)}
    assert sorted(index.values()) == list(range(64 * cols))
    for t in range(128):
        warp, lane = divmod(t, 32)
        r = 16 * warp + lane // 4
        for g in range(cols // 8):
            c = 8 * g + 2 * (lane % 4)
            held = [(r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)]
            assert [index[e] for e in held] == [(g * 128 + t) * 4 + e for e in range(4)]
    # accumulator_coords is its inverse (the postprocess reads the tile in this order)
    assert all(mod.accumulator_coords(at) == rc for rc, at in index.items())


@pytest.mark.parametrize(
    "dim,block_N,form",
    [(128, 64, (False, 64, 128)), (64, 128, (True, 64, 128)), (64, 64, (False, 64, 64))],
)
def test_dq_form_puts_the_larger_side_across(dim, block_N, form):
    """One warpgroup computes a step's dQ as one GEMM: 64 rows (WGMMA's M) by the tile's larger
    side, so that dSᵀ and K are each read once: dQ [queries, D] at D = 128 (64 queries a
    step), dQᵀ [D, queries] at D = 64 (128 queries)."""
    mod = load_script(FAST)
    assert mod.dq_form(dim, block_N) == form
    transposed, rows, cols = form
    assert rows == 64 and rows * cols == dim * block_N
    assert (rows, cols) == ((dim, block_N) if transposed else (block_N, dim))


@pytest.mark.parametrize("dim,block,layout", [(64, 128, "bhsd"), (128, 64, "bshd")])
def test_postprocess_reads_in_order_and_stores_by_tma(dim, block, layout):
    """``flash_bwd_post`` reads the float32 tile in order (consecutive threads, consecutive
    floats), writes the converted rows into a swizzled shared tile and stores it with one TMA
    store; the rows of a partial last block are left to the TMA store's bounds."""
    import harness

    mod = load_script(FAST)
    args = (2, 4, 1000, mod.padded_len(1000, block), dim, 0.125, "bfloat16")
    src = harness.compile_for(
        mod.flash_bwd_post, "sm_90a", *args, block=block, layout=layout
    ).get_kernel_source()
    # In order: thread t reads floats w·t … w·t + w − 1 of each run of 128·w (w = 2 where a
    # thread's two floats are neighbours in the output row too: the untransposed dQ tile).
    assert re.search(
        r"\(\(float\*\)tile\)\[\(\(i_1 \* 128\) \+ \(\(int\)threadIdx\.x\)\)\]"
        r"|\*\(float2\*\)\(\(\(float\*\)tile\) \+ "
        r"\(\(i_1 \* 256\) \+ \(\(\(int\)threadIdx\.x\) \* 2\)\)\)",
        src,
    )
    assert "tl::tma_store(dQ_desc" in src


WINDOWS = [(-1, -1), (128, 0), (1024, 0), (64, 64), (3, 0), (200, -1), (-1, 100)]


@pytest.mark.parametrize("block_N", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_store_stride_partitions_the_query_blocks(block_N, causal):
    """Where ``store_stride`` gives p, key blocks 0, p, 2p, … walk (``walked_ranges``: the
    kernel's ``query_block_range``) query blocks that do not overlap and cover every one, so the
    first launch stores every dQ tile exactly once; every key block walks each query block
    holding a query that sees one of its keys (so no add lands outside a stored tile); p is the
    smallest allowed stride that works, and with None none works."""
    mod = load_script(FAST)
    block_M = 128

    def stores_once(ranges, p, n_q):
        hit = [0] * n_q
        for start, n in ranges[::p]:
            for t in range(start, start + n):
                hit[t] += 1
        return hit == [1] * n_q

    allowed = [1, *range(mod.MIN_STORE_STRIDE, mod.MAX_STORE_STRIDE + 1)]
    taken = 0
    for Sq in (17, 128, 255, 1000, 2048):
        for Sk in (17, 255, 1000, 2048):
            for window in WINDOWS:
                left, right = window[0], 0 if causal else window[1]
                ranges = mod.walked_ranges(Sq, Sk, causal, window, block_M, block_N)
                n_q = math.ceil(Sq / block_N)
                for kb, (start, n) in enumerate(ranges):
                    for i in range(Sq):
                        lo = i + Sk - Sq - left if left >= 0 else 0
                        hi = i + Sk - Sq + right if right >= 0 else Sk - 1
                        if max(lo, kb * block_M) <= min(hi, Sk - 1, kb * block_M + block_M - 1):
                            assert start <= i // block_N < start + n, (Sq, Sk, window, kb, i)
                works = [p for p in allowed if p <= len(ranges) and stores_once(ranges, p, n_q)]
                p = mod.store_stride(Sq, Sk, causal, window, block_M, block_N)
                assert p == (works[0] if works else None), (Sq, Sk, window)
                taken += p is not None
    assert taken  # the shapes include some that take it
    assert mod.store_stride(8192, 8192, True, (1024, 0), block_M, 64) == 9
    assert mod.store_stride(4096, 4096, True, (128, 0), block_M, block_N) is None  # p = 2


@pytest.mark.parametrize("block_N", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_ordered_store_stores_each_tile_once_by_its_lowest_walker(block_N, causal):
    """``first_stored_block``: the query blocks a key block stores (from that block to the end
    of its range) are exactly those no lower key block walks, so each tile that some key block
    walks is stored once, by the lowest one, before any other adds into it."""
    mod = load_script(FAST)
    block_M = 128
    for Sq in (17, 128, 255, 1000, 2048):
        for Sk in (17, 255, 1000, 2048):
            for left, right in WINDOWS:
                right = 0 if causal else right
                edges = (left, right, Sk - Sq + right, Sk - Sq - left)
                q_pad = mod.padded_len(Sq, block_N)
                lowest = {}  # query block -> lowest key block walking it
                stored = {}
                ranges = mod.walked_ranges(Sq, Sk, causal, (left, right), block_M, block_N)
                for kb, (start, n) in enumerate(ranges):
                    for t in range(start, start + n):
                        lowest.setdefault(t, kb)
                    first = int(mod.first_stored_block(kb, block_M, block_N, q_pad, edges))
                    for t in range(max(first, start), start + n):
                        assert t not in stored, (Sq, Sk, left, right, kb, t)
                        stored[t] = kb
                assert stored == lowest, (Sq, Sk, left, right)


@pytest.mark.parametrize("block_N", [64, 128])
def test_ordered_store_launches_each_key_block_after_the_lower_ones(block_N):
    """``launch_order`` (the ordered store's grid at D = 128) is a permutation of (key block,
    row) in which each key block starts after every lower key block of its row, the only ones
    it may wait for (the test above: each tile is stored by its lowest walker); the key blocks
    from ``longest_walks`` on walk fewer query blocks than the longest walk and come after all
    the others."""
    from tilelang import tvm

    mod = load_script(FAST)
    simplify = tvm.arith.Analyzer().simplify
    shapes = [
        (8192, 8192, (1024, 0)),
        (4096, 4096, (512, 0)),
        (1000, 1000, (256, 256)),
        (1000, 777, (300, 0)),
        (17, 17, (1024, 0)),
    ]
    for Sq, Sk, window in shapes:
        walks = [n for _, n in mod.walked_ranges(Sq, Sk, False, window, 128, block_N)]
        n_long = mod.longest_walks(Sq, Sk, False, window, 128, block_N)
        assert walks[n_long - 1] == max(walks) > max(walks[n_long:], default=0)
        n_rows = 3
        order = [
            tuple(int(simplify(x)) for x in mod.launch_order(i, n_long, n_rows))
            for i in range(len(walks) * n_rows)
        ]
        assert sorted(order) == [(kb, row) for kb in range(len(walks)) for row in range(n_rows)]
        position = {block: i for i, block in enumerate(order)}
        for kb, row in order:
            assert kb == 0 or position[(kb - 1, row)] < position[(kb, row)], (Sq, Sk, kb, row)
        assert all(kb < n_long for kb, _ in order[: n_long * n_rows])


@pytest.mark.parametrize(
    "Sq,Sk,window,causal,ordered",
    [
        (4096, 4096, (128, 0), True, True),
        (8192, 8192, (1024, 0), True, True),  # store_stride has p = 9: ordered_store wins
        (4096, 4096, (64, 64), False, True),
        (1000, 1000, (200, -1), False, False),  # no right edge: not measured, store_stride
        (1000, 1000, (-1, 100), False, False),  # no left edge: all would wait for key block 0
        (4096, 4096, (-1, -1), True, False),
        (1000, 255, (3, 0), True, False),  # query blocks no key block walks
    ],
)
def test_ordered_store_is_taken_for_windows_bounded_on_both_sides(Sq, Sk, window, causal, ordered):
    """``backward_kernels``: one launch with ready flags (``ordered_store``) and no zeroing in
    the prep for a window bounded on both sides whose key blocks walk every query block;
    otherwise the zeroing prep or ``store_stride``'s launches, as before."""
    mod = load_script(FAST)
    cfg = mod.default_config(64)
    kernels = mod.backward_kernels(Sq, Sk, 64, causal, 0.125, "bfloat16", cfg, 8, window, "bhsd")
    assert ("flash_bwd_ordered" in kernels) == ordered
    if ordered:
        assert kernels["flash_bwd_ordered"][2]["ordered_store"] is True
        assert not {"flash_bwd", "flash_bwd_store"} & set(kernels)
        assert kernels["flash_bwd_prep"][2]["zero_dq"] is False
    else:
        stored = "flash_bwd_store" in kernels
        assert kernels["flash_bwd_prep"][2].get("zero_dq", True) is not stored


def test_padded_stats_length():
    mod = load_script(FAST)
    assert [mod.padded_len(s, 64) for s in (1, 63, 64, 65, 1000)] == [64, 64, 64, 128, 1024]
    assert mod.padded_len(4096, 80) == 4160


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_empty_input_reads_shapes_by_layout(layout):
    """run_backward on empty queries (no kernel runs): gradients shaped like q, k, v and delta
    [B, H, Sq], whichever layout (BSHD here, BHSD for example_gqa_sink_bwd_bhsd.py)."""
    mod = load_script(FAST)
    q = torch.empty((2, 0, 8, 64) if layout == "bshd" else (2, 8, 0, 64))
    k = torch.empty((2, 5, 2, 64) if layout == "bshd" else (2, 2, 5, 64))
    dq, dk, dv, delta = mod.run_backward(q, q, k, k, q, None, False, 0.125, layout=layout)
    assert (dq.shape, dk.shape, dv.shape, delta.shape) == (q.shape, k.shape, k.shape, (2, 8, 0))
    assert not dk.any() and not dv.any()


@pytest.mark.parametrize("causal", [False, True])
def test_backward_plan_is_settled_once_a_shape(causal, monkeypatch):
    """run_backward's plan (``backward_plan``): a shape's first call builds the kernels
    ``backward_kernels`` names, later calls of the shape only launch them, prep first and the dQ
    post last, dQ written where the call returns it; a caller's tiles build again. The kernels
    are recorded stand-ins on CPU tensors, the device an H100's."""
    mod = load_script(FAST)
    names = ("flash_bwd_prep", "flash_bwd", "flash_bwd_post", "flash_bwd_post_kv")
    builds, launches = record_launches(monkeypatch, *((mod, name) for name in names))
    monkeypatch.setattr(mod.fwd, "entry", lambda kernel: kernel)
    with fresh_plans(mod.backward_plan):
        check_backward_plan(mod, causal, builds, launches)


def check_backward_plan(mod, causal, builds, launches):
    """The body of the test above, with its stand-ins in place."""
    q, k, v = (torch.randn(1, 1000, 8, 64, dtype=torch.bfloat16) for _ in "qkv")
    lse = torch.randn(1, 8, 1000)
    cfg = mod.grid_config(64, 1, 8, 8, 1000, causal, (-1, -1), "cpu")
    expected = mod.backward_kernels(1000, 1000, 64, causal, 0.125, "bfloat16", cfg)
    for _ in range(2):
        dq, dk, dv, delta = mod.run_backward(q, q, k, v, q, lse, causal, 0.125)
        # built on the first call only, with the grid's default tiles, after (batch, heads)
        assert [(b[1], b[2]) for b in builds] == [
            ((1, 8, *a), kw) for _, a, kw in expected.values()
        ]
        ran = launches[-len(expected) :]
        assert ran[0][0] == "flash_bwd_prep" and ran[-1][0] == "flash_bwd_post"
        assert ran[-1][1][1] is dq and ran[0][1][3] is delta
        assert ran[0][1][0] is q and ran[0][1][2] is lse  # out (q here) and the forward's lse
    mod.run_backward(q, q, k, v, q, lse, causal, 0.125, config={**cfg, "num_stages": 1})
    assert len(builds) == 2 * len(expected)


def test_varlen_backward_plan_is_settled_once(monkeypatch):
    """run_backward_varlen's plan (``varlen_backward_plan``): the first call builds the prep, the
    packed backward and the post, later calls (another batch too: the kernels take any) only
    launch them in that order, dQ written where the call returns it. Recorded stand-ins on CPU
    tensors, the device an H100's."""
    from test_varlen import make_varlen

    mod = load_script(FAST)
    names = ("flash_bwd_prep", "flash_bwd", "flash_bwd_post")
    builds, launches = record_launches(monkeypatch, *((mod, name) for name in names))
    monkeypatch.setattr(mod.fwd, "entry", lambda kernel: kernel)
    with fresh_plans(mod.varlen_backward_plan):
        for lengths in ([300, 17], [300, 17], [5, 1000, 64]):
            q, k, v, out, cu, _, _, _ = make_varlen(lengths, lengths, 8, 8, 64, torch.bfloat16)
            lse = torch.randn(8, cu[-1])
            grads = mod.run_backward_varlen(
                out, q, k, v, out, lse, cu, cu, max(lengths), max(lengths), True, 0.125
            )  # fmt: skip
            assert [b[0] for b in builds] == list(names)  # built on the first call only
            (prep, ran_prep), (bwd, ran_bwd), (post, ran_post) = launches[-3:]
            assert (prep, bwd, post) == names
            assert all(a is b for a, b in zip(ran_prep[:4], (out, out, lse, cu), strict=True))
            assert ran_prep[4] == max(lengths)  # max_seqlen_q
            assert all(a is b for a, b in zip(ran_bwd[:3], (q, k, v), strict=True))
            assert ran_bwd[-2] is grads[1] and ran_bwd[-1] is grads[2]  # dk, dv
            assert ran_post[-1] is grads[0] and ran_post[0] is ran_prep[-1]  # dQ's float32 tiles


# ----------------------------------------------------------------------------- CPU: packed mode
# flash_bwd and its prep/post with layout="thd" (packed sequences), which
# example_gqa_bwd_tma_reduce_varlen.py runs; its tests (test_varlen.py) check the gradients.
PACKED_LENGTHS = [
    [17, 64, 1, 130],
    [1, 1, 1, 1, 1],
    [0, 5, 0, 3],
    [4096],
    [3, 0],
    [0],
    [255, 1000, 1, 0, 128, 127, 129],
    [80, 79, 81, 160, 0, 1],
]


@pytest.mark.parametrize("lengths", PACKED_LENGTHS)
@pytest.mark.parametrize("block_N", [64, 80, 128])
def test_packed_tiles_are_each_sequences_own(lengths, block_N):
    """tile_start: sequence b's ⌈len_b / block_N⌉ query tiles lie after the previous sequence's
    (no tile holds rows of two sequences, zero-length and length-1 sequences included), and
    every sequence's tiles fit below ``tile_start(total_q, B)``, the count the host allocates."""
    mod = load_script(FAST)
    cu = [sum(lengths[:b]) for b in range(len(lengths) + 1)]
    n_tiles = mod.tile_start(cu[-1], len(lengths), block_N)
    owner = {}
    for b, n in enumerate(lengths):
        first = mod.tile_start(cu[b], b, block_N)
        for t in range(first, first + math.ceil(n / block_N)):
            assert 0 <= t < n_tiles and t not in owner, (b, t, owner.get(t))
            owner[t] = b
    assert n_tiles <= cu[-1] // block_N + len(lengths)


def _blocks_seen(Lq, Lk, bx, block_M, block_N, causal):
    """Query blocks holding a query that sees a key of key block bx (one with a key below Lk):
    query i sees key j iff j <= i + Lk − Lq (bottom-right causal), so it sees one of the
    block's keys iff it sees the first, bx·block_M."""
    return {i // block_N for i in range(Lq) if not causal or bx * block_M <= i + Lk - Lq}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_N", [64, 80, 128])
def test_packed_query_block_range_on_runtime_lengths(causal, block_N):
    """flash_bwd_varlen's query-block range as the kernel builds it — TIR expressions of the
    run-time lengths and the key block (``query_block_range`` on ``Rows`` read from
    cu_seqlens), evaluated here for each value — is exactly the query blocks with a query that
    sees one of the key block's keys: none for a sequence without queries (n = 0, never
    negative), every block of the sequence without ``causal``."""
    from tvm import arith, tirx

    mod = load_script(FAST)
    block_M = 128
    Lq, Lk, bx = (tirx.Var(name, "int32") for name in ("seq_len_q", "seq_len_k", "bx"))
    right = 0 if causal else -1
    edges = (-1, right, Lk - Lq + right, Lk - Lq + 1)  # what flash_bwd_varlen binds
    q_pad = mod.padded_len(Lq, block_N)
    exprs = mod.query_block_range(bx, block_M, block_N, q_pad, edges)
    analyzer = arith.Analyzer()
    lengths = [0, 1, 17, 63, 64, 65, 80, 127, 128, 129, 255, 300]
    for lq in lengths:
        for lk in lengths[1:]:  # a key block exists only where the sequence has keys
            for b in range(math.ceil(lk / block_M)):
                values = {Lq: lq, Lk: lk, bx: b}
                q_start, n = (
                    e
                    if isinstance(e, int)  # q_start is 0 without causal
                    else int(analyzer.simplify(tirx.stmt_functor.substitute(e, values)))
                    for e in exprs
                )
                seen = _blocks_seen(lq, lk, b, block_M, block_N, causal)
                where = (lq, lk, b)
                if not seen:
                    assert n == 0, where
                else:
                    assert (q_start, n) == (min(seen), max(seen) - min(seen) + 1), where


def build_packed(mod, D, causal, groups=1, dtype="float16", **cfg):
    import harness

    cfg = cfg or mod.default_config(D)
    args = (None, 32, None, None, D, causal, 1 / math.sqrt(D), dtype)
    return harness.compile_for(
        mod.flash_bwd, "sm_90a", *args, **cfg, groups=groups, layout="thd"
    )  # fmt: skip


@pytest.mark.parametrize(
    "dim,causal,groups",
    [(128, False, 1), (128, True, 1), (128, True, 4), (64, False, 4), (64, True, 1)],
)
def test_packed_no_spills_and_fits_shared_memory(dim, causal, groups):
    """The packed kernel (run-time lengths and offsets, the early exit) keeps the dense one's
    promises: ptxas spills nothing, the register split fits, the WGMMA pipeline is not
    serialized, shared memory fits an H100 thread block; and it is the same schedule. At
    D = 128 the loop takes two steps a turn (each warpgroup's two copies of the step, the
    second guarded where the run-time step count may be odd), a causal walk read from shared
    memory where thread 0 put it; at D = 64 the turn at dQ is a branch on the step's parity."""
    mod = load_script(FAST)
    kernel = build_packed(mod, dim, causal, groups)
    src = kernel.get_kernel_source()
    assert "flash_bwd_varlen_kernel" in src and "__launch_bounds__(384, 1)" in src
    if dim == 128:
        assert src.count("wait_wgmma<1>") == 2 * 2 * 2 and src.count("wgmma_rs") == 2 * 2 * 2
        # groups (heads walked) times the blocks: with an even group, an even count, no guard
        guards = re.findall(r"if \(\(\(i2(?:_\d+)? \* 2\) \+ 1\) < ", src)
        assert len(guards) == (2 if groups % 2 else 0)
        assert ("int q_start = info[5];" in src) == causal
    else:
        assert src.count("wait_wgmma<1>") == 2 * 2 and src.count("wgmma_rs") == 2 * 2
        assert re.search(r"if \(\(i_\d+ % 2\) == 0\)", src) and re.search(
            r"if \(\(i_\d+ & 1\) == 1\)", src
        )
        assert "int info[5];" in src  # the sequence's offsets, not the walk
    assert_clean_build(kernel, 384, mod.PRODUCER_REGS, mod.CONSUMER_REGS)


def test_packed_tune_space_fits_shared_memory():
    """Every ``--tune`` configuration at D=128 builds in the packed mode too and fits."""
    import harness

    mod = load_script(FAST)
    for cfg in mod.tune_configs(128):
        kernel = build_packed(mod, 128, True, 4, **cfg)
        assert harness.dynamic_smem_bytes(kernel) <= SMEM_LIMIT - 1024, cfg


# ----------------------------------------------------------------------------- GPU
def make_inputs(B, Sq, Sk, H, D, dtype, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + Sq * 7 + Sk + D)

    def randn(S, s=1.0):
        return (torch.randn(B, S, H, D, generator=g, device="cuda") * s).to(dtype)

    q, k, v = randn(Sq, scale), randn(Sk, scale), randn(Sk)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), randn(Sq)


def _gpu_cases():
    """The gradient matrix: S in {17, 255, 1000, 4096} (and 1 query against many keys), batch
    1 and 2, D 64 and 128, causal and not, fp16 and bf16, Sq != Sk both ways, large logits."""
    f16, bf16 = torch.float16, torch.bfloat16
    cases = []  # (B, Sq, Sk, H, D, causal, dtype, input scale)
    for D in (64, 128):
        for S in (17, 255, 1000, 4096):
            for causal in (False, True):
                dtype = (f16, bf16)[(S + D // 64 + causal) % 2]
                B = 1 if S in (17, 4096) else 2
                cases.append((B, S, S, 2 if S == 4096 else 4, D, causal, dtype, 1))
    for D in (64, 128):
        cases += [
            (1, 1, 255, 4, D, False, f16, 1),  # one query
            (2, 1, 300, 4, D, True, bf16, 1),  # one query, causal: it sees every key
            (2, 255, 1000, 4, D, True, bf16, 1),  # fewer queries than keys
            (1, 1000, 255, 4, D, True, f16, 1),  # 745 rows see no key: out 0, dq 0
            (2, 1000, 17, 4, D, True, bf16, 1),  # 983 rows see no key
            (2, 255, 17, 4, D, True, f16, 1),  # one key block, one query block visible
            (1, 17, 4096, 4, D, False, f16, 1),
            (2, 777, 1000, 4, D, False, bf16, 1),
            (2, 1000, 1000, 4, D, True, bf16, 10),  # large logits
            (2, 1000, 1000, 4, D, False, f16, 10),
        ]
    cases.append((1, 500, 17, 4, 64, True, bf16, 1))  # the same at D = 64 (128 queries a step)
    # The last wave's walks in parts (tail_split_plan): at D = 128, 160 thread blocks, the last
    # 28 in 4 parts each; at D = 64 (64 keys a thread block), 315, the last 51 in 2; ragged keys
    # and queries; large logits.
    cases += [
        (1, 4096, 4096, 5, 128, False, bf16, 1),
        (1, 4000, 4000, 5, 64, False, f16, 1),
        (1, 4090, 4096, 5, 128, False, f16, 10),
    ]
    return cases


def test_tail_split_plan():
    """Which walks of the plain grid go in parts: only those of a last wave that leaves SMs
    idle, after at least one whole wave, in parts of at least 8 query blocks."""
    plan = load_script(FAST).tail_split_plan
    assert plan(4096, 132, 64) == (4092, 4, 8)  # B4 H32 S4096 D128: 64 query blocks a walk
    assert plan(4096, 132, 256) == (4092, 4, 32)
    assert plan(4096, 132, 512) == (4092, 4, 33)  # no more parts than the SMs take
    assert plan(160, 132, 64) == (132, 28, 4)
    assert plan(1056, 132, 64) == (1056, 0, 1)  # whole waves only
    assert plan(100, 132, 64) == (100, 0, 1)  # one partial wave: the walks run as they are
    assert plan(4096, 132, 15) == (4096, 0, 1)  # parts would be shorter than 8 blocks
    # A last wave over half the SMs: split only for walks of 1024 steps or more (query blocks
    # times the group's heads), into the count whose rounds of parts end soonest.
    assert plan(1024, 132, 256, groups=4) == (924, 100, 9)  # B1 Hkv8 S16384: 7 rounds
    assert plan(1024, 132, 64, groups=16) == (924, 100, 5)  # 500 parts in 4 rounds
    assert plan(231, 132, 65, groups=16) == (132, 99, 4)  # 396 parts in 3 rounds
    assert plan(1024, 132, 64, groups=4) == (1024, 0, 1)  # B4 Hkv8 S4096: 256 steps a walk
    assert plan(1024, 132, 1024) == (924, 100, 9)
    assert plan(1024, 132, 512) == (1024, 0, 1)
    assert plan(4096, 132, 64, allowed=False) == (4096, 0, 1)


@pytest.mark.parametrize(
    "B, H, groups, splits",
    # MHA B4 H32; GQA B1 H20 Hkv5: 160 thread blocks; GQA B4 H128 Hkv8: 1024, the last 100 in
    # 5 (walks of 64 query blocks of 16 heads)
    [(4, 32, 1, 8), (1, 20, 4, 4), (4, 128, 16, 5)],
    ids=["mha", "gqa-groups4", "gqa-wide-tail"],
)
def test_tail_split_builds_clean(B, H, groups, splits):
    """The plain grid with its last wave in parts: one code path (shared memory once), no
    spills, the parts' float32 dK/dV written; the sum kernel builds. With a GQA group a walk's
    step count is a run-time multiple of ``groups`` (each part's query blocks times the heads
    it walks)."""
    import harness

    mod = load_script(FAST)
    cfg = mod.default_config(128)
    n_thread_blocks = 4096 // cfg["block_M"] * (H // groups) * B
    tail = (132, *mod.tail_split_plan(n_thread_blocks, 132, 64, groups=groups))
    kernels = mod.backward_kernels(
        4096, 4096, 128, False, 128**-0.5, "float16", cfg, groups, tail=tail
    )
    fn, args, kw = kernels["flash_bwd"]
    assert kw["tail_splits"] == splits
    kernel = harness.compile_for(fn, "sm_90a", B, H, *args, **kw)
    assert_clean_build(kernel)
    assert "dK_part" in kernel.get_kernel_source()
    fn, args, kw = kernels["flash_bwd_post_tail"]
    harness.compile_for(fn, "sm_90a", B, H, *args, **kw)


@pytest.mark.parametrize(
    "B, seq, dim, with_tail",
    # D = 128: 63 query blocks of 64 (Sq 4000 and 4032), 47 (Sq 3000); B4 H32 S4000: the last
    # wave of 4096 walks in 7 parts
    [(4, 4000, 128, True), (4, 4032, 128, False), (4, 3000, 128, False)],
    ids=["S4000-parts", "S4032", "S3000"],
)
def test_odd_step_counts_build_clean(B, seq, dim, with_tail):
    """Without a mask, a walk of an odd step count known at compile time (63 or 47 query blocks)
    reads its count of turns through a warp shuffle: given the count, ptxas spilled 88-204
    bytes. Walks of an even count keep it a constant."""
    import harness

    mod = load_script(FAST)
    cfg = mod.default_config(dim)
    n_q_blocks = -(-seq // cfg["block_N"])
    tail = None
    if with_tail:
        n_thread_blocks = -(-seq // cfg["block_M"]) * 32 * B
        tail = (132, *mod.tail_split_plan(n_thread_blocks, 132, n_q_blocks))
        assert tail[3] == 7
    kernels = mod.backward_kernels(
        seq, seq, dim, False, dim**-0.5, "bfloat16", cfg, 1, tail=tail
    )  # fmt: skip
    fn, args, kw = kernels["flash_bwd"]
    kernel = harness.compile_for(fn, "sm_90a", B, 32, *args, **kw)
    assert_clean_build(kernel)
    assert n_q_blocks % 2 == 1 and "__shfl_sync" in kernel.get_kernel_source()


def test_single_key_block_store_launch_builds_clean():
    """A short causal grid's storing launch (``first_store``; B2 H32 Sq777 Sk1000 D128: stride
    8, key block 0 alone, 13 query blocks) walks an odd step count that is a constant once its
    one key block is: it reads its count of turns through a warp shuffle too (220 bytes spilled
    with the constant)."""
    import harness

    mod = load_script(FAST)
    cfg = mod.default_config(128)
    assert mod.store_stride(777, 1000, True, (-1, -1), cfg["block_M"], cfg["block_N"]) == 8
    kernels = mod.backward_kernels(777, 1000, 128, True, 128**-0.5, "bfloat16", cfg)
    fn, args, kw = kernels["flash_bwd_store"]
    kernel = harness.compile_for(fn, "sm_90a", 2, 32, *args, **kw)
    assert_clean_build(kernel)
    assert "__shfl_sync" in kernel.get_kernel_source()


def _case_id(case):
    B, Sq, Sk, H, D, causal, dtype, scale = case
    dt = "f16" if dtype == torch.float16 else "bf16"
    c = "causal" if causal else "full"
    return f"B{B}-Sq{Sq}-Sk{Sk}-H{H}-D{D}-{c}-{dt}" + ("-x10" if scale != 1 else "")


def check_case(mod, case, config=None):
    B, Sq, Sk, H, D, causal, dtype, scale = case
    q, k, v, dout = make_inputs(B, Sq, Sk, H, D, dtype, scale)
    out = mod.attention(q, k, v, causal=causal, config=config)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_dq, ref_dk, ref_dv = mod.reference_grads(q, k, v, dout, causal, D**-0.5)
    assert rel_err(out, ref_out) < 1e-2  # fp16/bf16 forward
    for name, got, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert got.dtype == dtype and got.shape == ref.shape, name
        err = rel_err(got, ref)
        assert err < 2e-2, f"{name}: relative error {err:.3e}"  # fp16/bf16 gradients
    if causal and Sq > Sk:  # rows that see no key: exactly 0, never NaN
        assert torch.all(out[:, : Sq - Sk] == 0)
        assert torch.all(dq[:, : Sq - Sk] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=_case_id)
def test_gradients_match_reference(case, poisoned_empty):
    """out, dq, dk, dv against autograd through ref_program in float32; every buffer the
    kernels write starts as NaN (poisoned_empty), so an unwritten element fails."""
    check_case(load_script(FAST), case)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_single_query_single_key(dim, poisoned_empty):
    """Sq = Sk = 1: the one probability is 1, so out = v, dv = dout, and dq = dk = 0 exactly
    in real arithmetic (a relative error against a zero reference means nothing: they are
    bounded absolutely instead, far below their size for any other input)."""
    mod = load_script(FAST)
    q, k, v, dout = make_inputs(2, 1, 1, 4, dim, torch.bfloat16)
    out = mod.attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert rel_err(out, v.detach()) < 1e-2 and rel_err(dv, dout) < 2e-2
    bound = 1e-2 * (q.abs().max() + k.abs().max()).item() * dout.abs().max().item()
    assert dq.abs().max().item() <= bound and dk.abs().max().item() <= bound


ONE_WARPGROUP_CASES = [  # (B, Sq, Sk, H, D, causal, dtype, input scale)
    (2, 1000, 777, 4, 64, True, torch.bfloat16, 1),
    (2, 255, 17, 4, 64, True, torch.float16, 1),  # one key block
    (1, 512, 64, 4, 64, True, torch.bfloat16, 1),  # one key block, one query block visible
    (1, 1000, 255, 4, 64, True, torch.float16, 1),  # rows that see no key
    (1, 17, 4096, 4, 64, False, torch.bfloat16, 1),
    (2, 1000, 1000, 4, 64, True, torch.bfloat16, 10),  # large logits
    (1, 777, 1000, 4, 64, False, torch.float16, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ONE_WARPGROUP_CASES, ids=_case_id)
def test_one_consumer_warpgroup_gradients(case, poisoned_empty):
    """block_M = 64 (one consumer warpgroup, which small grids take at D = 64) on ragged
    shapes."""
    mod = load_script(FAST)
    check_case(mod, case, config=dict(mod.default_config(64), block_M=64))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in _gpu_cases() if c[4] == 64][::2], ids=_case_id)
def test_two_warpgroups_at_small_grids(case, poisoned_empty):
    """The matrix's D = 64 grids are small, so there the backward takes 64 keys a thread block
    (``small_grid``); every other case again with 128 keys (``default_config`` passed
    explicitly), so that form stays covered on the ragged shapes too."""
    mod = load_script(FAST)
    check_case(mod, case, config=mod.default_config(64))


SHORT_WALK_CASES = [  # (B, Sq, Sk, H, D, causal, dtype, input scale)
    (2, 300, 300, 4, 64, True, torch.float16, 1),  # key blocks walk 3, 2 and 1 query blocks
    (1, 1000, 300, 4, 64, True, torch.bfloat16, 1),  # the same, and rows that see no key
    (1, 255, 255, 4, 64, True, torch.bfloat16, 10),  # 2 and 1
    (2, 150, 150, 4, 128, True, torch.float16, 1),  # 3 and 1 query blocks of 64
    (1, 100, 150, 4, 128, True, torch.bfloat16, 1),  # 2 and 1
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHORT_WALK_CASES, ids=_case_id)
def test_short_causal_walks_of_two_warpgroups(case, poisoned_empty):
    """128 keys a thread block (two consumer warpgroups taking turns at dQ, two steps a turn
    of the loop) on causal grids of at most three query blocks, where a key block walks one
    step and the two-steps loop none: these deadlocked before the loops sat under a test
    (``test_loops_that_may_not_run_sit_under_a_test``)."""
    mod = load_script(FAST)
    check_case(mod, case, config=dict(mod.default_config(case[4]), block_M=128))


SHORT_D128_CASES = [  # (B, Sq, Sk, H, D, causal, dtype, input scale): walks of three steps
    (1, 150, 1000, 4, 128, False, torch.float16, 1),  # two launches (store stride), not causal
    (2, 1000, 150, 4, 128, True, torch.bfloat16, 1),  # rows that see no key
    (2, 192, 192, 4, 128, False, torch.bfloat16, 10),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHORT_D128_CASES, ids=_case_id)
def test_short_walks_at_d128_gradients(case, poisoned_empty):
    """D = 128 walks of at most three query blocks branch on the step for the turn at dQ
    (``test_short_walks_at_d128_branch_on_the_step``): causal and not, Sq != Sk both ways."""
    check_case(load_script(FAST), case)


@pytest.mark.gpu
def test_short_causal_sequences_at_a_large_batch(poisoned_empty):
    """A large batch of short causal sequences: a grid that fills the GPU, so the default
    config takes 128 keys a thread block (B64 H16 S300 D64, key blocks walking 3, 2 and 1
    query blocks)."""
    mod = load_script(FAST)
    assert mod.grid_config(64, 64, 16, 16, 300, True, (-1, -1), "cuda")["block_M"] == 128
    check_case(mod, (64, 300, 300, 16, 64, True, torch.bfloat16, 1))


INTERLEAVE_CASES = [  # (B, Sq, Sk, H, D, causal, dtype, input scale), 8 grid rows each
    (2, 1000, 777, 4, 128, True, torch.bfloat16, 1),  # ragged, rows that see no key
    (2, 1000, 777, 4, 64, True, torch.float16, 1),
    (2, 4096, 4096, 4, 128, True, torch.float16, 1),  # no store stride past 16 key blocks
    (1, 4096, 4096, 8, 64, True, torch.bfloat16, 10),
    (2, 1000, 1000, 4, 128, True, torch.bfloat16, 1),  # two launches (p = 8): the adds'
    (4, 2048, 2048, 2, 64, True, torch.float16, 1),  # p = 16
]


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [2, 4, 8])
@pytest.mark.parametrize("case", INTERLEAVE_CASES, ids=_case_id)
def test_interleaved_grid_gradients(case, interleave, poisoned_empty):
    """The grid's rows interleaved (``interleave``, 8 rows each case) give the right
    gradients: every thread block still takes one (key block, row) and all are taken."""
    mod = load_script(FAST)
    check_case(mod, case, config=dict(mod.default_config(case[4]), interleave=interleave))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_tune_space_is_correct(dim, poisoned_empty):
    """Every configuration ``--tune`` may pick gives the right gradients (ragged, causal)."""
    mod = load_script(FAST)
    for cfg in mod.tune_configs(dim):
        check_case(mod, (2, 1000, 777, 4, dim, True, torch.bfloat16, 1), config=cfg)
