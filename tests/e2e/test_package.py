"""The Python package's shape (no daemon needed): its modules form layers,
each importing only modules of lower layers (so the import graph is a
DAG: no module imports one that imports it back, at the top or inside a
function); every module imports on its own, without the package's
__init__ having loaded the others first; the names tests, examples and
docs import from amaxd, amaxd.client and amaxd.packed are still there; the
installed package is typed (py.typed, the protobuf module's .pyi)."""
import ast
import importlib.util
import os
import subprocess
import sys

import pytest

import amaxd

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "client", "python", "amaxd")
INSTALLED = os.path.dirname(amaxd.__file__)

# Bottom to top. A module may import modules of lower layers only.
LAYERS = [
    {"_gen", "errors", "placement"},
    {"types", "tiles"},  # tiles: placement geometry of flat-sharded weights (numpy only)
    {"wire", "transport", "export", "calib",  # calib: a rank's statistics (numpy, torch)
     "device"},  # device: GPU-direct buffers over CUDA IPC (torch, CuPy or cuda-bindings)
    {"packed"},
    {"client"},
    {"__init__"},
    {"modelopt", "demo", "te"},  # te: a framework adapter, as modelopt
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _modules():
    return sorted(f[:-3] for f in os.listdir(SRC) if f.endswith(".py"))


def _imports(mod):
    """The package's modules that `mod` imports anywhere in its file
    (top level, functions, TYPE_CHECKING blocks), as {module: line}."""
    tree = ast.parse(open(os.path.join(SRC, mod + ".py")).read())
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 1:
            if n.module:  # from .x import y
                out.setdefault(n.module.split(".")[0], n.lineno)
            else:  # from . import x, y: modules, or names of __init__
                for a in n.names:
                    name = a.name if a.name in LAYER else "__init__"
                    out.setdefault(name, n.lineno)
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module \
                and n.module.split(".")[0] == "amaxd":
            parts = n.module.split(".")
            out.setdefault(parts[1] if len(parts) > 1 else "__init__", n.lineno)
        elif isinstance(n, ast.Import):
            for a in n.names:
                parts = a.name.split(".")
                if parts[0] == "amaxd":
                    out.setdefault(parts[1] if len(parts) > 1 else "__init__", n.lineno)
        elif isinstance(n, ast.ImportFrom) and n.level > 1:
            raise AssertionError(f"{mod}.py:{n.lineno}: import from above the package")
    out.pop(mod, None)
    return out


def graph():
    return {m: _imports(m) for m in _modules()}


def test_every_module_has_a_layer():
    assert set(_modules()) | {"_gen"} == set(LAYER), \
        "add the new module to LAYERS in tests/e2e/test_package.py (and say why it sits there)"


def test_imports_go_down_the_layers():
    bad = []
    for mod, deps in graph().items():
        for dep, line in deps.items():
            if LAYER[dep] >= LAYER[mod]:
                bad.append(f"{mod}.py:{line} imports {dep} (layer {LAYER[mod]} -> {LAYER[dep]})")
    assert not bad, "\n".join(bad)


def test_import_graph_is_a_dag():
    g = {m: set(d) for m, d in graph().items()}
    state = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(g.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in g:
        visit(m, [])


@pytest.mark.parametrize("mod", [m for m in _modules() if m != "__init__"])
def test_module_imports_alone(mod):
    """Imports amaxd.<mod> in a fresh interpreter with an empty package
    object in place of amaxd/__init__.py: what the module needs, it
    imports itself."""
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('amaxd'); pkg.__path__ = [{INSTALLED!r}]\n"
        "sys.modules['amaxd'] = pkg\n"
        f"importlib.import_module('amaxd.{mod}')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('amaxd.'))\n"
        "print(' '.join(loaded))\n")
    if mod == "demo":  # `from . import Client`: the package itself, by design
        code = code.replace("sys.modules['amaxd'] = pkg\n", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_public_names_are_where_they_were():
    """Names importable before client.py was split (issue 20), that tests,
    bench, examples and docs use."""
    import amaxd.client
    import amaxd.packed
    for name in ("Client", "Quantizer", "Recipe", "Result", "Masked", "Layout", "PackedResult",
                 "Placement", "AmaxdError", "errors", "placement", "pb", "FP8_E4M3", "FP8_E5M2",
                 "NVFP4", "MXFP8", "RUNNING_MAX", "PER_EPOCH"):
        assert hasattr(amaxd, name), name
    for name in amaxd.client.__all__ + ["DEFAULT_SOCKET", "_spec_bytes", "_pread_all"]:
        assert hasattr(amaxd.client, name), name
    for name in amaxd.packed.__all__:
        assert hasattr(amaxd.packed, name), name
    assert amaxd.Client is amaxd.client.Client
    assert amaxd.Recipe is amaxd.client.Recipe is amaxd.types.Recipe


def test_installed_package_is_typed():
    assert os.path.isfile(os.path.join(INSTALLED, "py.typed"))
    assert importlib.util.find_spec("amaxd._gen.amaxd_pb2") is not None
    assert os.path.isfile(os.path.join(INSTALLED, "_gen", "amaxd_pb2.pyi"))


def test_public_functions_are_annotated():
    """Every public function and method (and __init__) of the package
    annotates its parameters and its return."""
    missing = []
    for mod in _modules():
        tree = ast.parse(open(os.path.join(SRC, mod + ".py")).read())

        def visit(node, cls=None):
            for n in ast.iter_child_nodes(node):
                if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                    visit(n, n.name)
                elif isinstance(n, ast.FunctionDef) and (not n.name.startswith("_")
                                                         or n.name == "__init__"):
                    args = n.args.posonlyargs + n.args.args + n.args.kwonlyargs
                    static = any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                 for d in n.decorator_list)
                    if cls and not static and args:
                        args = args[1:]  # self / cls
                    args += [a for a in (n.args.vararg, n.args.kwarg) if a is not None]
                    names = [a.arg for a in args if a.annotation is None]
                    if n.returns is None:
                        names.append("return")
                    if names:
                        where = f"{cls}.{n.name}" if cls else n.name
                        missing.append(f"{mod}.py:{n.lineno} {where}: {', '.join(names)}")

        visit(tree)
    assert not missing, "\n".join(missing)
