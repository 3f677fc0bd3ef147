"""The torch-facing functions as custom operators, for torch.compile (docs/CONVENTIONS.md,
"torch.compile").

CPU: every operator's schema; its fake implementation (shapes, dtypes, strides) under
FakeTensorMode, with the real kernels unreachable; ``torch.library.opcheck`` on meta tensors,
where the fake implementation is what runs; the public functions traced by torch.compile on fake
CUDA tensors: no graph break, and how often a new length recompiles; configs reaching the
kernels; ValueErrors, eager and compiled; the SM100 scripts' operators (a variant in the
forward, no config in the backward) and the attention-sink scripts' (sinks or None, the window,
dsinks) alike. GPU (marker ``gpu``): a two-layer model compiled with ``fullgraph=True`` gives
eager's outputs and gradients (the sink model's dsinks included), with no graph break, and
recompiles as the CPU tests say (Hopper scripts; the SM100 scripts' GPU tests, eager, are in
test_sm100.py).
"""

import inspect
import types

import pytest
import torch
from helpers import load_script, rel_err
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import harness

MHA_BWD = "flash_attention/example_mha_bwd_bshd.py"
MHA_VARLEN = "flash_attention/example_mha_fwd_varlen.py"
FAST_BWD = "flash_attention/example_mha_bwd_wgmma_pipelined.py"
GQA_BWD = "flash_attention/example_gqa_bwd.py"  # its operators take a strategy before config
TMA_BWD = "flash_attention/example_gqa_bwd_tma_reduce.py"
VARLEN_BWD = "flash_attention/example_gqa_bwd_tma_reduce_varlen.py"
SM100_MHA_FWD = "flash_attention_sm100/mha_fwd_bshd.py"  # their operators take a variant
SM100_GQA_FWD = "flash_attention_sm100/gqa_fwd_bshd.py"
SM100_MHA_BWD = "flash_attention_sm100/mha_bwd_bshd.py"  # their operators take no config
SM100_GQA_BWD = "flash_attention_sm100/gqa_bwd_bshd.py"
# script: its operators' schemas (the forward's first; a differentiable script's backward second)
SCHEMAS = {
    "flash_attention/example_mha_fwd_bshd.py": [
        "tl_attn::mha_fwd_bshd(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, "
        "SymInt[]? config) -> (Tensor, Tensor)"
    ],
    "flash_attention/example_mha_fwd_bhsd.py": [
        "tl_attn::mha_fwd_bhsd(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, "
        "SymInt[]? config) -> (Tensor, Tensor)"
    ],
    "flash_attention/example_gqa_fwd_bshd.py": [
        "tl_attn::gqa_fwd_bshd(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, "
        "SymInt[]? config) -> (Tensor, Tensor)"
    ],
    MHA_VARLEN: [
        "tl_attn::mha_fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, "
        "float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)"
    ],
    "flash_attention/example_gqa_fwd_varlen.py": [
        "tl_attn::gqa_fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, "
        "float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)"
    ],
    MHA_BWD: [
        "tl_attn::mha_bwd_bshd_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)",
        "tl_attn::mha_bwd_bshd_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, bool causal, float softmax_scale, SymInt[]? config) "
        "-> (Tensor, Tensor, Tensor)",
    ],
    "flash_attention/example_mha_bwd_bhsd.py": [
        "tl_attn::mha_bwd_bhsd_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)",
        "tl_attn::mha_bwd_bhsd_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, bool causal, float softmax_scale, SymInt[]? config) "
        "-> (Tensor, Tensor, Tensor)",
    ],
    FAST_BWD: [
        "tl_attn::mha_bwd_wgmma_pipelined_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)",
        "tl_attn::mha_bwd_wgmma_pipelined_backward(Tensor dout, Tensor q, Tensor k, Tensor v, "
        "Tensor out, Tensor lse, bool causal, float softmax_scale, SymInt[]? config) "
        "-> (Tensor, Tensor, Tensor)",
    ],
    GQA_BWD: [
        "tl_attn::gqa_bwd_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, str strategy, SymInt[]? config) -> (Tensor, Tensor)",
        "tl_attn::gqa_bwd_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, bool causal, float softmax_scale, str strategy, SymInt[]? config) "
        "-> (Tensor, Tensor, Tensor)",
    ],
    TMA_BWD: [
        "tl_attn::gqa_bwd_tma_reduce_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)",
        "tl_attn::gqa_bwd_tma_reduce_backward(Tensor dout, Tensor q, Tensor k, Tensor v, "
        "Tensor out, Tensor lse, bool causal, float softmax_scale, SymInt[]? config) "
        "-> (Tensor, Tensor, Tensor)",
    ],
    VARLEN_BWD: [
        "tl_attn::gqa_bwd_tma_reduce_varlen_forward(Tensor q, Tensor k, Tensor v, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
        "bool causal, float softmax_scale, SymInt[]? config) -> (Tensor, Tensor)",
        "tl_attn::gqa_bwd_tma_reduce_varlen_backward(Tensor dout, Tensor q, Tensor k, "
        "Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, float softmax_scale, "
        "SymInt[]? config) -> (Tensor, Tensor, Tensor)",
    ],
    SM100_MHA_FWD: [
        "tl_attn::sm100_mha_fwd_bshd(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, str variant, SymInt[]? config) -> (Tensor, Tensor)"
    ],
    SM100_GQA_FWD: [
        "tl_attn::sm100_gqa_fwd_bshd(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, str variant, SymInt[]? config) -> (Tensor, Tensor)"
    ],
    SM100_MHA_BWD: [
        "tl_attn::sm100_mha_bwd_bshd_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale) -> (Tensor, Tensor)",
        "tl_attn::sm100_mha_bwd_bshd_backward(Tensor dout, Tensor q, Tensor k, Tensor v, "
        "Tensor out, Tensor lse, bool causal, float softmax_scale) -> (Tensor, Tensor, Tensor)",
    ],
    SM100_GQA_BWD: [
        "tl_attn::sm100_gqa_bwd_bshd_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale) -> (Tensor, Tensor)",
        "tl_attn::sm100_gqa_bwd_bshd_backward(Tensor dout, Tensor q, Tensor k, Tensor v, "
        "Tensor out, Tensor lse, bool causal, float softmax_scale) -> (Tensor, Tensor, Tensor)",
    ],
}
SCRIPTS = list(SCHEMAS)
BACKWARD = [s for s in SCRIPTS if "bwd" in s]
VARLEN = [s for s in SCRIPTS if "varlen" in s]
DTYPES = [torch.float16, torch.bfloat16]


def layout(script):
    return "varlen" if "varlen" in script else "bhsd" if "bhsd" in script else "bshd"


