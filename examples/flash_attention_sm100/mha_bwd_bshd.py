"""FlashAttention backward, multi-head, BSHD layout, TileLang for Blackwell (SM100).

``attention(q, k, v, causal, softmax_scale)`` is differentiable: its forward is the ``ss`` kernel
of gqa_fwd_bshd.py (imported from beside this file; one kv head per query head) and its
backward computes dQ, dK, dV with five TCGEN05 GEMMs per step, every accumulator in tensor
memory (TMEM). One thread block owns ``block_M`` = 128 keys (one per TMEM lane) and walks the
query blocks that can see them (``block_N`` = 64 queries each), recomputing
``Pᵀ = exp(K Qᵀ · scale − lse)`` rather than storing P in the forward:

    Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ,  dV += Pᵀ dO,  dSᵀ = Pᵀ ∘ (dPᵀ − delta) · scale,  dK += dSᵀ Q,
    dQ += dS K   (``delta`` = rowsum(dO ∘ O), computed in PyTorch before the kernel)

Each GEMM group is issued by one thread and waited for on an mbarrier
(``T.tcgen05_gemm(..., mbar=...)`` then ``T.mbarrier_wait_parity``). dQ receives a
contribution from every key block, so each block adds its share into a float32 dQ with atomic
adds. dK and dV belong to one block each and are stored directly.

Causal masking is aligned bottom-right (query ``i`` sees key ``j`` when ``j <= i + Sk - Sq``);
rows that see no key give zero output and zero gradients; an empty batch or sequence builds
and launches nothing.

Status: every kernel is compiled for sm_100a and its generated code inspected by
tests/test_sm100.py; the script has not been run on Blackwell hardware yet. On a B200, ``main``
checks out, dQ, dK, dV against autograd through ``ref_program`` and benchmarks against SDPA's
backward.

API (FlashAttention's argument conventions; docs/CONVENTIONS.md):

    attention(q, k, v, causal=False, softmax_scale=None)

    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device;
        headdim 64 or 128.
    k, v: (batch, seqlen_k, nheads, headdim), same dtype and device.
    causal: bool. Apply the causal mask (aligned bottom-right, above).
    softmax_scale: float. Scaling of QKᵀ before the softmax; default 1 / sqrt(headdim).
    Returns out: (batch, seqlen_q, nheads, headdim), differentiable (``torch.autograd``).

In compiled code, ``attention`` calls the custom operator ``tl_attn::sm100_mha_bwd_bshd_forward``
(``torch.library``), whose autograd formula calls ``tl_attn::sm100_mha_bwd_bshd_backward``, so
``torch.compile(model, fullgraph=True)`` compiles a training step around it without a graph
break.
An eager call runs the same formula through ``EagerAttention`` (a plain
``torch.autograd.Function`` over the same functions), without the operators' dispatch.

Run:
    python examples/flash_attention_sm100/mha_bwd_bshd.py --causal
    python examples/flash_attention_sm100/mha_bwd_bshd.py --compile-only --arch sm_100a  # no GPU
"""

import math
import numbers
import pathlib
import sys

import einops
import tilelang
import tilelang.language as T
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gqa_fwd_bshd as gqa_fwd  # noqa: E402  (the sibling forward: its ss kernel)

LOG2E = 1.4426950408889634
# Plain T.serial loops ordered by our own mbarrier waits: no automatic warp specialization.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
HEAD_DIMS = (64, 128)
ARCHS = ("sm_100a",)  # --arch: Blackwell only (TCGEN05 MMA, tensor memory)
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one block may use on SM100 (227 KB)
TMEM_COLUMNS = 512  # 128 lanes × 512 columns of 32 bits per SM


