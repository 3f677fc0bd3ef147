"""Loading the example scripts by path (their names repeat across folders), and checks of their
generated code that several test files share."""

import contextlib
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # harness.py, as the scripts' main() does

from harness import rel_error as rel_err  # noqa: E402, F401  (the scripts' error metric)

_loaded = {}


def load_script(relpath: str):
    """Import ``examples/<relpath>`` as a module, once. It is also the module a sibling script
    gets by importing it by its plain name (example_mha_bwd_wgmma_pipelined.py imports
    example_mha_fwd_bshd), and the other way round: one module per file, so each custom operator
    a script registers (``tl_attn::...``) runs that one module's code in the test process."""
    if relpath not in _loaded:
        path = EXAMPLES / relpath
        module = sys.modules.get(path.stem)
        if getattr(module, "__file__", None) != str(path):
            name = "ex_" + relpath.replace("/", "_").removesuffix(".py")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            sys.modules.setdefault(path.stem, module)
            spec.loader.exec_module(module)
        _loaded[relpath] = module
    return _loaded[relpath]


def assert_one_producer_warp(src: str, consumers: int, fulls=("k_full", "v_full")):
    """The hand-scheduled forwards' producer: of the warpgroup after the ``consumers`` threads,
    one warp runs the load loop, and the "full" mbarriers count its 32 threads."""
    assert f"if (((int)threadIdx.x) < {consumers + 32})" in src, "one producer warp loads"
    for full in fulls:
        assert f"{full}[0].init(32);" in src, full


def record_launches(monkeypatch, *factories):
    """Kernel factories (``(module, name)`` pairs) replaced by stand-ins that record each build
    ``(name, args, kwargs)`` and each launch ``(name, tensors)``, each module's ``entry`` by the
    identity (a stand-in is its own entry point), and the device by an H100's (sm_90, 132 SMs),
    so a forward's host plan runs on CPU tensors. Returns the two lists."""
    import types

    import torch

    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    builds, launches = [], []

    def stand_in(name):
        def build(*args, **kwargs):
            builds.append((name, args, kwargs))
            return lambda *tensors: launches.append((name, tensors))

        return build

    for module, name in factories:
        monkeypatch.setattr(module, name, stand_in(name))
        if hasattr(module, "entry"):
            monkeypatch.setattr(module, "entry", lambda kernel: kernel)
    return builds, launches


@contextlib.contextmanager
def fresh_plans(*plans):
    """The scripts' ``functools.lru_cache`` plans emptied before the block and after it: a plan
    built from a test's stand-ins, or under its patched constants, must not outlive the test."""
    for plan in plans:
        plan.cache_clear()
    try:
        yield
    finally:
        for plan in plans:
            plan.cache_clear()
