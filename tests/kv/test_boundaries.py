import ast
from pathlib import Path

KV = Path(__file__).parents[2] / "hybridkv" / "kv"


def test_kv_core_imports_nothing_above_it():
    for path in KV.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("hybridkv"):
                    assert name.startswith(("hybridkv.kv", "hybridkv.units")), f"{path.name} imports {name}"


HYBRIDKV = KV.parent
# Each package of hybridkv, lowest first: a module may import its own package or one listed before it.
LAYERS = [
    "version",
    "units",
    "json_config",  # the JSON options (vLLM's --*-config flags): parsing and key checks
    "launch",  # starts `hybridkv` processes (the sweep, tests); imports nothing of ours
    "tiny_models",  # random tiny checkpoints; imports nothing of ours
    "ownership",  # who may write a folder or file (the kernel cache, the disk tier); imports nothing of ours
    "native_build",  # compiles the kernels (setup.py and native); imports nothing of ours
    "native",
    "kv",
    "structured",  # structured output: specs and llguidance grammar matchers (imports nothing of ours)
    "request",
    "models",
    "runner",
    "connectors",
    "events",  # KV events: the wire format and its publisher thread (imports kv)
    "engine",
    "tasks",
    "serve",
    "evals",  # lm-eval against a server; renders chats as the server does
    "pd_accuracy",  # the PD sweep: processes, lm-eval, tables
    "cli",
]


def _package(path: Path, root: Path) -> str:
    """`kv` for hybridkv/kv/spec.py, `units` for hybridkv/units.py; "" for hybridkv/__init__.py."""
    rel = path.relative_to(root)
    return rel.parts[0].removesuffix(".py") if rel.parts != ("__init__.py",) else ""


def _imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file; relative imports resolved against its package,
    and `from hybridkv import x` read as module hybridkv.x."""
    here = ["hybridkv", *path.relative_to(root).with_suffix("").parts][:-1]  # the package "." names
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module == "hybridkv":
                found += [(node.lineno, f"hybridkv.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return found


def layer_violations(root: Path = HYBRIDKV) -> list[str]:
    """One line per import of a module under `root` (the hybridkv package) against LAYERS."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        own = _package(path, root)
        if not own:
            continue  # hybridkv/__init__.py gathers the public API from every layer
        if own not in LAYERS:
            problems.append(f"{path.relative_to(root.parent)}: package {own!r} is not in LAYERS")
            continue
        for line, module in _imported_modules(path, root):
            parts = module.split(".")
            if parts[0] != "hybridkv":
                continue
            target = parts[1] if len(parts) > 1 else ""
            if target == own or (target in LAYERS and LAYERS.index(target) < LAYERS.index(own)):
                continue
            where = f"{path.relative_to(root.parent)}:{line}"
            if not target:
                problems.append(f"{where} imports the top package hybridkv, whose names come from every layer")
            elif target in LAYERS:
                problems.append(f"{where} imports {module}: layer {own!r} may not import {target!r} (above it)")
            else:
                problems.append(f"{where} imports {module}: {target!r} is not a layer of LAYERS")
    return problems


def test_every_package_imports_only_layers_below_it():
    """Packages in LAYERS that do not exist yet are simply not checked."""
    problems = layer_violations()
    assert not problems, "imports against the layer order " + " > ".join(reversed(LAYERS)) + ":\n" + "\n".join(problems)


def test_the_layer_check_names_each_import_against_the_order(tmp_path):
    root = tmp_path / "hybridkv"
    files = {
        "__init__.py": "from hybridkv.cli import app\n",  # the top package may import anything
        "units.py": "",
        "kv/__init__.py": "",
        "kv/spec.py": "from hybridkv.units import x\nfrom . import block_pool\nfrom .block_pool import y\n",
        "kv/bad.py": "import os\n\ndef f():\n    from ..engine.scheduler import Scheduler\n",
        "engine/scheduler.py": "import hybridkv.kv.spec\nfrom hybridkv import kv, serve\nimport hybridkv\n",
        "assets/tool.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert layer_violations(root) == [
        "hybridkv/assets/tool.py: package 'assets' is not in LAYERS",
        "hybridkv/engine/scheduler.py:2 imports hybridkv.serve: layer 'engine' may not import 'serve' (above it)",
        "hybridkv/engine/scheduler.py:3 imports the top package hybridkv, whose names come from every layer",
        "hybridkv/kv/bad.py:4 imports hybridkv.engine.scheduler: layer 'kv' may not import 'engine' (above it)",
    ]  # and no package `request` exists here: missing layers are fine
