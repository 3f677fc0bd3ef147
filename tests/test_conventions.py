"""The repository's own conventions (docs/CONVENTIONS.md), checked on the source: the document
exists and is linked, every section the code cites exists, kernels are named for their role,
and every attention script offers the functions users call. CPU only, no kernel is built."""

import ast
import inspect
import os
import re

import pytest
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
    "flash_bwd_varlen",
    "flash_bwd_post",
    "flash_bwd_post_kv",
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


@pytest.mark.parametrize("script", KERNEL_SCRIPTS)
def test_kernels_are_named_for_their_role(script):
    funcs = prim_funcs(ast.parse((EXAMPLES / script).read_text()))
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
