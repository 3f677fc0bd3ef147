"""FlashAttention forward, grouped-query attention (GQA), BSHD layout, TileLang for Blackwell.

Computes ``O = softmax(Q Kᵀ · scale) V`` for ``q [B, Sq, H, D]`` and ``k, v [B, Sk, Hkv, D]``,
where each group of ``H / Hkv`` consecutive query heads shares one key/value head (query head
``h`` reads kv head ``h // groups``), with the same online softmax as the Hopper script
(examples/flash_attention/example_gqa_fwd_bshd.py):
each thread block owns ``block_M`` query rows, streams K and V ``block_N`` keys at a time and keeps
the running row maximum ``scores_max`` and row sum ``logsum``. It also returns the log-sum-exp
``lse`` of each row, which the backward pass needs.

What it shows on Blackwell: the fifth-generation tensor core instruction (TCGEN05 MMA) is issued
by a single thread, runs asynchronously, and writes its accumulator into tensor memory (TMEM), a
128-lane on-chip memory next to the tensor cores, instead of registers. ``T.alloc_tmem`` reserves
TMEM columns, ``T.tcgen05_gemm(..., mbar=bar)`` issues the MMA and makes it arrive on the mbarrier
``bar`` when it completes, and ``T.mbarrier_wait_parity(bar, phase)`` waits for that. Reading the
accumulator back is a ``T.copy`` from TMEM into a register fragment (``tcgen05.ld``). Two
variants (``--variant``):

- ``ss``  (128 threads): both GEMMs are ``mma_ss`` — operands from shared memory, accumulator in
  TMEM. P goes registers → shared memory → tensor core.
- ``ts``  (256 threads): GEMM 2 is ``mma_ts`` — P is stored into TMEM (``tcgen05.st``) and read
  from there as the A operand, so P never touches shared memory.
The warp-specialized variant is in mha_fwd_bshd.py; reading K/V at head ``h // groups`` is all
GQA changes, in any variant.

Causal masking is aligned bottom-right (as FlashAttention ≥ 2.1): query ``i`` sees key ``j`` when
``j <= i + Sk - Sq``. A query row that sees no key at all gives ``O = 0`` and ``lse = +inf``.

Status: every kernel is compiled for sm_100a and its generated code inspected by
tests/test_sm100.py; the script has not been run on Blackwell hardware yet. On a B200, ``main``
runs the full numeric check and benchmark.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None, return_lse=False,
              variant="ts", config=None)

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device;
        headdim 64 or 128.
    k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device;
        nheads a multiple of nheads_k.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    return_lse: bool. Also return lse: (batch, nheads, seqlen_q), float32, natural log.
    variant: one of "ss", "ts" (above).
    config: dict. Tiles (block_M, block_N); default ``default_config``.
    Returns out: (batch, seqlen_q, nheads, headdim), or (out, lse) when return_lse.

Underneath, ``attention`` calls the custom operator ``tl_attn::sm100_gqa_fwd_bshd``
(``torch.library``), so ``torch.compile(model, fullgraph=True)`` compiles a model around it without
a graph break; ``variant`` travels as a string.

Run:
    python examples/flash_attention_sm100/gqa_fwd_bshd.py --groups 8 --variant ts --causal
    python examples/flash_attention_sm100/gqa_fwd_bshd.py --compile-only --arch sm_100a  # no GPU
"""

import math
import numbers
import pathlib
import sys

import einops
import tilelang
import tilelang.language as T
import torch

LOG2E = 1.4426950408889634
# The loops below are plain T.serial loops whose ordering we state with mbarriers ourselves, so
# TileLang's automatic producer/consumer split (built for T.Pipelined) is switched off.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_100a",)  # --arch: Blackwell only (TCGEN05 MMA, tensor memory)
VARIANTS = ("ss", "ts")
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one block may use on SM100 (227 KB)
TMEM_COLUMNS = 512  # 128 lanes × 512 columns of 32 bits per SM