def inputs(
    script, B=2, Sq=5, Sk=7, H=4, D=64, dtype=torch.float16, device="cuda", Dv=None, Hkv=None
):
    """The operator's tensor (and int) arguments: q, k, v, then for varlen cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k (B sequences of Sq queries and Sk keys). GQA
    scripts get half as many kv heads unless ``Hkv`` says; ``Dv`` is v's head dim (default D)."""
    Hkv = Hkv or (H // 2 if "gqa" in script else H)
    Dv = Dv or D

    def empty(*shape):
        return torch.empty(*shape, device=device, dtype=dtype)

    if layout(script) == "varlen":
        cu_q, cu_k = (torch.arange(B + 1, device=device, dtype=torch.int32) * S for S in (Sq, Sk))
        return empty(B * Sq, H, D), empty(B * Sk, Hkv, D), empty(B * Sk, Hkv, D), cu_q, cu_k, Sq, Sk
    if layout(script) == "bhsd":
        return empty(B, H, Sq, D), empty(B, Hkv, Sk, D), empty(B, Hkv, Sk, Dv)
    return empty(B, Sq, H, D), empty(B, Sk, Hkv, D), empty(B, Sk, Hkv, Dv)


def lse_shape(script, args):
    q = args[0]
    if layout(script) == "varlen":
        return (q.shape[1], q.shape[0])  # [H, total_q]
    return (q.shape[0], q.shape[2], q.shape[1]) if layout(script) == "bshd" else q.shape[:3]


def public(script):
    mod = load_script(script)
    return mod.attention_varlen if layout(script) == "varlen" else mod.attention


# Operators that take a string between softmax_scale and config: example_gqa_bwd.py's strategy
# (its public function settles the default from the device's arch, which a CPU has not) and the
# SM100 forward scripts' variant. script: (the public function's keyword, every value it takes,
# the first the one a test uses where it names none).
CHOICES = {
    GQA_BWD: ("strategy", ("group", "atomic", "split")),
    SM100_MHA_FWD: ("variant", ("wasp", "ss", "ts")),
    SM100_GQA_FWD: ("variant", ("ts", "ss")),
}
# The SM100 backward scripts have one set of tiles: their operators take no config.
NO_CONFIG = [SM100_MHA_BWD, SM100_GQA_BWD]


def choice(script, name=None):
    """The arguments to put between softmax_scale and config (``name``, or the script's first
    value), and the keyword for the public function; nothing for a script without a choice."""
    if script not in CHOICES:
        return (), {}
    keyword, names = CHOICES[script]
    name = name or names[0]
    return (name,), {keyword: name}


def settings(script, causal, softmax_scale, config, name=None):
    """The operators' arguments after the tensors (and varlen lengths)."""
    config = () if script in NO_CONFIG else (config,)
    return (causal, softmax_scale, *choice(script, name)[0], *config)


def config_keys(script, name=None):
    """CONFIG_KEYS, for ``name`` where they depend on the choice; none without a config."""
    if script in NO_CONFIG:
        return ()
    keys = load_script(script).CONFIG_KEYS
    return keys[choice(script, name)[0][0]] if isinstance(keys, dict) else keys


def backward_args(script, args, out, lse):
    """The backward operator's tensor (and int) arguments, with ``out`` as dout too."""
    q, k, v, *lengths = args  # varlen: cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    return (out, q, k, v, out, lse, *lengths)


@pytest.fixture
def no_kernels(monkeypatch):
    """Make the functions the operators' real implementations call fail the test."""

    def forbid(script):
        mod = load_script(script)
        for name in ("attention_forward", "attention_backward", "_check_values"):
            if hasattr(mod, name):
                fail = lambda *a, _n=name, **kw: pytest.fail(f"the real {_n} ran")  # noqa: E731
                monkeypatch.setattr(mod, name, fail)
        return mod

    return forbid


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- CPU: operators
@pytest.mark.parametrize("script", SCRIPTS)
def test_operator_schemas(script):
    mod = load_script(script)
    ops = [mod.attention_forward_op]
    if script in BACKWARD:
        ops.append(mod.attention_backward_op)
    assert [str(op._opoverload._schema) for op in ops] == SCHEMAS[script]


def check_fake_outputs(script, mod, args, causal, name=None):
    """The operators and the public function on fake CUDA tensors ``args``: out like q (with
    v's head dim), lse float32 and contiguous, gradients like q, k, v."""
    q, k, v = args[:3]
    out_shape = (*q.shape[:-1], v.shape[-1])
    out, lse = mod.attention_forward_op(*args, *settings(script, causal, 0.125, None, name))
    assert (out.shape, out.is_contiguous(), out.dtype) == (out_shape, True, q.dtype)
    assert lse.shape == lse_shape(script, args) and lse.dtype == torch.float32
    assert lse.is_contiguous() and out.device == lse.device == q.device
    if script in BACKWARD:
        grads = mod.attention_backward_op(
            *backward_args(script, args, out, lse), *settings(script, causal, 0.125, None, name)
        )
        for grad, t in zip(grads, (q, k, v), strict=True):
            assert (grad.shape, grad.stride(), grad.dtype) == (t.shape, t.stride(), q.dtype)
        kw = choice(script, name)[1]
        assert public(script)(*args, causal=causal, **kw).shape == out_shape
    else:
        out, lse = public(script)(*args, causal=causal, return_lse=True)
        assert out.shape == q.shape and lse.shape == lse_shape(script, args)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_fake_outputs_are_shaped_like_the_real_ones(script, dtype, causal, no_kernels):
    """Under FakeTensorMode (CUDA tensors without a GPU) every operator, and the public function
    around it, returns what the real kernels would: out like q, lse float32 and contiguous,
    gradients like q, k, v."""
    mod = no_kernels(script)
    with FakeTensorMode():
        check_fake_outputs(script, mod, inputs(script, dtype=dtype), causal)


GQA_CASES = [
    (name, dims)
    for name in ("group", "atomic", "split")
    for dims in ((64, 64), (128, 128), (192, 128))
    if name != "group" or dims[0] == dims[1]  # group builds 64/64 and 128/128
]


@pytest.mark.parametrize(
    "name,dims", GQA_CASES, ids=[f"{n}-{dqk}-{dv}" for n, (dqk, dv) in GQA_CASES]
)
@pytest.mark.parametrize("groups", [1, 4])
def test_gqa_bwd_fake_outputs_per_strategy_and_head_dims(name, dims, groups, no_kernels):
    """example_gqa_bwd.py, every strategy with every head-dim pair it builds and groups of 1 and
    4: out [B, Sq, H, Dv], gradients like q, k, v (dk with Dqk, dv with Dv)."""
    mod = no_kernels(GQA_BWD)
    Dqk, Dv = dims
    with FakeTensorMode():
        args = inputs(GQA_BWD, H=8, Hkv=8 // groups, D=Dqk, Dv=Dv, dtype=torch.bfloat16)
        check_fake_outputs(GQA_BWD, mod, args, True, name)


OPCHECK_TESTS = (  # every test torch.library.opcheck has
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)


def opcheck_cases():
    return [(s, i) for s in SCRIPTS for i in range(1 + (s in BACKWARD))]


@pytest.mark.parametrize(
    "script,which", opcheck_cases(), ids=[f"{s[16:-3]}-{'fb'[i]}" for s, i in opcheck_cases()]
)
def test_opcheck_on_meta_tensors(script, which, no_kernels):
    """torch.library.opcheck, every test it has, on meta tensors: a meta tensor's kernel is the
    operator's fake implementation (the real one would need a GPU), so this checks the schema,
    the autograd registration (inputs requiring grad) and the fake implementation under
    AOTAutograd with static and dynamic shapes."""
    mod = no_kernels(script)
    gqa = script == GQA_BWD  # its atomic strategy, with Dqk 192 and Dv 128
    name, dims = ("atomic", dict(D=192, Dv=128)) if gqa else (None, {})
    args = inputs(script, device="meta", **dims)
    if which == 0:
        q, k, v = (t.requires_grad_(script in BACKWARD) for t in args[:3])
        op = mod.attention_forward_op
        args = (q, k, v, *args[3:], *settings(script, True, 0.125, None, name))
    else:  # the backward operator is not differentiable itself: plain inputs
        out, lse = mod.attention_forward_op(*args, *settings(script, True, 0.125, None, name))
        tiles = list(tune_space(script, name)[0].values())
        op = mod.attention_backward_op
        args = (*backward_args(script, args, out, lse), *settings(script, True, 0.125, tiles, name))
    torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("script", BACKWARD)
def test_autograd_saves_inputs_and_outputs_and_passes_config_to_backward(script, monkeypatch):
    """The forward operator's autograd formula saves q, k, v, out, lse (lse not differentiable;
    varlen: and both cu_seqlens) and hands the backward operator causal, softmax_scale, the
    config (and the strategy; varlen: and both max lengths); on meta tensors."""
    mod = load_script(script)
    seen = []

    def backward_op(dout, q, k, v, out, lse, *rest):
        seen.append((q, k, v, out, lse, rest))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(mod, "attention_backward_op", backward_op)
    args = inputs(script, device="meta")
    q, k, v = (t.requires_grad_() for t in args[:3])
    config = tune_space(script)[0]
    tiles = [config[key] for key in config_keys(script)]
    out, lse = mod.attention_forward_op(q, k, v, *args[3:], *settings(script, True, 0.25, tiles))
    assert out.requires_grad and not lse.requires_grad
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    ((sq, sk, sv, sout, slse, rest),) = seen
    want = (*args[3:], *settings(script, True, 0.25, tiles))  # varlen: cu_seqlens and lengths
    assert [a.shape if isinstance(a, torch.Tensor) else a for a in rest] == [
        a.shape if isinstance(a, torch.Tensor) else a for a in want
    ]
    if script not in NO_CONFIG:
        assert dict(zip(config_keys(script), rest[-1], strict=True)) == config
    assert sq.shape == q.shape and sout.shape == out.shape and slse.shape == lse.shape


def tune_space(script, name=None):
    """The tune configs at head dim 64 (the forward scripts', and the GQA ones', take the head
    dims; example_gqa_bwd.py's, the strategy too). The SM100 scripts have none: a forward
    script's are its variant's default tiles and the same with 64 keys a block, a backward
    script's one empty config (its operators take none)."""
    mod = load_script(script)
    if script in NO_CONFIG:
        return [{}]
    name = choice(script, name)[0][0] if script in CHOICES else None
    if not hasattr(mod, "tune_configs"):
        default = mod.default_config(*[name][: mod.default_config.__code__.co_argcount])
        return [default, {**default, "block_N": 64}]
    params = mod.tune_configs.__code__.co_argcount
    return mod.tune_configs(*[64, 64, name][:params])


def every_choice(script):
    """Every value of the script's choice (CHOICES); [None] for a script without one."""
    return list(CHOICES[script][1]) if script in CHOICES else [None]


CONFIG_CASES = [(s, n) for s in SCRIPTS if s not in NO_CONFIG for n in every_choice(s)]


@pytest.mark.parametrize(
    "script,name", CONFIG_CASES, ids=[f"{s[16:-3]}-{n}" if n else s[16:-3] for s, n in CONFIG_CASES]
)
def test_config_travels_as_its_values_in_config_keys_order(script, name, monkeypatch):
    """attention(config=...) hands the operator the config's values in CONFIG_KEYS order (its
    strategy's, in example_gqa_bwd.py; its variant's, in the SM100 forward), and the operator's
    real implementation hands its Python function (the backward's, in a differentiable script)
    the same dict, and the strategy or variant after it, for every config --tune tries (the SM100
    forward scripts: their default tiles and one more)."""
    mod = load_script(script)
    passed, received = [], []
    real_op = mod.attention_forward_op
    python_function = mod.attention_backward if script in BACKWARD else mod.attention_forward
    config_at = list(inspect.signature(python_function).parameters).index("config")

    def op(*args):
        passed.append(args[-1])
        return real_op(*args)

    def implementation(outputs):  # stands in for attention_forward / attention_backward
        def record(*args):
            received.append(args[config_at:])
            return tuple(torch.empty(0) for _ in range(outputs))

        return record

    monkeypatch.setattr(mod, "attention_forward_op", op)
    monkeypatch.setattr(mod, "_check_values", lambda *a: None, raising=False)  # varlen, CPU
    extra, kw = choice(script, name)
    for config in tune_space(script, name):
        assert tuple(config) == config_keys(script, name)
        with FakeTensorMode():  # the wrapper's checks pass on fake CUDA tensors
            public(script)(*inputs(script), config=config, **kw)
        assert passed[-1] == list(config.values())
        received.clear()
        cpu = inputs(script, device="cpu")  # the real implementation, as the dispatcher calls it
        if script in BACKWARD:
            monkeypatch.setattr(mod, "attention_backward", implementation(3))
            q = cpu[0]
            mod.attention_backward_op(
                *backward_args(script, cpu, q, q), False, 0.125, *extra, passed[-1]
            )
        else:
            monkeypatch.setattr(mod, "attention_forward", implementation(2))
            real_op(*cpu, False, 0.125, *extra, passed[-1])
        assert received == [(config, *extra)]


# ----------------------------------------------------------------------------- CPU: torch.compile
@pytest.mark.parametrize("script", SCRIPTS)
def test_no_graph_break(script):
    """torch._dynamo.explain over the public function on fake CUDA tensors: one graph, no break,
    holding the operator."""
    kw = choice(script)[1]
    with FakeTensorMode():
        args = inputs(script)
        explained = torch._dynamo.explain(lambda *a: public(script)(*a, causal=True, **kw))(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    op = SCHEMAS[script][0].split("(")[0].replace("::", ".")
    assert f"torch.ops.{op}.default" in explained.graphs[0].code


DEFAULT_STRATEGIES = [((9, 0), 64, "group"), ((9, 0), 192, "atomic"), ((8, 0), 64, "atomic")]


@pytest.mark.parametrize(
    "capability,Dqk,expected",
    DEFAULT_STRATEGIES,
    ids=[f"sm{ma}{mi}-D{d}-{e}" for (ma, mi), d, e in DEFAULT_STRATEGIES],
)
def test_gqa_bwd_default_strategy_is_settled_in_traced_code(capability, Dqk, expected, monkeypatch):
    """example_gqa_bwd.py without a strategy: default_strategy, from the device's arch
    (torch.cuda.get_device_capability, which dynamo records in the graph and reads as
    constants), picks it before the operator is called, without a graph break, and it reaches
    the operator as a string. A CPU has no device to ask: torch.cuda.get_device_properties,
    which get_device_capability reads, stands in for an H100 (9, 0) or an A100 (8, 0)."""
    major, minor = capability
    props = types.SimpleNamespace(major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    with FakeTensorMode():
        args = inputs(GQA_BWD, D=Dqk, Dv=128 if Dqk == 192 else None)
        explained = torch._dynamo.explain(lambda *a: public(GQA_BWD)(*a, causal=True))(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert "torch.ops.tl_attn.gqa_bwd_forward.default" in explained.graphs[0].code
    assert f", '{expected}', None)" in explained.graphs[0].code


@pytest.mark.parametrize("dynamic,compiles", [(False, [1, 2, 3, 3]), (None, [1, 2, 2, 2])])
def test_recompiles_per_length(dynamic, compiles):
    """Dense: with dynamic=False each new sequence length compiles again (a length seen before
    does not); with the default (dynamic=None) the second length recompiles with the lengths
    symbolic and no later length compiles again."""
    counter = CompileCounter()
    step = torch.compile(public(MHA_BWD), backend=counter, fullgraph=True, dynamic=dynamic)
    seen = []
    with FakeTensorMode():
        for S in (128, 256, 384, 128):
            out = step(*inputs(MHA_BWD, Sq=S, Sk=S), True)
            assert out.shape[1] == S
            seen.append(counter.frame_count)
    assert seen == compiles


def test_varlen_compiles_once_with_dynamic_shapes():
    """Varlen: with dynamic=True one compile serves batches that differ in token count, batch
    size and max_seqlen, as one TileLang kernel does."""
    counter = CompileCounter()
    run = torch.compile(public(MHA_VARLEN), backend=counter, fullgraph=True, dynamic=True)
    with FakeTensorMode():
        # (cu_seqlens of B + 1 = 4 entries would be tied to the 4 heads by duck sizing)
        for B, S in ((2, 50), (2, 90), (6, 120)):
            out = run(*inputs(MHA_VARLEN, B=B, Sq=S, Sk=S), causal=True)
            assert out.shape[0] == B * S
    assert counter.frame_count == 1


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in VARLEN])
def test_value_errors_eager_and_compiled(script):
    """Bad input raises the same ValueError eagerly and from torch.compile without fullgraph
    (the graph breaks there and the check runs eagerly); with fullgraph=True compiling stops
    with torch._dynamo.exc.Unsupported, whose message holds the ValueError's."""
    q, k, v = inputs(script, device="cpu")
    bad = (q, k, v.float())
    message = "must share a dtype"
    with pytest.raises(ValueError, match=message):
        public(script)(*bad)
    with pytest.raises(ValueError, match=message):
        torch.compile(public(script), backend="aot_eager")(*bad)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
        torch.compile(public(script), backend="aot_eager", fullgraph=True)(*bad)


@pytest.mark.parametrize("script", VARLEN)
def test_varlen_value_checks_run_inside_the_compiled_operator(script):
    """Varlen checks that read cu_seqlens run in the operator's real implementation: under
    torch.compile(fullgraph=True) they raise the same ValueError from compiled code, and the
    values are kept on the caller's tensor, as in eager mode (CPU tensors: every check but the
    last, the device, passes)."""
    args = list(inputs(script, B=3, device="cpu"))
    run = torch.compile(public(script), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="CUDA tensors"):
        run(*args)
    cu_q = args[3]
    assert cu_q._host_values == (cu_q._version, [0, 5, 10, 15])
    cu_q[1] = 11  # now decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        run(*args)
    cu_q[1] = 5
    with pytest.raises(ValueError, match="max_seqlen_k .4. must be at least"):
        run(*args[:6], 4)


# ----------------------------------------------------------------------------- CPU: attention sinks
# examples/attention_sink/: the same pattern with two more arguments, sinks (Tensor?: None is
# plain attention) and the window as two ints; the backward operator also returns dsinks, None
# when sinks is (a Tensor? output). Their tests stand apart: the arguments differ from every
# other script's.
SINK_FWD = "attention_sink/example_gqa_sink_fwd_bhsd.py"
SINK_BWD = "attention_sink/example_gqa_sink_bwd_bhsd.py"
SINK_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor? sinks, SymInt window_size_left, "
    "SymInt window_size_right, bool causal, float softmax_scale, SymInt[]? config"
)
# The backward script's operators also take its strategy (a string) before config.
SINK_BWD_ARGS = SINK_ARGS.replace("SymInt[]? config", "str strategy, SymInt[]? config")
SINK_SCHEMAS = {
    SINK_FWD: [f"tl_attn::gqa_sink_fwd_bhsd({SINK_ARGS}) -> (Tensor, Tensor)"],
    SINK_BWD: [
        f"tl_attn::gqa_sink_bwd_bhsd_forward({SINK_BWD_ARGS}) -> (Tensor, Tensor)",
        "tl_attn::gqa_sink_bwd_bhsd_backward(Tensor dout, Tensor q, Tensor k, Tensor v, "
        "Tensor out, Tensor lse, Tensor? sinks, SymInt window_size_left, "
        "SymInt window_size_right, bool causal, float softmax_scale, str strategy, "
        "SymInt[]? config) -> (Tensor, Tensor, Tensor, Tensor?)",
    ],
}
SINK_SCRIPTS = list(SINK_SCHEMAS)
SINK_WINDOWS = [((-1, -1), False), ((128, 0), True), ((3, 2), False)]


def sink_inputs(sinks=True, device="cuda", **sizes):
    """q [B, H, Sq, D], k, v [B, Hkv, Sk, D] (``inputs``' sizes; half as many kv heads unless
    ``Hkv`` says) and sinks float32 [H], or None."""
    q, k, v = inputs(SINK_FWD, device=device, **sizes)
    return q, k, v, torch.empty(q.shape[1], device=device) if sinks else None


# The backward script's strategy is a choice too ("atomic" first: its tiles are what
# default_config gives by default).
CHOICES[SINK_BWD] = ("strategy", ("atomic", "group"))


def sink_settings(window=(128, 0), causal=True, softmax_scale=0.125, config=None, script=SINK_FWD):
    """The operators' arguments after sinks."""
    return (*window, causal, softmax_scale, *choice(script)[0], config)


@pytest.mark.parametrize("script", SINK_SCRIPTS)
def test_sink_operator_schemas(script):
    mod = load_script(script)
    ops = [mod.attention_forward_op] + ([mod.attention_backward_op] if script == SINK_BWD else [])
    assert [str(op._opoverload._schema) for op in ops] == SINK_SCHEMAS[script]


@pytest.mark.parametrize("script", SINK_SCRIPTS)
@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no_sinks"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,causal", SINK_WINDOWS, ids=["full", "causal-128", "3-2"])
def test_sink_fake_outputs_are_shaped_like_the_real_ones(
    script, sinks, groups, dtype, window, causal, no_kernels
):
    """Under FakeTensorMode: out like q (shape, strides, dtype), lse float32 [B, H, Sq] and
    contiguous; the backward operator's dq, dk, dv like q, k, v and dsinks float32 [H] and
    contiguous, or None without sinks; the public function around them likewise."""
    mod = no_kernels(script)
    with FakeTensorMode():
        q, k, v, s = sink_inputs(sinks, H=8, Hkv=8 // groups, dtype=dtype)
        settings = sink_settings(window, causal, script=script)
        out, lse = mod.attention_forward_op(q, k, v, s, *settings)
        assert (out.shape, out.stride(), out.dtype) == (q.shape, q.stride(), q.dtype)
        assert (lse.shape, lse.dtype, lse.is_contiguous()) == (q.shape[:3], torch.float32, True)
        if script == SINK_BWD:
            *grads, dsinks = mod.attention_backward_op(out, q, k, v, out, lse, s, *settings)
            for grad, t in zip(grads, (q, k, v), strict=True):
                assert (grad.shape, grad.stride(), grad.dtype) == (t.shape, t.stride(), q.dtype)
            if sinks:
                assert (dsinks.shape, dsinks.dtype, dsinks.is_contiguous()) == (
                    s.shape, torch.float32, True,
                )  # fmt: skip
            else:
                assert dsinks is None
            assert mod.attention(q, k, v, s, window, causal, strategy="group").shape == q.shape
        else:
            out, lse = mod.attention(q, k, v, s, window, causal, return_lse=True)
            assert out.shape == q.shape and lse.shape == q.shape[:3]


def sink_opcheck_cases():
    return [(s, i, w) for s in SINK_SCRIPTS for i in range(1 + (s == SINK_BWD)) for w in (1, 0)]


@pytest.mark.parametrize(
    "script,which,sinks",
    sink_opcheck_cases(),
    ids=[f"{s[15:-3]}-{'fb'[i]}-{'sinks' if w else 'none'}" for s, i, w in sink_opcheck_cases()],
)
def test_sink_opcheck_on_meta_tensors(script, which, sinks, no_kernels):
    """torch.library.opcheck, every test it has, on meta tensors (the fake implementation runs),
    with sinks and without (None): schema, autograd registration (q, k, v and sinks requiring
    grad in the differentiable script) and the fake implementation under AOTAutograd, static
    and dynamic."""
    mod = no_kernels(script)
    q, k, v, s = sink_inputs(sinks, device="meta")
    if which == 0:
        grad = script == SINK_BWD
        q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
        s = s if s is None else s.requires_grad_(grad)
        op, args = mod.attention_forward_op, (q, k, v, s, *sink_settings(script=script))
    else:  # the backward operator is not differentiable itself: plain inputs
        out, lse = mod.attention_forward_op(q, k, v, s, *sink_settings(script=script))
        tiles = list(mod.default_config(64).values())
        op = mod.attention_backward_op
        args = (out, q, k, v, out, lse, s, *sink_settings(config=tiles, script=script))
    torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no_sinks"])
def test_sink_autograd_saves_sinks_and_returns_dsinks(sinks, monkeypatch):
    """The forward operator's autograd formula saves q, k, v, out, lse and sinks (None without
    sinks; lse not differentiable) and hands the backward operator the window, causal,
    softmax_scale and config; the backward operator's dsinks becomes sinks' gradient, and
    without sinks q, k, v get theirs (autograd expects None for the None input); on meta
    tensors."""
    mod = load_script(SINK_BWD)
    seen = []

    def backward_op(dout, q, k, v, out, lse, s, *rest):
        seen.append((q, k, v, out, lse, s, rest))
        dsinks = None if s is None else torch.full_like(s, 3.0)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsinks

    monkeypatch.setattr(mod, "attention_backward_op", backward_op)
    q, k, v, s = sink_inputs(sinks, device="meta")
    leaves = [t.requires_grad_() for t in (q, k, v, s) if t is not None]
    tiles = list(mod.default_config(64).values())
    settings = sink_settings((7, 0), True, 0.25, tiles, SINK_BWD)
    out, lse = mod.attention_forward_op(q, k, v, s, *settings)
    assert out.requires_grad and not lse.requires_grad
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    ((sq, sk, sv, sout, slse, ss, rest),) = seen
    assert (sq, sk, sv, sout.shape, slse.shape) == (q, k, v, out.shape, lse.shape)
    assert ss is s and rest == settings
    if sinks:
        assert grads[3].device.type == "meta" and grads[3].shape == s.shape


@pytest.mark.parametrize("script", SINK_SCRIPTS)
def test_sink_config_travels_as_its_values_in_config_keys_order(script, monkeypatch):
    """attention(config=...) hands the operator the config's values in CONFIG_KEYS order, and
    the operator's real implementation hands attention_forward (the forward script's tune
    configs) or attention_backward (the backward's default tiles) the same dict."""
    mod = load_script(script)
    passed, received = [], []
    real_op = mod.attention_forward_op
    bwd = script == SINK_BWD

    def op(*args):
        passed.append(args[-1])
        return real_op(*args)

    def implementation(*args):  # stands in for attention_forward / attention_backward
        received.append(
            args[-2] if bwd else args[-1]
        )  # attention_backward: (..., config, strategy)
        outputs = tuple(torch.empty(0) for _ in range(3 if bwd else 2))
        return (*outputs, None) if bwd else outputs

    monkeypatch.setattr(mod, "attention_forward_op", op)
    monkeypatch.setattr(mod, "attention_backward" if bwd else "attention_forward", implementation)
    configs = [mod.default_config(64)] if bwd else mod.tune_configs(64)
    for config in configs:
        assert tuple(config) == (mod.CONFIG_KEYS["atomic"] if bwd else mod.CONFIG_KEYS)
        with FakeTensorMode():  # the wrapper's checks pass on fake CUDA tensors
            mod.attention(*sink_inputs(), (128, 0), True, config=config, **choice(script)[1])
        assert passed[-1] == list(config.values())
        received.clear()
        q, k, v, s = sink_inputs(device="cpu")  # the real implementation, as dispatched
        if bwd:
            mod.attention_backward_op(
                q, q, k, v, q, q, s, *sink_settings(config=passed[-1], script=script)
            )
        else:
            real_op(q, k, v, s, *sink_settings(config=passed[-1]))
        assert received == [config]


@pytest.mark.parametrize("script", [FAST_BWD, GQA_BWD, SINK_BWD])
def test_hand_scheduled_config_may_leave_out_the_grid_choices(script, monkeypatch):
    """A config for the hand-scheduled backward given without ``head_splits`` and
    ``interleave`` (the grid-shaped choices) travels with their plain values, 1 and 1."""
    mod = load_script(script)
    passed = []
    real_op = mod.attention_forward_op

    def op(*args):
        passed.append(args[-1])
        return real_op(*args)

    monkeypatch.setattr(mod, "attention_forward_op", op)
    tiles = dict(block_M=128, block_N=64, num_stages=2, dq_stages=1)
    with FakeTensorMode():
        if script == SINK_BWD:
            mod.attention(*sink_inputs(), (128, 0), True, strategy="group", config=tiles)
        else:
            kw = {"strategy": "group"} if script == GQA_BWD else {}
            mod.attention(*inputs(script), config=tiles, **kw)
    assert passed == [[128, 64, 2, 1, 1, 1]]
    full = dict(tiles, head_splits=2, interleave=4)
    assert load_script(FAST_BWD).config_values(full) == [128, 64, 2, 1, 2, 4]


@pytest.mark.parametrize("script", SINK_SCRIPTS)
@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no_sinks"])
def test_sink_no_graph_break(script, sinks):
    """torch._dynamo.explain over the public function on fake CUDA tensors, sinks or None, a
    window: one graph, no break, holding the operator with the window's two ints."""
    with FakeTensorMode():
        args = sink_inputs(sinks)
        mod = load_script(script)
        kw = choice(script)[1]
        attention = mod.attention
        explained = torch._dynamo.explain(lambda *a: attention(*a, (128, 0), True, **kw))(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    op = SINK_SCHEMAS[script][0].split("(")[0].replace("::", ".")
    code = explained.graphs[0].code
    settings = ", 128, 0, True, 0.125, " + ("'atomic', " if kw else "") + "None)"
    assert f"torch.ops.{op}.default" in code and settings in code


@pytest.mark.parametrize("script", SINK_SCRIPTS)
def test_sink_value_errors_eager_and_compiled(script):
    """Bad sinks raise the same ValueError eagerly and from torch.compile without fullgraph;
    with fullgraph=True compiling stops with torch._dynamo.exc.Unsupported holding its message."""
    attention = load_script(script).attention
    q, k, v, s = sink_inputs(device="cpu")
    bad = (q, k, v, s.half())
    message = "sinks must be float32"
    with pytest.raises(ValueError, match=message):
        attention(*bad)
    with pytest.raises(ValueError, match=message):
        torch.compile(attention, backend="aot_eager")(*bad)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
        torch.compile(attention, backend="aot_eager", fullgraph=True)(*bad)


# ----------------------------------------------------------------------------- GPU
def compare(got, want, rtol, names):
    for name, a, b in zip(names, got, want, strict=True):
        err = rel_err(a, b)
        assert err < rtol, f"{name}: relative error {err:.3e}"


def training_step(model, x, dout):
    """out and the gradients of every parameter and of x."""
    out = model(x)
    return (out, *torch.autograd.grad(out, [x, *model.parameters()], dout))


def dense_model(script, causal, dtype, heads=4, dim=64):
    """The two-layer model around the script's ``attention`` (GQA scripts: half as many kv
    heads)."""
    torch.manual_seed(0)
    heads_kv = heads // 2 if "gqa" in script else heads
    model = harness.TwoLayerModel(
        public(script), heads, dim, causal, layout(script), heads_kv=heads_kv
    )
    return model.to("cuda", dtype)


def dense_batch(dtype, S, B=2, width=256):
    x = torch.randn(B, S, width, device="cuda", dtype=dtype, requires_grad=True)
    return x, torch.randn_like(x)


# example_gqa_bwd.py runs its default strategy, "group" on Hopper at D64 (the test checks).
TRAINING = [(s, c, d) for s in (MHA_BWD, FAST_BWD, GQA_BWD) for c in (False, True) for d in DTYPES]
TRAINING += [
    ("flash_attention/example_mha_bwd_bhsd.py", False, torch.float16),
    ("flash_attention/example_mha_bwd_bhsd.py", True, torch.bfloat16),
    (TMA_BWD, True, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script,causal,dtype", TRAINING, ids=[f"{s[16:-3]}-{c}-{d}" for s, c, d in TRAINING]
)
def test_compiled_training_step_matches_eager(script, causal, dtype):
    """The two-layer model, torch.compile(fullgraph=True) against eager: out within 1e-2,
    gradients (x and every weight) within 2e-2; and no graph break."""
    model = dense_model(script, causal, dtype)
    x, dout = dense_batch(dtype, S=300)
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    if script == GQA_BWD:  # default_strategy, settled in traced code from the device's arch
        assert "'group', None)" in explained.graphs[0].code
    torch._dynamo.reset()
    eager = training_step(model, x, dout)
    compiled = training_step(torch.compile(model, fullgraph=True), x, dout)
    compare(compiled[:1], eager[:1], 1e-2, ["out"])  # fp16/bf16 forward
    names = ["dx"] + [f"d{name}" for name, _ in model.named_parameters()]
    compare(compiled[1:], eager[1:], 2e-2, names)  # fp16/bf16 gradients


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic,compiles", [(False, [1, 2, 3, 3]), (None, [1, 2, 2, 2])])
def test_compiled_training_recompiles_per_length(dynamic, compiles):
    """As test_recompiles_per_length says, on the GPU with inductor and the backward: dynamic=False
    compiles once per new length, the default once more for the second length and then never;
    every step matches eager."""
    model = dense_model(MHA_BWD, True, torch.float16)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    seen = []
    for S in (300, 1000, 2000, 300):
        x, dout = dense_batch(torch.float16, S)
        got, want = training_step(compiled, x, dout), training_step(model, x, dout)
        compare(got[:2], want[:2], 2e-2, ["out", "dx"])
        seen.append(counter.frame_count)
    assert seen == compiles


class VarlenModel(torch.nn.Module):
    """Two layers of QKV projection, ``attention_varlen`` over a packed batch, output projection
    and residual add, on ``x [total, heads * dim]`` (inference; training with the varlen
    backward script)."""

    def __init__(self, attention_varlen, heads, heads_kv, dim, causal):
        super().__init__()
        self.attention_varlen, self.causal = attention_varlen, causal
        self.shapes = [(heads, dim), (heads_kv, dim), (heads_kv, dim)]
        width, qkv = heads * dim, (heads + 2 * heads_kv) * dim
        linear = torch.nn.Linear
        self.qkv = torch.nn.ModuleList(linear(width, qkv, bias=False) for _ in range(2))
        self.proj = torch.nn.ModuleList(linear(width, width, bias=False) for _ in range(2))

    def forward(self, x, cu_seqlens, max_seqlen):
        for qkv, proj in zip(self.qkv, self.proj, strict=True):
            parts = qkv(x).split([h * d for h, d in self.shapes], dim=-1)
            q, k, v = (t.view(-1, h, d) for t, (h, d) in zip(parts, self.shapes, strict=True))
            out = self.attention_varlen(
                q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, self.causal
            )
            x = x + proj(out.reshape(x.shape))
        return x


def packed_batch(lengths, dtype, width):
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    return torch.randn(sum(lengths), width, device="cuda", dtype=dtype), cu, max(lengths)


def compiled_varlen_model(script, causal, dtype):
    """The varlen model around the script's ``attention_varlen`` (GQA: half as many kv heads) and
    two packed batches (sequences of length 1 beside the longest); with no graph break on the
    first, returns model, batches, the model compiled with fullgraph=True and dynamic=True, and
    its compile counter."""
    torch.manual_seed(0)
    heads_kv = 2 if "gqa" in script else 4
    model = VarlenModel(public(script), 4, heads_kv, 64, causal).to("cuda", dtype)
    batches = [packed_batch(lens, dtype, 256) for lens in ([1, 300, 17, 255], [7, 1000, 64, 1, 9])]
    explained = torch._dynamo.explain(model)(*batches[0])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    return model, batches, compiled, counter


VARLEN_CASES = [(s, c, d) for s in VARLEN for c, d in ((False, torch.bfloat16), (True, DTYPES[0]))]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script,causal,dtype", VARLEN_CASES, ids=[f"{s[16:-3]}-{c}-{d}" for s, c, d in VARLEN_CASES]
)
def test_compiled_varlen_inference_matches_eager(script, causal, dtype):
    """The varlen model compiled with fullgraph=True and dynamic=True against eager on two packed
    batches (sequences of length 1 beside the longest), within 1e-2: no graph break, one compile
    for both, cu_seqlens read inside the operator."""
    model, batches, compiled, counter = compiled_varlen_model(script, causal, dtype)
    for batch in batches:
        with torch.no_grad():
            got = compiled(*batch)
            assert batch[1]._host_values[1] == batch[1].tolist()  # read in the operator, kept
            compare([got], [model(*batch)], 1e-2, ["out"])  # fp16/bf16 forward
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    "causal,dtype",
    [(False, torch.bfloat16), (True, torch.float16)],
    ids=["False-torch.bfloat16", "True-torch.float16"],
)
def test_compiled_varlen_training_matches_eager(causal, dtype):
    """The varlen backward (example_gqa_bwd_tma_reduce_varlen.py) in the varlen model, compiled
    with fullgraph=True and dynamic=True, against eager on two packed batches (sequences of
    length 1 beside the longest): out within 1e-2, gradients (x and every weight) within 2e-2;
    no graph break, one compile for both, cu_seqlens read inside the forward operator."""
    model, batches, compiled, counter = compiled_varlen_model(VARLEN_BWD, causal, dtype)
    names = ["out", "dx"] + [f"d{name}" for name, _ in model.named_parameters()]
    for x, cu, max_seqlen in batches:
        x.requires_grad_()
        dout = torch.randn_like(x)
        steps = []
        for run in (compiled, model):
            out = run(x, cu, max_seqlen)
            steps.append((out, *torch.autograd.grad(out, [x, *model.parameters()], dout)))
        assert cu._host_values[1] == cu.tolist()  # read in the operator, kept
        compare(steps[0][:1], steps[1][:1], 1e-2, names[:1])  # fp16/bf16 forward
        compare(steps[0][1:], steps[1][1:], 2e-2, names[1:])  # fp16/bf16 gradients
    assert counter.frame_count == 1


class SinkModel(harness.TwoLayerModel):
    """harness.TwoLayerModel (BHSD, GQA) around an attention-sink script's ``attention``, with a
    sliding window and one sink logit per query head and layer (a parameter, kept in the
    model's dtype and cast to float32 for the call, as gpt-oss does), or no sinks."""

    def __init__(self, attention, heads, heads_kv, dim, window, causal, sinks):
        super().__init__(attention, heads, dim, causal, "bhsd", heads_kv=heads_kv)
        self.window = window
        self.sinks = torch.nn.Parameter(torch.randn(len(self.qkv), heads) * 2) if sinks else None

    def forward(self, x):
        B, S, width = x.shape
        for layer, (qkv, proj) in enumerate(zip(self.qkv, self.proj, strict=True)):
            parts = qkv(x).split([h * self.dim for h in self.heads], dim=-1)
            q, k, v = (
                t.view(B, S, h, self.dim).transpose(1, 2)
                for t, h in zip(parts, self.heads, strict=True)
            )
            sinks = None if self.sinks is None else self.sinks[layer].float()
            out = self.attention(q, k, v, sinks, self.window, self.causal)
            x = x + proj(out.transpose(1, 2).reshape(B, S, width))
        return x


# window, causal, sinks, dtype: a causal window, a two-sided one, full causal without sinks
SINK_TRAINING = [
    ((128, 0), True, True, torch.bfloat16),
    ((64, 64), False, True, torch.float16),
    ((-1, -1), True, False, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("script", SINK_SCRIPTS)
@pytest.mark.parametrize(
    "window,causal,sinks,dtype",
    SINK_TRAINING,
    ids=[f"{w[0]}_{w[1]}-{c}-{'sinks' if s else 'none'}-{d}" for w, c, s, d in SINK_TRAINING],
)
def test_compiled_sink_model_matches_eager(script, window, causal, sinks, dtype):
    """The sink model (4 query heads on 2 kv heads, D 64, S 300) compiled with fullgraph=True
    against eager: one graph, no break; out within 1e-2; with the backward script, gradients
    (x, every weight and the sinks) within 2e-2, and no dsinks without sinks."""
    torch.manual_seed(0)
    model = SinkModel(load_script(script).attention, 4, 2, 64, window, causal, sinks)
    model = model.to("cuda", dtype)
    x, dout = dense_batch(dtype, S=300)
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    op = SINK_SCHEMAS[script][0].split("(")[0].replace("::", ".")
    assert f"torch.ops.{op}.default" in explained.graphs[0].code
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    if script == SINK_FWD:  # forward only: inference
        with torch.no_grad():
            compare([compiled(x)], [model(x)], 1e-2, ["out"])  # fp16/bf16 forward
        return
    eager = training_step(model, x, dout)
    got = training_step(compiled, x, dout)
    names = ["dx"] + [f"d{name}" for name, _ in model.named_parameters()]
    assert ("dsinks" in names) == sinks
    compare(got[:1], eager[:1], 1e-2, ["out"])  # fp16/bf16 forward
    compare(got[1:], eager[1:], 2e-2, names)  # fp16/bf16 gradients


@pytest.mark.gpu
def test_sink_training_step_replays_under_cuda_graph_trees():
    """The sink model compiled with ``mode="reduce-overhead"`` (Inductor's CUDA graph trees,
    which the README recommends for compiled window-128 layers): no cudagraph skip is counted,
    and the third step (after warm-up and recording) on a new batch gives eager's output and
    gradients (x, every weight and the sinks)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = SinkModel(load_script(SINK_BWD).attention, 4, 2, 64, (128, 0), True, True)
    model = model.to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters["inductor"].clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        torch.compiler.cudagraph_mark_step_begin()
        x, dout = dense_batch(torch.bfloat16, S=300)
        got = [t.clone() for t in training_step(compiled, x, dout)]  # a replay reuses memory
    assert counters["inductor"]["cudagraph_skips"] == 0
    eager = training_step(model, x, dout)
    names = ["dx"] + [f"d{name}" for name, _ in model.named_parameters()]
    compare(got[:1], eager[:1], 1e-2, ["out"])  # bf16 forward
    compare(got[1:], eager[1:], 2e-2, names)  # bf16 gradients


EAGER_GPU = [s for s in BACKWARD if s not in NO_CONFIG] + [SINK_BWD]  # the Hopper ones


@pytest.mark.gpu
@pytest.mark.parametrize("script", EAGER_GPU, ids=[s[s.index("/") + 1 : -3] for s in EAGER_GPU])
def test_eager_call_runs_eager_attention(script):
    """An eager call on CUDA tensors goes through EagerAttention (docs/CONVENTIONS.md,
    "Eager calls"): its node is the output's grad_fn, and out and the gradients (sinks: and
    dsinks) agree with the forward operator's, called directly on the same inputs, within 1e-2
    / 2e-2 (the same kernels; atomic adds may sum in another order)."""
    mod = load_script(script)
    torch.manual_seed(0)
    if script == SINK_BWD:
        *qkv, sinks = sink_inputs()
        leaves = [torch.randn_like(t).requires_grad_() for t in (*qkv, sinks)]
        rest, op_rest = [], [*sink_settings((3, 2), False, 0.125, None, SINK_BWD)]
        call = lambda: mod.attention(*leaves, (3, 2), False, 0.125, **choice(script)[1])  # noqa: E731
        op_args = [*leaves, *op_rest]
    else:
        args = list(inputs(script))
        leaves = [torch.randn_like(t).requires_grad_() for t in args[:3]]
        rest = args[3:]  # varlen: cu_seqlens and lengths
        call = lambda: public(script)(*leaves, *rest, True, 0.125, **choice(script)[1])  # noqa: E731
        op_args = [*leaves, *rest, *settings(script, True, 0.125, None)]
    out = call()
    assert out.grad_fn.name() == "EagerAttentionBackward"
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    op_out, _ = mod.attention_forward_op(*op_args)
    assert op_out.grad_fn.name() != "EagerAttentionBackward"
    want = (op_out, *torch.autograd.grad(op_out, leaves, dout))
    compare(got[:1], want[:1], 1e-2, ["out"])  # fp16 forward
    compare(got[1:], want[1:], 2e-2, ["dq", "dk", "dv", "dsinks"][: len(leaves)])


FORWARD_ONLY = [s for s in SCRIPTS if s not in BACKWARD] + [
    SINK_FWD,
    "attention_sink/example_gqa_sink_fwd_varlen.py",
]


def forward_only_call(script, device, requires_grad=()):
    """The public function of a forward-only script on empty inputs, and its operator's tensor
    arguments; ``requires_grad``: the positions of the arguments that get it (3: sinks)."""
    sink = "attention_sink" in script
    if "varlen" in script:
        *qkv, cu_q, cu_k, Sq, Sk = inputs(script, device=device)
        lengths = [cu_q, cu_k, Sq, Sk]
    else:
        qkv, lengths = list(inputs(SINK_FWD if sink else script, device=device)), []
    tensors = [*qkv, torch.empty(qkv[0].shape[-2 if "varlen" in script else 1], device=device)]
    tensors = [t.requires_grad_(i in requires_grad) for i, t in enumerate(tensors)]
    sinks = tensors[3:] if sink else []
    window = [(128, 0)] if sink else []

    def call():
        return public(script)(*tensors[:3], *lengths, *sinks, *window, True, 0.125)

    return call, tensors[:3] + lengths + sinks


@pytest.mark.parametrize(
    "script", FORWARD_ONLY, ids=[s[s.index("/") + 1 : -3] for s in FORWARD_ONLY]
)
def test_forward_only_eager_call_skips_the_operator(script, monkeypatch):
    """docs/CONVENTIONS.md, "Eager calls": a forward-only script's eager call that autograd does
    not record runs the operator's body (``operator_forward``) with the operator's arguments;
    one that autograd records (an input that requires grad, grad mode on) takes the operator,
    whose backward is an error rather than a silent zero gradient."""
    mod = load_script(script)
    took = []

    def recorder(name):
        def record(*args):
            took.append((name, args))
            return torch.empty(0), torch.empty(0)

        return record

    monkeypatch.setattr(mod, "_check_inputs", lambda *a: None)  # CPU tensors, empty
    monkeypatch.setattr(mod, "operator_forward", recorder("body"))
    monkeypatch.setattr(mod, "attention_forward_op", recorder("operator"))
    sink = "attention_sink" in script
    cases = [((), True, "body"), ((0,), True, "operator"), ((2,), False, "body")]
    cases += [((3,), True, "operator")] if sink else []
    for requires_grad, grad_mode, expect in cases:
        call, tensors = forward_only_call(script, "cpu", requires_grad)
        with torch.set_grad_enabled(grad_mode):
            call()
        name, args = took.pop()
        assert name == expect, (requires_grad, grad_mode)
        assert all(a is t for a, t in zip(args, tensors, strict=False))
    assert not took


FORWARD_ONLY_GPU = [s for s in FORWARD_ONLY if "sm100" not in s]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script", FORWARD_ONLY_GPU, ids=[s[s.index("/") + 1 : -3] for s in FORWARD_ONLY_GPU]
)
def test_forward_only_eager_call_matches_the_operator(script):
    """The eager call without the operator's dispatch gives the operator's outputs bit for bit
    (the same kernel); with an input that requires grad the operator runs, and a backward
    through it raises."""
    mod = load_script(script)
    torch.manual_seed(0)
    call, tensors = forward_only_call(script, "cuda")
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.normal_()
    out = call()
    assert out.grad_fn is None
    window = (128, 0) if "attention_sink" in script else ()
    op_out, _ = mod.attention_forward_op(*tensors, *window, True, 0.125, None)
    assert torch.equal(out, op_out)
    tensors[0].requires_grad_()
    recorded = call()
    assert torch.equal(recorded, op_out)
    with pytest.raises(RuntimeError, match="autograd"):
        recorded.sum().backward()


# ----------------------------------------------------------------------------- CPU: varlen sinks
# example_gqa_sink_fwd_varlen.py: the varlen forward's arguments, then the sink forward's two.
SINK_VARLEN = "attention_sink/example_gqa_sink_fwd_varlen.py"
SINK_VARLEN_SCHEMA = (
    "tl_attn::gqa_sink_fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? sinks, "
    "SymInt window_size_left, SymInt window_size_right, bool causal, float softmax_scale, "
    "SymInt[]? config) -> (Tensor, Tensor)"
)


def sink_varlen_inputs(sinks=True, device="cuda", **sizes):
    """The varlen operator's arguments up to sinks: q, k, v, cu_seqlens, max lengths (``inputs``
    for the varlen GQA forward), sinks float32 [H] or None."""
    args = inputs("flash_attention/example_gqa_fwd_varlen.py", device=device, **sizes)
    return (*args, torch.empty(args[0].shape[1], device=device) if sinks else None)


def test_sink_varlen_operator_schema():
    mod = load_script(SINK_VARLEN)
    assert str(mod.attention_forward_op._opoverload._schema) == SINK_VARLEN_SCHEMA


@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no_sinks"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,causal", SINK_WINDOWS, ids=["full", "causal-128", "3-2"])
def test_sink_varlen_fake_outputs_are_shaped_like_the_real_ones(
    sinks, groups, dtype, window, causal, no_kernels
):
    """Under FakeTensorMode: out like q, lse float32 [H, total_q] and contiguous; the public
    function likewise."""
    mod = no_kernels(SINK_VARLEN)
    with FakeTensorMode():
        args = sink_varlen_inputs(sinks, H=8, Hkv=8 // groups, dtype=dtype)
        q = args[0]
        out, lse = mod.attention_forward_op(*args, *window, causal, 0.125, None)
        assert (out.shape, out.stride(), out.dtype) == (q.shape, q.stride(), q.dtype)
        assert (lse.shape, lse.dtype, lse.is_contiguous()) == (
            (q.shape[1], q.shape[0]), torch.float32, True,
        )  # fmt: skip
        out, lse = mod.attention_varlen(*args, window, causal, return_lse=True)
        assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])


@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no_sinks"])
def test_sink_varlen_opcheck_on_meta_tensors(sinks, no_kernels):
    """torch.library.opcheck, every test it has, on meta tensors (the fake implementation)."""
    mod = no_kernels(SINK_VARLEN)
    args = sink_varlen_inputs(sinks, device="meta")
    tiles = list(mod.default_config(64).values())
    torch.library.opcheck(
        mod.attention_forward_op, (*args, 128, 0, True, 0.125, tiles), test_utils=OPCHECK_TESTS
    )


# ----------------------------------------------------------------------------- CPU: eager calls
EAGER_CASES = [*((s, False) for s in BACKWARD), (SINK_BWD, True), (SINK_BWD, False)]


def operator_arguments(script, sinks=True):
    """A differentiable script's forward operator arguments on CPU tensors that require grad:
    the tensors (varlen: and lengths; sinks: and sinks), then the settings with its first tune
    config's values (its first choice; sinks: the window (128, 0))."""
    if script == SINK_BWD:
        *qkv, s = sink_inputs(sinks, device="cpu")
        tiles = list(load_script(script).default_config(64).values())
        tensors = [*qkv, s.requires_grad_() if sinks else None]
        return tensors, list(sink_settings((128, 0), True, 0.25, tiles, SINK_BWD))
    args = list(inputs(script, device="cpu"))
    tiles = [tune_space(script)[0][key] for key in config_keys(script)]
    return args, list(settings(script, True, 0.25, tiles))


@pytest.mark.parametrize(
    "script,sinks",
    EAGER_CASES,
    ids=[s[s.index("/") + 1 : -3] + "-sinks" * k for s, k in EAGER_CASES],
)
def test_eager_function_calls_what_the_operators_call(script, sinks, monkeypatch):
    """EagerAttention, an eager call's path (docs/CONVENTIONS.md, "Eager calls"), hands
    attention_forward and attention_backward (varlen: and _check_values) the very arguments the
    operators' real implementations hand them, and returns attention_backward's results as the
    gradients of q, k, v (sinks: and sinks); the plain functions replaced by recorders."""
    mod = load_script(script)
    calls = []

    def record(name, outputs):
        def plain_function(*args):
            calls.append((name, args))
            return outputs(*args)

        monkeypatch.setattr(mod, name, plain_function, raising=name != "_check_values")

    def forward_outputs(q, k, v, *rest):
        out = q.new_full((*q.shape[:-1], v.shape[-1]), 2.0)
        return out, torch.zeros(lse_shape(script, (q,)))

    def backward_outputs(dout, q, k, v, out, lse, *rest):
        grads = tuple(torch.full_like(t, i + 1.0) for i, t in enumerate((q, k, v)))
        if script == SINK_BWD:
            s = rest[0]
            return (*grads, None if s is None else torch.full_like(s, 4.0))
        return grads

    record("attention_forward", forward_outputs)
    record("attention_backward", backward_outputs)
    record("_check_values", lambda *a: None)
    tensors, op_settings = operator_arguments(script, sinks)
    for t in tensors[:3]:
        t.requires_grad_()

    # The operators' real implementations, called directly on CPU tensors.
    out, lse = mod.attention_forward_op(*tensors, *op_settings)
    saved = [t for t in tensors if isinstance(t, torch.Tensor) and t.dtype == torch.int32]
    lengths = [t for t in tensors[3:] if isinstance(t, int)]
    sink = tensors[3:4] if script == SINK_BWD else []
    dout = torch.ones_like(out)
    mod.attention_backward_op(dout, *tensors[:3], out, lse, *sink, *saved, *lengths, *op_settings)
    through_operators = calls[:]
    calls.clear()

    out, lse = mod.EagerAttention.apply(*tensors, *op_settings)
    assert out.requires_grad and not lse.requires_grad
    leaves = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, dout)
    assert [g.unique().tolist() for g in grads] == [[1.0], [2.0], [3.0], [4.0]][: len(leaves)]

    def comparable(args):
        return [a.shape if isinstance(a, torch.Tensor) else a for a in args]

    assert [(n, comparable(a)) for n, a in calls] == [
        (n, comparable(a)) for n, a in through_operators
    ]
    assert "attention_backward" in [n for n, _ in calls]

    # A second derivative (dout part of a graph, as in a gradient penalty) is an error, never a
    # silent zero.
    out, _ = mod.EagerAttention.apply(*tensors, *op_settings)
    first = torch.autograd.grad(out, leaves, dout.clone().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        first[0].sum().backward()
