"""Loading the example scripts by path (their names repeat across folders)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # harness.py, as the scripts' main() does

from harness import rel_error as rel_err  # noqa: E402, F401  (the scripts' error metric)

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
