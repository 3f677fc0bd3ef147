"""The repository's own conventions (docs/CONVENTIONS.md), checked on the source: the document
exists and is linked, every section the code cites exists, kernels are named for their role,
and every attention script offers the functions users call. CPU only, no kernel is built."""

import ast
import inspect
import os
import re

import pytest
import torch
from helpers import EXAMPLES, ROOT, load_script

CONVENTIONS = ROOT / "docs" / "CONVENTIONS.md"
# The team's working notes live outside the repository and are never cited from it. The name is
# written as a character class so that this file does not match its own search.
PRIVATE_NOTES = re.compile("G[U]IDE|[Gg]uide §")
SKIPPED_DIRS = {"__pycache__"}  # plus every hidden directory but .ci (.git, caches, bundles)

ATTENTION_DIRS = ("flash_attention", "flash_attention_sm100")
ATTENTION_SCRIPTS = sorted(
    str(p.relative_to(EXAMPLES)) for d in ATTENTION_DIRS for p in (EXAMPLES / d).glob("*.py")
)
GEMM_SCRIPTS = sorted(str(p.relative_to(EXAMPLES)) for p in (EXAMPLES / "gemm_sm100").glob("*.py"))
KERNEL_SCRIPTS = ATTENTION_SCRIPTS + GEMM_SCRIPTS
# What an inner @T.prim_func may be called: one name per role, the same in every script
# (TileLang names the CUDA kernel "<name>_kernel").
KERNEL_ROLES = {
    "flash_fwd",
    "flash_fwd_wasp",
    "flash_fwd_varlen",
    "flash_bwd_prep",
    "flash_bwd",
    "flash_bwd_dq",
    "flash_bwd_varlen",
    "flash_bwd_post",
    "flash_bwd_post_kv",
    "flash_bwd_post_tail",
    "flash_fwd_combine",
    "flash_bwd_sinks",
    "gemm",
}
VARLEN_ARGS = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]


def repository_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [
            d for d in dirnames if d not in SKIPPED_DIRS and (not d.startswith(".") or d == ".ci")
        ]
        for name in filenames:
            yield os.path.join(dirpath, name)


def test_repository_never_cites_the_private_notes():
    files = list(repository_files())
    assert any(f.endswith("README.md") for f in files) and len(files) > 30
    hits = []
    for path in files:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="ignore")
        hits += [
            f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            for m in PRIVATE_NOTES.finditer(text)
        ]
    assert not hits, f"cite docs/CONVENTIONS.md or state the fact instead: {hits}"


def test_readme_links_the_conventions():
    assert CONVENTIONS.is_file()
    assert "](docs/CONVENTIONS.md)" in (ROOT / "README.md").read_text()


def test_every_cited_section_exists():
    """Code cites a section by its heading in double quotes right after the path, with or
    without a comma or an opening parenthesis between them."""
    headings = set(re.findall(r"^#+ (.+)$", CONVENTIONS.read_text(), flags=re.M))
    cited = {}
    for path in repository_files():
        if path.endswith((".py", ".md")):
            with open(path, encoding="utf-8") as f:
                for section in re.findall(r'docs/CONVENTIONS\.md,?\s+\(?"([^"]+)"', f.read()):
                    cited.setdefault(section, os.path.relpath(path, ROOT))
    assert {"Correctness", "Benchmarks", "Command line"} <= set(cited)
    missing = {s: where for s, where in cited.items() if s not in headings}
    assert not missing, f"sections cited but not in docs/CONVENTIONS.md: {missing}"


