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
