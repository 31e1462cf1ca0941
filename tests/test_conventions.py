"""Conventions a reader (or a tool that follows imports) relies on across the package: a module that
uses the kernels imports them at its top."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nested_kernel_imports(path: Path) -> list[int]:
    """Lines of the imports of dwdp.kernels inside a function or class of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for inner in ast.walk(node):
            names = ([inner.module or ""] if isinstance(inner, ast.ImportFrom)
                     else [a.name for a in inner.names] if isinstance(inner, ast.Import) else [])
            if any(n == "dwdp.kernels" or n.startswith("dwdp.kernels.") for n in names):
                found.append(inner.lineno)
    return sorted(set(found))


def test_modules_that_use_the_kernels_import_them_at_the_top():
    """`import dwdp` loads dwdp.kernels already (dwdp.runtime.expert_math imports it), so an import
    inside a function saves nothing and hides the dependency from whoever follows the imports."""
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "dwdp").rglob("*.py"))
             for line in nested_kernel_imports(path)]
    assert not found, f"imports of dwdp.kernels inside functions: {found}"


def test_the_import_check_sees_a_nested_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\n\n\ndef f():\n    from dwdp.kernels import moe_experts\n    return moe_experts\n"
                       "\n\nclass C:\n    import dwdp.kernels.moe\n")
    assert nested_kernel_imports(planted) == [5, 10]