def prim_funcs(tree):
    """Every function decorated with ``T.prim_func``, at any depth."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d) == "T.prim_func" for d in node.decorator_list)
    ]


# Scripts whose kernels all come from siblings (imported, not copied): their own lesson is the
# wiring (here: the varlen forward and the fast backward's packed mode, as one training step).
KERNELS_FROM_SIBLINGS = {"flash_attention/example_gqa_bwd_tma_reduce_varlen.py"}


@pytest.mark.parametrize("script", KERNEL_SCRIPTS)
def test_kernels_are_named_for_their_role(script):
    funcs = prim_funcs(ast.parse((EXAMPLES / script).read_text()))
    if script in KERNELS_FROM_SIBLINGS:
        assert not funcs, "a script listed as taking its kernels from siblings defines one"
        return
    assert funcs, "no @T.prim_func found"
    names = [f.name for f in funcs]
    assert "main" not in names, "an inner prim_func is named main: name it for its role"
    assert set(names) <= KERNEL_ROLES, f"{sorted(set(names) - KERNEL_ROLES)} not in {KERNEL_ROLES}"


def test_prim_func_finder_sees_main():
    """The check above would catch a kernel named main."""
    src = "def f():\n    @T.prim_func\n    def main(A):\n        pass\n    return main\n"
    assert [f.name for f in prim_funcs(ast.parse(src))] == ["main"]


def entry_point(script):
    return "attention_varlen" if "varlen" in script else "attention"


@pytest.mark.parametrize("script", ATTENTION_SCRIPTS)
def test_script_offers_the_user_api(script):
    mod = load_script(script)
    api = getattr(mod, entry_point(script))
    params = inspect.signature(api).parameters
    leading = VARLEN_ARGS if "varlen" in script else ["q", "k", "v"]
    assert list(params)[: len(leading)] == leading
    assert params["causal"].default is False and params["softmax_scale"].default is None
    ref = inspect.signature(mod.ref_program).parameters
    assert list(ref)[: len(leading) + 2] == [*leading, "causal", "softmax_scale"]
    assert list(inspect.signature(mod.main).parameters) == ["argv"]
    assert 'if __name__ == "__main__":\n    main()' in (EXAMPLES / script).read_text()


@pytest.mark.parametrize("script", GEMM_SCRIPTS)
def test_gemm_script_offers_the_user_api(script):
    mod = load_script(script)
    assert list(inspect.signature(mod.matmul).parameters)[:2] == ["a", "b"]
    assert list(inspect.signature(mod.ref_program).parameters) == ["a", "b"]
    assert list(inspect.signature(mod.main).parameters) == ["argv"]


# ----------------------------------------------------------------------------- one name per thing
# docs/CONVENTIONS.md, "Names": the same thing carries the same name in every script.
BACKWARD_SCRIPTS = [s for s in ATTENTION_SCRIPTS if "bwd" in s]
DENSE_LEADING = {
    "attention_forward": ["q", "k", "v", "causal", "softmax_scale"],
    "attention_backward": ["dout", "q", "k", "v", "out", "lse", "causal", "softmax_scale"],
}
VARLEN_LEADING = {
    "attention_forward": [*VARLEN_ARGS[:6], "causal", "softmax_scale"],
    "attention_backward": ["dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"],
}
# Grid axes: the name each T.Kernel dimension is bound to, by what it counts (anything else: bx,
# the block; heads_kv * head_splits: the kv heads, each in parts).
GRID_NAMES = {
    "heads": "by",
    "heads_kv": "by",
    "heads_kv * head_splits": "by",
    "batch": "bz",
    # the hand-scheduled backward's interleaved grid: a row of a set of rows (heads), the set
    "interleave": "by",
    "n_rows // interleave": "bz",
}
RETIRED_NAMES = {"loop_st", "loop_ed", "q_first", "_dtype_name", "_forward", "_backward"}


def autograd_functions(mod):
    """The names of the torch.autograd.Function classes a script defines."""
    return [
        name
        for name, value in vars(mod).items()
        if isinstance(value, type) and issubclass(value, torch.autograd.Function)
    ]


@pytest.mark.parametrize("script", BACKWARD_SCRIPTS)
def test_autograd_class_and_helpers_have_one_name(script):
    """One autograd formula: the one registered on the script's custom operator
    (docs/CONVENTIONS.md, "torch.compile"), and beside it one torch.autograd.Function,
    EagerAttention, for eager calls ("Eager calls"), in the style whose forward takes ctx (it
    calls that formula's setup_context; one that defines setup_context costs an
    inspect.signature on every call)."""
    mod = load_script(script)
    assert autograd_functions(mod) == ["EagerAttention"] and script in CUSTOM_OP_SCRIPTS
    assert "setup_context" not in vars(mod.EagerAttention)
    assert list(inspect.signature(mod.EagerAttention.forward).parameters)[:2] == ["ctx", "inputs"]
    leading = VARLEN_LEADING if "varlen" in script else DENSE_LEADING
    for helper, names in leading.items():
        params = list(inspect.signature(getattr(mod, helper)).parameters)
        assert params[: len(names)] == names, f"{helper}{params}"
        if "config" in params:  # right after the shared arguments; extras (strategy) after it
            assert params.index("config") == params.index("softmax_scale") + 1


# Every attention script has custom operators: the dense ones, Hopper and Blackwell, and the
# attention-sink ones (whose arguments differ, so they are not ATTENTION_SCRIPTS, held to the
# dense API above).
OPERATOR_DIRS = (*ATTENTION_DIRS, "attention_sink")
OPERATOR_SCRIPTS = sorted(
    str(p.relative_to(EXAMPLES)) for d in OPERATOR_DIRS for p in (EXAMPLES / d).glob("*.py")
)
CUSTOM_OP_SCRIPTS = [
    s for s in OPERATOR_SCRIPTS if "torch.library.custom_op" in (EXAMPLES / s).read_text()
]


def test_every_attention_script_has_custom_operators():
    assert CUSTOM_OP_SCRIPTS == OPERATOR_SCRIPTS
    assert {s.split("/")[0] for s in OPERATOR_SCRIPTS} == set(OPERATOR_DIRS)


@pytest.mark.parametrize("script", CUSTOM_OP_SCRIPTS)
def test_custom_operators_are_named_for_their_script(script):
    """docs/CONVENTIONS.md, "torch.compile": attention_forward_op is tl_attn::<script name
    without example_> (an SM100 script's with sm100_ in front), suffixed _forward in a
    differentiable script, whose attention_backward_op is ..._backward; no other operator, and
    no torch.autograd.Function but a differentiable script's EagerAttention."""
    mod = load_script(script)
    assert autograd_functions(mod) == (["EagerAttention"] if "bwd" in script else [])
    name = os.path.basename(script).removesuffix(".py").removeprefix("example_")
    name = "tl_attn::" + ("sm100_" if script.startswith("flash_attention_sm100/") else "") + name
    ops = {
        value._opoverload._schema.name: attr
        for attr, value in vars(mod).items()
        if isinstance(value, torch._library.custom_ops.CustomOpDef)
    }
    if "bwd" in script:
        expected = {
            name + "_forward": "attention_forward_op",
            name + "_backward": "attention_backward_op",
        }
    else:
        expected = {name: "attention_forward_op"}
    assert ops == expected


@pytest.mark.parametrize("script", ATTENTION_SCRIPTS)
def test_retired_names_are_gone(script):
    tree = ast.parse((EXAMPLES / script).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not names & RETIRED_NAMES
    # q_start is the first query block a key block sees; in varlen kernels a sequence's first
    # packed row is q_offset.
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and "q_start" in map(ast.unparse, node.targets):
            assert "cu_seqlens" not in ast.unparse(node.value), ast.unparse(node)


def kernel_grids(tree):
    """(grid extents, bound names) of every ``with T.Kernel(...) as (...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call, bound = item.context_expr, item.optional_vars
                if (
                    isinstance(call, ast.Call)
                    and ast.unparse(call.func) == "T.Kernel"
                    and isinstance(bound, ast.Tuple)
                ):
                    yield [ast.unparse(a) for a in call.args], [ast.unparse(n) for n in bound.elts]


@pytest.mark.parametrize("script", ATTENTION_SCRIPTS)
def test_grid_axes_have_one_meaning(script):
    """bx: the block of the sequence a kernel tiles (keys in a backward kernel, queries
    elsewhere), by: the head, bz: the batch (varlen: the sequence), whatever the launch order."""
    for extents, names in kernel_grids(ast.parse((EXAMPLES / script).read_text())):
        expected = [GRID_NAMES.get(extent, "bx") for extent in extents]
        assert names == expected, f"T.Kernel({', '.join(extents)}) as ({', '.join(names)})"


def test_grid_check_sees_a_swapped_binding():
    """The check above would catch a head bound as bx."""
    src = "with T.Kernel(heads, T.ceildiv(seq_kv, block_M), batch) as (bx, by, bz):\n    pass\n"
    ((extents, names),) = kernel_grids(ast.parse(src))
    assert names != [GRID_NAMES.get(extent, "bx") for extent in extents]


@pytest.mark.parametrize("script", ATTENTION_SCRIPTS)
def test_tune_flag_means_one_thing(script):
    """--tune: every tune_configs entry side by side in one report, then the fastest is checked;
    a script without tune_configs has no --tune."""
    mod = load_script(script)
    tune = mod.build_parser()._option_string_actions.get("--tune")
    if hasattr(mod, "tune_configs"):
        assert tune is not None and tune.help == mod._harness().TUNE_HELP
    else:
        assert tune is None
    assert mod._harness().TUNE_HELP == (
        "benchmark every entry of the script's tune_configs side by side in one run (one "
        "report), then check the fastest"
    )


TUNE_MAINS = {  # backward scripts, main's benchmark and check at module level: argv, tune space
    "flash_attention/example_mha_bwd_bshd.py": ([], ()),
    "flash_attention/example_mha_bwd_bhsd.py": ([], ()),
    "flash_attention/example_mha_bwd_wgmma_pipelined.py": (["--dim", "64"], (64,)),
    "flash_attention/example_gqa_bwd.py": (
        ["--strategy", "split", "--dim", "192", "--dim_v", "128"],
        (192, 128),
    ),
    "flash_attention/example_gqa_bwd_tma_reduce.py": ([], (128, 128)),
    "flash_attention/example_gqa_bwd_tma_reduce_varlen.py": ([], (128,)),
}


@pytest.mark.parametrize("script", sorted(TUNE_MAINS))
def test_tune_benchmarks_the_space_once_and_checks_the_fastest(script, monkeypatch, capsys):
    """main --tune with the GPU parts replaced: one benchmark holding exactly ``tune_configs``,
    then the check runs on the config fastest at the backward alone (not at forward+backward),
    and no second benchmark follows."""
    mod = load_script(script)
    monkeypatch.setattr(mod._harness(), "require_gpu", lambda *a, **kw: None)
    if "varlen" in script:  # CUDA tensors otherwise; main only prints the masks' lengths
        mask = torch.ones(2, 3, dtype=torch.bool)
        monkeypatch.setattr(mod, "padded_batch", lambda *a, **kw: ([None] * 4, mask, mask))
    benchmarked, checked = [], []

    def benchmark(*args):
        configs = args[-1]
        benchmarked.append(configs)
        names = list(configs)
        bwd_ms = {name: 1.0 for name in names} | {names[len(names) // 2]: 0.5}
        fwd_bwd_ms = {name: 1.0 for name in names} | {names[0]: 0.1}

        def rows(ms):
            return [{"impl": n, "ms": t, "ours": True} for n, t in ms.items()] + [
                {"impl": "peer", "ms": 0.01, "ours": False}
            ]

        return {"fwd+bwd": rows(fwd_bwd_ms), "bwd": rows(bwd_ms)}

    monkeypatch.setattr(mod, "benchmark", benchmark)
    monkeypatch.setattr(mod, "check", lambda *args: checked.append(args[-1]))
    argv, space = TUNE_MAINS[script]
    mod.main(["--tune", *argv])
    assert len(benchmarked) == 1, "one report, no second benchmark"
    tried = [c[1] if isinstance(c, tuple) else c for c in benchmarked[0].values()]  # (strategy, c)
    assert tried == mod.tune_configs(*space)
    assert checked == [tried[len(tried) // 2]]
    assert f"tuned: {tried[len(tried) // 2]}" in capsys.readouterr().out