# ----------------------------------------------------------------------------- kernels
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_fwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    variant="ss",
    block_M=128,
    block_N=128,
):
    """The ``ss`` and ``ts`` kernels: one loop, every step waited for before the next."""
    if variant not in ("ss", "ts"):
        raise ValueError(f"flashattn_fwd builds the ss and ts variants, got {variant!r}")
    use_ts = variant == "ts"
    groups = heads // heads_kv
    # ts: two warpgroups share the 128 TMEM lanes; each reads half of the columns.
    threads = 256 if use_ts else 128
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E  # exp(x·s) = exp2(x·s·log2 e): one FMA per score
    offset = seq_kv - seq_q  # bottom-right causal alignment
    neg_inf = -T.infinity(accum_dtype)
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads_kv, dim]

    # The steps of one key block and the epilogue, named. T.macro is inlined: the generated
    # CUDA is the same as with the steps written out in the loop.
    @T.macro
    def scores(Q_shared, K_shared, S_tmem, s_ready):
        # GEMM 1 (mma_ss): S = Q Kᵀ into TMEM; one elected thread issues it.
        T.tcgen05_gemm(Q_shared, K_shared, S_tmem, transpose_B=True, clear_accum=True, mbar=s_ready)

    @T.macro
    def mask(k, first_masked, bx, acc_s):
        if k >= first_masked:
            for i, j in T.Parallel(block_M, block_N):
                key = k * block_N + j
                visible = key < seq_kv
                if causal:
                    visible = visible and key <= bx * block_M + i + offset
                acc_s[i, j] = T.if_then_else(visible, acc_s[i, j], neg_inf)

    @T.macro
    def softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum):
        # Online softmax: new row max, and the factor that rescales what came before.
        T.copy(scores_max, scores_max_prev)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            # A row with no visible key yet keeps max = -inf; 0 avoids exp2(-inf + inf).
            scores_max[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i])
            scores_scale[i] = T.exp2(scores_max_prev[i] * scale - scores_max[i] * scale)
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale - scores_max[i] * scale)
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def pv(acc_s_cast, P_tmem, P_shared, V_shared, PV_tmem, pv_ready):
        # GEMM 2: this block's P V into TMEM. ss reads P from shared memory, ts from TMEM.
        if use_ts:
            T.copy(acc_s_cast, P_tmem)  # tcgen05.st: registers → TMEM
            # every warp's P columns must be in TMEM before one thread issues the MMA
            T.sync_threads()
            T.tcgen05_gemm(P_tmem, V_shared, PV_tmem, clear_accum=True, mbar=pv_ready)
        else:
            T.copy(acc_s_cast, P_shared)
            T.tcgen05_gemm(P_shared, V_shared, PV_tmem, clear_accum=True, mbar=pv_ready)

    @T.macro
    def rescale(acc_o, scores_scale):
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def pv_accumulate(k, pv_ready, PV_tmem, acc_pv, acc_o):
        # O += this block's P V, once GEMM 2 is done.
        T.mbarrier_wait_parity(pv_ready, k % 2)
        T.copy(PV_tmem, acc_pv)
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] += acc_pv[i, j]

    @T.macro
    def epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz):
        # Normalise; rows with no visible key (logsum = 0) give O = 0 and lse = +inf.
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0)
        T.copy(acc_o, O_shared)
        T.copy(O_shared, Output[bz, bx * block_M : (bx + 1) * block_M, by, :])
        for i in T.Parallel(block_M):
            if bx * block_M + i < seq_q:
                lse[bz, by, bx * block_M + i] = T.if_then_else(
                    logsum[i] > 0,
                    (T.log2(logsum[i]) + scores_max[i] * scale) / LOG2E,
                    T.infinity(accum_dtype),
                )

    @T.prim_func
    def flash_fwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        Output: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([block_N, dim], dtype)
            V_shared = T.alloc_shared([block_N, dim], dtype)
            O_shared = T.alloc_shared([block_M, dim], dtype)
            # Accumulators live in tensor memory: S = Q Kᵀ and this block's P V.
            S_tmem = T.alloc_tmem([block_M, block_N], accum_dtype)
            PV_tmem = T.alloc_tmem([block_M, dim], accum_dtype)
            # P, the A operand of GEMM 2: in TMEM (ts) or in shared memory (ss); the other name
            # is None, so that one pv macro takes both.
            P_tmem = T.alloc_tmem([block_M, block_N], dtype) if use_ts else None
            P_shared = None if use_ts else T.alloc_shared([block_M, block_N], dtype)
            s_ready = T.alloc_barrier(1)  # GEMM 1 done (one arrival: the MMA's commit)
            pv_ready = T.alloc_barrier(1)  # GEMM 2 done
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_pv = T.alloc_fragment([block_M, dim], accum_dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)

            T.copy(Q[bz, bx * block_M : (bx + 1) * block_M, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, neg_inf)

            # Key blocks this query block visits, and the first that needs a mask (the ragged
            # tail block and, when causal, the blocks crossing the diagonal).
            n_blocks = T.ceildiv(seq_kv, block_N)
            first_masked = seq_kv // block_N
            if causal:
                last_key = (bx + 1) * block_M + offset  # one past the last key this block sees
                n_blocks = T.max(0, T.min(n_blocks, T.ceildiv(last_key, block_N)))
                first_masked = T.min(first_masked, T.max(0, (bx * block_M + offset) // block_N))

            # A plain loop, not T.Pipelined: the MMA reads K_shared/V_shared asynchronously, so a
            # buffer may be refilled only after the barrier of the GEMM reading it was waited on.
            for k in T.serial(n_blocks):
                T.copy(K[bz, k * block_N : (k + 1) * block_N, by // groups, :], K_shared)
                scores(Q_shared, K_shared, S_tmem, s_ready)
                # Load V while GEMM 1 runs: its last reader, GEMM 2 of step k-1, was waited on.
                T.copy(V[bz, k * block_N : (k + 1) * block_N, by // groups, :], V_shared)
                T.mbarrier_wait_parity(s_ready, k % 2)  # the barrier completes once per step
                T.copy(S_tmem, acc_s)  # tcgen05.ld: TMEM → registers
                mask(k, first_masked, bx, acc_s)
                softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                T.copy(acc_s, acc_s_cast)  # P in 16 bits: the A operand of GEMM 2
                pv(acc_s_cast, P_tmem, P_shared, V_shared, PV_tmem, pv_ready)
                rescale(acc_o, scores_scale)  # while GEMM 2 runs
                pv_accumulate(k, pv_ready, PV_tmem, acc_pv, acc_o)

            epilogue(acc_o, logsum, scores_max, O_shared, Output, lse, bx, by, bz)

    return flash_fwd


def flashattn_ss(*args, **kwargs):
    """The ``ss`` kernel, variant pinned: both GEMMs read shared memory."""
    return flashattn_fwd(*args, variant="ss", **kwargs)


def flashattn_ts(*args, **kwargs):
    """The ``ts`` kernel, variant pinned: GEMM 2 reads P from tensor memory."""
    return flashattn_fwd(*args, variant="ts", **kwargs)


def default_config():
    """Tiles for both variants: 128 query rows (one per TMEM lane), 128 keys, which fit shared
    memory and TMEM at every supported head dim. Checked against SM100's limits by
    ``smem_bytes``/``tmem_columns`` below."""
    return dict(block_M=128, block_N=128)


def smem_bytes(variant, dim, block_M, block_N, elem_bytes=2):
    """Dynamic shared memory one block asks for, in bytes (16-bit elements):

        ss: Q (M·D) + K, V (2·N·D) + O (M·D) + P (M·N)   M=N=128, D=128: 163840
        ts: Q (M·D) + K, V (2·N·D) + O (M·D)             M=N=128, D=128: 131072
    TileLang may reuse a buffer's bytes once its last reader is done (O reuses Q's), so the
    compiled kernel can ask for less; never more.
    """
    elems = 2 * block_M * dim + 2 * block_N * dim
    if variant == "ss":
        elems += block_M * block_N
    return elems * elem_bytes


def tmem_columns(variant, dim, block_N):
    """TMEM columns (of 512): fp32 S (N) + fp32 PV (D), plus 16-bit P for ts, which
    TileLang packs two to a 32-bit column (N/2); each allocation rounds up to a power of 2."""

    def alloc(cols):
        return max(32, 1 << (cols - 1).bit_length())

    cols = alloc(block_N) + alloc(dim)
    if variant != "ss":
        cols += alloc(block_N // 2)
    return cols


def check_config(variant, dim, cfg):
    """Refuse a tile choice that cannot fit one SM100 block."""
    need = smem_bytes(variant, dim, **cfg)
    if need > SMEM_LIMIT:
        raise ValueError(f"{variant} {cfg}: {need} bytes of shared memory > {SMEM_LIMIT}")
    cols = tmem_columns(variant, dim, cfg["block_N"])
    if cols > TMEM_COLUMNS:
        raise ValueError(f"{variant} {cfg}: {cols} TMEM columns > {TMEM_COLUMNS}")


# ----------------------------------------------------------------------------- building
def _compile(jit_fn, args, kwargs, target):
    """Compile for this GPU (``target=None``) or, without one, for a target such as
    ``{"kind": "cuda", "arch": "sm_100a"}``."""
    if target is None:
        return jit_fn(*args, **kwargs)
    program = jit_fn.get_tir(*args, **kwargs)
    return tilelang.compile(program, target=target, pass_configs=jit_fn.pass_configs)


def build_forward(variant, args, config=None, target=None):
    """Build the forward kernel for ``variant``, its tiles checked against SM100's limits.

    ``args`` = (batch, heads, heads_kv, seq_q, seq_kv, dim, causal, softmax_scale, dtype).
    """
    dim = args[5]
    cfg = config or default_config()
    check_config(variant, dim, cfg)
    if target is None:
        return (flashattn_ss if variant == "ss" else flashattn_ts)(*args, **cfg)
    return _compile(flashattn_fwd, args, {"variant": variant, **cfg}, target)


# ----------------------------------------------------------------------------- torch-facing
def _check_inputs(q, k, v, causal, softmax_scale):
    """ValueError naming the first bad argument; the device last, so any other needs no GPU."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    real = isinstance(softmax_scale, numbers.Real)
    if softmax_scale is not None and not (real and 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seqlen, heads, dim], got {tuple(t.shape)}")
    B, _, H, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        got = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"q, k, v must share a dtype, float16 or bfloat16; got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k, v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        got = tuple(k.shape)
        raise ValueError(f"k must be [{B}, seqlen_k, heads_kv, {D}] to match q, got {got}")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv}): H % Hkv != 0")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


_kernels = {}


def attention_forward(q, k, v, causal, softmax_scale, config=None, variant="ts"):
    """The kernel on checked, contiguous input: ``out`` and ``lse`` (what the operator runs)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to build
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        dtype = "float16" if q.dtype == torch.float16 else "bfloat16"
        args = (B, H, Hkv, Sq, Sk, D, bool(causal), float(softmax_scale), dtype)
        key = (variant, args, tuple(sorted((config or {}).items())))
        if key not in _kernels:
            _kernels[key] = build_forward(variant, args, config)
        _kernels[key](q, k, v, out, lse)
    return out, lse


# torch.compile: the kernel as a custom operator (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls it as one opaque node, without a graph break, and learns its outputs'
# shapes, dtypes and strides from the fake implementation. The variant is an operator argument (a
# string); a config travels as its values in CONFIG_KEYS order (an operator takes no dicts; None:
# the default).
CONFIG_KEYS = ("block_M", "block_N")


def operator_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    variant: str,
    config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = dict(zip(CONFIG_KEYS, config, strict=True)) if config else None
    return attention_forward(q, k, v, causal, softmax_scale, cfg, variant)


attention_forward_op = torch.library.custom_op(
    "tl_attn::sm100_gqa_fwd_bshd", operator_forward, mutates_args=()
)


@attention_forward_op.register_fake
def _(q, k, v, causal, softmax_scale, variant, config):
    B, Sq, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


def attention(
    q, k, v, causal=False, softmax_scale=None, return_lse=False, variant="ts", config=None
):
    """GQA FlashAttention forward on Blackwell for ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``.

    Returns ``out [B, Sq, H, D]``, and ``lse [B, H, Sq]`` (float32, natural log) when
    ``return_lse``. ``variant`` is one of ``VARIANTS``; ``config`` overrides the tiles.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    _check_inputs(q, k, v, causal, softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    tiles = [config[key] for key in CONFIG_KEYS] if config else None
    # Compiled code, fake tensors and calls autograd records take the operator (a backward
    # through it is then an error, not a silent zero gradient); any other eager call runs its
    # body without the operator's dispatch (docs/CONVENTIONS.md, "Eager calls").
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    forward = operator_forward if eager and not recorded else attention_forward_op
    out, lse = forward(q, k, v, causal, float(softmax_scale), variant, tiles)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, causal=False, softmax_scale=None, return_lse=False):
    """Plain PyTorch in float32 (float64 inputs stay float64; runs on CPU too), same conventions
    as ``attention``."""
    acc = torch.promote_types(q.dtype, torch.float32)
    D = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    groups = q.shape[2] // k.shape[2]
    # Each kv head serves `groups` consecutive query heads.
    qf = q.to(acc)
    kf, vf = (einops.repeat(t.to(acc), "b s h d -> b s (h g) d", g=groups) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key: probabilities 0, output 0, lse +inf (FlashAttention's convention).
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    # No --tune: the SM100 kernels have one set of tiles, no tune_configs to compare.
    parser = _harness().base_parser(
        __doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS, tune=False
    )
    parser.add_argument("--groups", type=int, default=4, help="query heads per kv head")
    parser.add_argument("--variant", choices=VARIANTS, default="ts", help="see the docstring")
    return parser


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    # Validate groups before any shape arithmetic uses it.
    if args.groups < 1 or args.heads % args.groups != 0:
        parser.error(f"--groups ({args.groups}) must be positive and divide --heads ({args.heads})")
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Hkv = H // args.groups
    Sk = args.seq_len_k or Sq
    scale = 1.0 / math.sqrt(D)
    script = pathlib.Path(__file__).name

    if args.compile_only:
        kargs = (B, H, Hkv, Sq, Sk, D, args.causal, scale, args.dtype)
        kernel = build_forward(args.variant, kargs, target=harness.target_for(args.arch))
        print(f"{script}: built the {args.variant} variant for {args.arch}")
        print(harness.describe_source(f"flashattn_fwd[{args.variant}]", kernel.get_kernel_source()))
        return

    harness.require_gpu(script, arch="sm_100a", capability=(10, 0))
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)

    def run():
        return attention(q, k, v, args.causal, scale, variant=args.variant)

    if args.check:
        out, lse = attention(q, k, v, args.causal, scale, return_lse=True, variant=args.variant)
        ref_out, ref_lse = ref_program(q, k, v, args.causal, scale, return_lse=True)
        print(f"check {args.variant} B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} causal={args.causal}")
        harness.check_close("out", out, ref_out, rtol=1e-2)  # fp16/bf16 forward
        harness.check_close("lse", lse, ref_lse, rtol=1e-3)  # fp32 statistics: tighter

    if args.bench:
        flops = harness.attention_flops(B, H, Sq, Sk, D, D, args.causal)
        peers = harness.sdpa_peers(q, k, v, args.causal, scale)
        title = f"forward {args.variant} B{B} H{H} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} causal={args.causal}"
        harness.report(title, {f"tilelang_{args.variant}": run}, peers, flops)


if __name__ == "__main__":
    main()
