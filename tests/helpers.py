"""Loading the example scripts by path (their names repeat across folders)."""

import importlib.util
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # harness.py, as the scripts' main() does

_loaded = {}


def load_script(relpath: str):
    """Import ``examples/<relpath>`` as a module, once."""
    if relpath not in _loaded:
        path = EXAMPLES / relpath
        name = "ex_" + relpath.replace("/", "_").removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _loaded[relpath] = module
    return _loaded[relpath]


def rel_err(out, ref):
    """‖out−ref‖/‖ref‖ over finite reference entries; inf unless out's non-finite entries are
    exactly the reference's (same places, same infinities, never NaN)."""
    out, ref = out.float(), ref.float()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(out[~finite], ref[~finite]):
        return math.inf
    diff = (out[finite] - ref[finite]).double()
    return (diff.norm() / ref[finite].double().norm().clamp_min(1e-30)).item()