# ----------------------------------------------------------------------------- kernels
@tilelang.jit(pass_configs=PASS_CONFIGS)
def flashattn_bwd(
    batch,
    heads,
    heads_kv,
    seq_q,
    seq_kv,
    dim,
    causal,
    softmax_scale,
    dtype="float16",
    block_M=128,
    block_N=64,
):
    """dQ, dK, dV for one block of ``block_M`` keys, looping over query blocks of ``block_N``.

    Five TCGEN05 GEMMs per step, all accumulating in TMEM (columns for D=128: Sᵀ 64 + dPᵀ 64 +
    dV 128 + dK 128 + dQ 64 = 448 of 512; see ``tmem_columns_bwd``):
        Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ,  dV += Pᵀ dO,  dK += dSᵀ Q,  dQ_step = dS K
    dQ gets contributions from every key block, so each step adds its dq into float32 dQ with
    atomics. dK/dV of these keys come from this block alone and are stored directly.
    """
    groups = heads // heads_kv
    accum_dtype = "float32"
    scale = softmax_scale * LOG2E
    offset = seq_kv - seq_q
    q_shape = [batch, seq_q, heads, dim]
    kv_shape = [batch, seq_kv, heads_kv, dim]

    # The steps of one query block and the epilogue, named. T.macro is inlined: the generated
    # CUDA is the same as with the steps written out in the loop.
    @T.macro
    def scores(K_shared, Q_shared, qkT_tmem):
        # Sᵀ = K Qᵀ into TMEM; the commit of dp, issued next, covers both GEMMs.
        T.tcgen05_gemm(K_shared, Q_shared, qkT_tmem, transpose_B=True, clear_accum=True, mbar=None)

    @T.macro
    def dp(V_shared, dO_shared, dpT_tmem, s_ready):
        # dPᵀ = V dOᵀ into TMEM.
        T.tcgen05_gemm(
            V_shared, dO_shared, dpT_tmem, transpose_B=True, clear_accum=True, mbar=s_ready
        )

    @T.macro
    def probabilities(q0, bx, lse_shared, qkT):
        # Pᵀ = exp2(Sᵀ·scale − lse·log2 e), 0 where the key is masked or past Sk, or the query
        # past Sq; lse = +inf (row sees no key) gives 0 too.
        for i, j in T.Parallel(block_M, block_N):
            query = q0 + j
            visible = query < seq_q and bx * block_M + i < seq_kv
            if causal:
                visible = visible and bx * block_M + i <= query + offset
            qkT[i, j] = T.if_then_else(
                visible, T.exp2(qkT[i, j] * scale - lse_shared[j] * LOG2E), 0
            )

    @T.macro
    def ds(qkT, dpT, delta_shared, dS_cast):
        # dSᵀ = Pᵀ ∘ (dPᵀ − delta), times the softmax scale that dQ and dK both carry.
        for i, j in T.Parallel(block_M, block_N):
            dS_cast[i, j] = qkT[i, j] * (dpT[i, j] - delta_shared[j]) * softmax_scale

    @T.macro
    def dv_update(P_shared, dO_shared, dv_tmem, step):
        # dV += Pᵀ dO (the first step starts it).
        T.tcgen05_gemm(P_shared, dO_shared, dv_tmem, clear_accum=step == 0, mbar=None)

    @T.macro
    def dk_update(dS_shared, Q_shared, dk_tmem, step):
        # dK += dSᵀ Q.
        T.tcgen05_gemm(dS_shared, Q_shared, dk_tmem, clear_accum=step == 0, mbar=None)

    @T.macro
    def dq_accumulate(step, q0, by, bz, dS_shared, K_shared, dq_tmem, grads_ready, dq, dQ):
        # dQ (this key block's share) = dS K; this GEMM's commit covers the three gradient
        # GEMMs. Then one atomic add per element, rows past Sq skipped.
        T.tcgen05_gemm(
            dS_shared,
            K_shared,
            dq_tmem,
            transpose_A=True,
            clear_accum=True,
            mbar=grads_ready,
        )
        T.mbarrier_wait_parity(grads_ready, step % 2)
        T.copy(dq_tmem, dq)
        for i, j in T.Parallel(block_N, dim):
            if q0 + i < seq_q:
                T.atomic_add(dQ[bz, q0 + i, by, j], dq[i, j])

    @T.macro
    def epilogue(n_steps, bx, bz, kv_head, dk_tmem, dv_tmem, dk, dv, dK, dV):
        # A key block that no query sees (n_steps = 0) has dK = dV = 0.
        T.fill(dk, 0)
        T.fill(dv, 0)
        if n_steps > 0:
            T.copy(dk_tmem, dk)
            T.copy(dv_tmem, dv)
        # These keys belong to this block alone: dK/dV are stored, not added.
        for i, j in T.Parallel(block_M, dim):
            if bx * block_M + i < seq_kv:
                dK[bz, bx * block_M + i, kv_head, j] = dk[i, j]
                dV[bz, bx * block_M + i, kv_head, j] = dv[i, j]

    @T.prim_func
    def flash_bwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(kv_shape, dtype),
        V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype),
        lse: T.Tensor([batch, heads, seq_q], accum_dtype),
        delta: T.Tensor([batch, heads, seq_q], accum_dtype),
        dQ: T.Tensor(q_shape, accum_dtype),
        dK: T.Tensor(kv_shape, accum_dtype),
        dV: T.Tensor(kv_shape, accum_dtype),
    ):
        with T.Kernel(T.ceildiv(seq_kv, block_M), heads, batch, threads=128) as (bx, by, bz):
            K_shared = T.alloc_shared([block_M, dim], dtype)
            V_shared = T.alloc_shared([block_M, dim], dtype)
            Q_shared = T.alloc_shared([block_N, dim], dtype)
            dO_shared = T.alloc_shared([block_N, dim], dtype)
            P_shared = T.alloc_shared([block_M, block_N], dtype)
            dS_shared = T.alloc_shared([block_M, block_N], dtype)
            lse_shared = T.alloc_shared([block_N], accum_dtype)
            delta_shared = T.alloc_shared([block_N], accum_dtype)
            qkT_tmem = T.alloc_tmem([block_M, block_N], accum_dtype)
            dpT_tmem = T.alloc_tmem([block_M, block_N], accum_dtype)
            dv_tmem = T.alloc_tmem([block_M, dim], accum_dtype)
            dk_tmem = T.alloc_tmem([block_M, dim], accum_dtype)
            dq_tmem = T.alloc_tmem([block_N, dim], accum_dtype)
            s_ready = T.alloc_barrier(1)
            grads_ready = T.alloc_barrier(1)
            qkT = T.alloc_fragment([block_M, block_N], accum_dtype)
            dpT = T.alloc_fragment([block_M, block_N], accum_dtype)
            P_cast = T.alloc_fragment([block_M, block_N], dtype)
            dS_cast = T.alloc_fragment([block_M, block_N], dtype)
            dq = T.alloc_fragment([block_N, dim], accum_dtype)
            dk = T.alloc_fragment([block_M, dim], accum_dtype)
            dv = T.alloc_fragment([block_M, dim], accum_dtype)

            kv_head = by // groups
            T.copy(K[bz, bx * block_M : (bx + 1) * block_M, kv_head, :], K_shared)
            T.copy(V[bz, bx * block_M : (bx + 1) * block_M, kv_head, :], V_shared)
            q_start = 0
            if causal:  # query i sees key j when i >= j - offset
                q_start = T.max(0, (bx * block_M - offset) // block_N)
            q_end = T.ceildiv(seq_q, block_N)
            n_steps = T.max(0, q_end - q_start)

            for step in T.serial(n_steps):
                q0 = (q_start + step) * block_N
                T.copy(Q[bz, q0 : q0 + block_N, by, :], Q_shared)
                T.copy(dO[bz, q0 : q0 + block_N, by, :], dO_shared)
                T.copy(lse[bz, by, q0 : q0 + block_N], lse_shared)
                T.copy(delta[bz, by, q0 : q0 + block_N], delta_shared)
                scores(K_shared, Q_shared, qkT_tmem)
                dp(V_shared, dO_shared, dpT_tmem, s_ready)
                T.mbarrier_wait_parity(s_ready, step % 2)
                T.copy(qkT_tmem, qkT)
                T.copy(dpT_tmem, dpT)
                probabilities(q0, bx, lse_shared, qkT)
                ds(qkT, dpT, delta_shared, dS_cast)
                # Pᵀ and dSᵀ in 16 bits to shared memory: the A operands of the gradient GEMMs.
                T.copy(qkT, P_cast)
                T.copy(P_cast, P_shared)
                T.copy(dS_cast, dS_shared)
                dv_update(P_shared, dO_shared, dv_tmem, step)
                dk_update(dS_shared, Q_shared, dk_tmem, step)
                dq_accumulate(step, q0, by, bz, dS_shared, K_shared, dq_tmem, grads_ready, dq, dQ)

            epilogue(n_steps, bx, bz, kv_head, dk_tmem, dv_tmem, dk, dv, dK, dV)

    return flash_bwd


def smem_bytes_bwd(dim, block_M, block_N, elem_bytes=2):
    """Dynamic shared memory of the backward kernel, in bytes:

    K, V (2·M·D) + Q, dO (2·N·D) + Pᵀ, dSᵀ (2·M·N) 16-bit, plus lse, delta (2·N) fp32
    M=128, N=64, D=128: 65536 + 32768 + 32768 + 512 = 131584, under SM100's 232448.
    """
    return (
        2 * block_M * dim + 2 * block_N * dim + 2 * block_M * block_N
    ) * elem_bytes + 8 * block_N


def tmem_columns_bwd(dim, block_N):
    """TMEM columns: Sᵀ, dPᵀ (N each) + dV, dK (D each) + dQ (64 rows × D fp32, which TileLang
    lays over 128 lanes in D/2 columns); each allocation rounds up to a power of 2 (≥ 32)."""

    def alloc(cols):
        return max(32, 1 << (cols - 1).bit_length())

    return 2 * alloc(block_N) + 2 * alloc(dim) + alloc(dim // 2)


def check_bwd_config(dim, block_M, block_N):
    need = smem_bytes_bwd(dim, block_M, block_N)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"backward {block_M}x{block_N}: {need} bytes of shared memory > {SMEM_LIMIT}"
        )
    cols = tmem_columns_bwd(dim, block_N)
    if cols > TMEM_COLUMNS:
        raise ValueError(f"backward {block_M}x{block_N}: {cols} TMEM columns > {TMEM_COLUMNS}")


BWD_CONFIG = dict(block_M=128, block_N=64)  # 128 keys: one TMEM lane each; 64 queries: dQ's M


# ----------------------------------------------------------------------------- building
def _compile(jit_fn, args, kwargs, target):
    """Compile for this GPU (``target=None``) or, without one, for a target such as
    ``{"kind": "cuda", "arch": "sm_100a"}``."""
    if target is None:
        return jit_fn(*args, **kwargs)
    program = jit_fn.get_tir(*args, **kwargs)
    return tilelang.compile(program, target=target, pass_configs=jit_fn.pass_configs)


def build_kernels(args, target=None):
    """The forward (``ss``) and backward kernels for ``args`` = (batch, heads, heads_kv, seq_q,
    seq_kv, dim, causal, softmax_scale, dtype)."""
    dim = args[5]
    check_bwd_config(dim, **BWD_CONFIG)
    fwd = _compile(gqa_fwd.flashattn_fwd, args, {"variant": "ss"}, target)
    bwd = _compile(flashattn_bwd, args, BWD_CONFIG, target)
    return fwd, bwd


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
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        hint = "q's batch, heads, dim: MHA script; GQA: gqa_bwd_bshd.py"
        raise ValueError(f"k must be [{B}, seqlen_k, {H}, {D}] ({hint}), got {tuple(k.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {HEAD_DIMS}, got {D}")
    if not (q.is_cuda and q.device == k.device == v.device):
        got = f"{q.device}, {k.device}, {v.device}"
        raise ValueError(f"q, k, v must be CUDA tensors on one device, got {got}")


_kernels = {}


def dtype_name(t):
    return "float16" if t.dtype == torch.float16 else "bfloat16"


def kernels_for(q, k, causal, softmax_scale):
    """The forward and backward kernels for these inputs, built on first use."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    args = (B, H, Hkv, Sq, Sk, D, bool(causal), float(softmax_scale), dtype_name(q))
    if args not in _kernels:
        _kernels[args] = build_kernels(args)
    return _kernels[args]


def attention_forward(q, k, v, causal, softmax_scale):
    """Forward kernel alone: ``out [B, Sq, H, D]`` and ``lse [B, H, Sq]`` (float32, natural log)."""
    B, Sq, H, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if k.shape[1] == 0:  # no keys at all: every row is empty (out 0, lse +inf), nothing to build
        out.zero_()
        lse.fill_(math.inf)
    elif out.numel() > 0:
        kernels_for(q, k, causal, softmax_scale)[0](q, k, v, out, lse)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    """The backward kernel: returns ``dq, dk, dv`` in the input dtype."""
    if q.numel() == 0 or k.numel() == 0:  # an empty sum: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dout = dout.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    # delta_i = Σ_d dO·O: the row term of softmax's backward, [B, H, Sq] in float32.
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    # dQ: float32, filled by atomic adds from every key block; dK/dV: stored once, float32.
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)  # every row is stored
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    kernels_for(q, k, causal, softmax_scale)[1](q, k, v, dout, lse, delta, dq, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# torch.compile: the kernels as custom operators (docs/CONVENTIONS.md, "torch.compile").
# Compiled code calls each as one opaque node, without a graph break, and learns their outputs'
# shapes, dtypes and strides from the fake implementations. The two halves are two operators
# joined by register_autograd: the forward operator saves its inputs and outputs for the backward
# operator. The kernels have one set of tiles (BWD_CONFIG), so no config travels.
@torch.library.custom_op("tl_attn::sm100_mha_bwd_bshd_forward", mutates_args=())
def attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, softmax_scale)


@attention_forward_op.register_fake
def _(q, k, v, causal, softmax_scale):
    B, Sq, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("tl_attn::sm100_mha_bwd_bshd_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(dout, q, k, v, out, lse, causal, softmax_scale)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # a statistic for the backward; attention() returns out
    ctx.set_materialize_grads(False)  # backward never reads dlse: no zeros made for it
    ctx.settings = (causal, softmax_scale)


def backward(ctx, dout, dlse):
    dq, dk, dv = attention_backward_op(dout, *ctx.saved_tensors, *ctx.settings)
    return dq, dk, dv, None, None


attention_forward_op.register_autograd(backward, setup_context=setup_context)


class EagerAttention(torch.autograd.Function):
    """The formula above for eager calls, over the plain functions, without the operators'
    per-call dispatch (docs/CONVENTIONS.md, "Eager calls": why, and why ``forward`` takes
    ``ctx``)."""

    @staticmethod
    def forward(ctx, *inputs):
        q, k, v, causal, softmax_scale = inputs
        output = attention_forward(q, k, v, causal, softmax_scale)
        setup_context(ctx, inputs, output)  # the operators' formula, as they run it
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not zeros
    def backward(ctx, dout, dlse):
        dq, dk, dv = attention_backward(dout, *ctx.saved_tensors, *ctx.settings)
        return dq, dk, dv, None, None


def attention(q, k, v, causal=False, softmax_scale=None):
    """Differentiable FlashAttention on Blackwell: ``q [B, Sq, H, D]``, ``k, v [B, Sk, H, D]``
    (fp16/bf16, CUDA) → ``out [B, Sq, H, D]``; ``out.backward`` runs the TCGEN05 backward."""
    _check_inputs(q, k, v, causal, softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.contiguous() for t in (q, k, v))
    # Compiled code (and fake tensors) call the operator; an eager call on real tensors runs the
    # same formula as a plain Function (EagerAttention), without the operator's dispatch.
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    apply = EagerAttention.apply if eager else attention_forward_op
    out, _ = apply(q, k, v, causal, float(softmax_scale))
    return out


# ----------------------------------------------------------------------------- reference
def ref_program(q, k, v, causal=False, softmax_scale=None):
    """Plain PyTorch in float32 (float64 inputs stay float64; runs on CPU too); differentiable,
    so autograd through it gives the reference dQ, dK, dV."""
    acc = torch.promote_types(q.dtype, torch.float32)
    D = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    groups = q.shape[2] // k.shape[2]
    qf = q.to(acc)
    kf, vf = (einops.repeat(t.to(acc), "b s h d -> b s (h g) d", g=groups) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        rows = torch.arange(Sq, device=q.device)[:, None]
        cols = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (Sk - Sq), float("-inf"))
    # Rows that see no key: probabilities 0 (softmax would give NaN), output 0.
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)


# ----------------------------------------------------------------------------- main
def _harness():
    """examples/harness.py: flags, checks, timing and peers shared by every script."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import harness

    return harness


def build_parser():
    # No --tune: the SM100 kernels have one set of tiles, no tune_configs to compare.
    parser = _harness().base_parser(
        __doc__.splitlines()[0], archs=ARCHS, dims=HEAD_DIMS, seq_len=2048, tune=False
    )
    return parser


def main(argv=None):
    harness = _harness()
    parser = build_parser()
    args = parser.parse_args(argv)
    Hkv = args.heads
    B, H, Sq, D = args.batch, args.heads, args.seq_len, args.dim
    Sk = args.seq_len_k or Sq
    scale = 1.0 / math.sqrt(D)
    script = pathlib.Path(__file__).name

    if args.compile_only:
        kargs = (B, H, Hkv, Sq, Sk, D, args.causal, scale, args.dtype)
        fwd, bwd = build_kernels(kargs, target=harness.target_for(args.arch))
        print(f"{script}: built forward and backward for {args.arch}")
        print(harness.describe_source("flashattn_fwd[ss]", fwd.get_kernel_source()))
        print(harness.describe_source("flashattn_bwd", bwd.get_kernel_source()))
        return

    harness.require_gpu(script, arch="sm_100a", capability=(10, 0))
    dtype = harness.DTYPES[args.dtype]
    torch.manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)

    if args.check:
        out = attention(q, k, v, args.causal, scale)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = ref_program(q, k, v, args.causal, scale)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        print(f"check B{B} H{H} Sq{Sq} Sk{Sk} D{D} causal={args.causal} {args.dtype}")
        harness.check_close("out", out, ref, rtol=1e-2)  # fp16/bf16 forward
        for name, g, rg in zip(("dQ", "dK", "dV"), grads, ref_grads, strict=True):
            harness.check_close(name, g, rg, rtol=2e-2)  # gradients

    if args.bench:
        flops = harness.attention_flops(B, H, Sq, Sk, D, D, args.causal, backward=True)
        out = attention(q, k, v, args.causal, scale)
        ours = {"tilelang": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)}
        peers = {}
        for name, fwd_fn in harness.sdpa_peers(q, k, v, args.causal, scale).items():
            if name == "fa3":
                continue  # forward only
            peer_out = fwd_fn()
            peers[name] = lambda o=peer_out: torch.autograd.grad(
                o, (q, k, v), dout.transpose(1, 2), retain_graph=True
            )
        title = f"backward B{B} H{H} Sq{Sq} Sk{Sk} D{D} causal={args.causal}"
        harness.report(title, ours, peers, flops)


if __name__ == "__main__":
    main()
