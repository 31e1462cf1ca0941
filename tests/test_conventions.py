"""Conventions a reader (or a tool that follows imports) relies on across the package: a module that
uses the kernels imports them at its top, and every file's shape legend follows the one glossary of
docs/design.md (one letter, one meaning)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*(ROOT / "dwdp").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"), *(ROOT / "bench").rglob("*.py"),
           *(ROOT / "traces").rglob("*.py"), *(ROOT / "examples").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
# A legend entry: "SYM = meaning", after the start of the legend or a ", " / "; " / ". " that ends the last one.
ENTRY = re.compile(r"(?:^|[,;.]\s+)([A-Za-z][A-Za-z0-9_]*(?:\[t\])?) = ")
# Legends of files the composite rewrite (issue 40) owns, with the letters that differ from the glossary; each must
# still differ (drop it once fixed). composite.py: S = pool slots (B, prefetch slots, in the glossary);
# test_composite_layout.py: nb (nb[t]).
PENDING: dict[str, set[str]] = {}


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


def glossary() -> dict[str, str]:
    """symbol -> its meaning's head (the words before any ":", "(" or ","), from docs/design.md; a
    legend's meaning of the symbol holds its head ("local experts per rank" for "local experts")."""
    text = (ROOT / "docs" / "design.md").read_text().split("## Shape glossary", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \|$", text, flags=re.M)
    return {symbol: re.split(r"[:(,]", meaning, maxsplit=1)[0].strip().lower() for symbol, meaning in rows}


def legend(path: Path) -> list[tuple[str, str]]:
    """(symbol, meaning) of each entry of the `Legend:` paragraph of `path`'s module docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    if "Legend:" not in doc:
        return []
    text = " ".join(doc.split("Legend:", 1)[1].split("\n\n", 1)[0].split())
    found = list(ENTRY.finditer(text))
    return [(m.group(1), text[m.end():found[i + 1].start() if i + 1 < len(found) else len(text)].strip(" .,;"))
            for i, m in enumerate(found)]


def legend_problems(path: Path, table: dict[str, str]) -> dict[str, str]:
    """symbol -> what is wrong with its entry in `path`'s legend (not in the table, or another meaning)."""
    problems = {}
    for symbol, meaning in legend(path):
        if symbol not in table:
            problems[symbol] = f"{symbol} = {meaning!r}: not in the glossary"
        elif table[symbol] not in meaning.lower():
            problems[symbol] = f"{symbol} = {meaning!r}: the glossary's {symbol} is {table[symbol]!r}"
    return problems


def test_the_glossary_gives_each_symbol_one_meaning():
    rows = re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs" / "design.md").read_text().split("## Shape glossary")[1],
                      flags=re.M)
    assert len(rows) > 40 and len(rows) == len(set(rows)), sorted(r for r in rows if rows.count(r) > 1)


def test_every_legend_follows_the_glossary():
    table = glossary()
    found, stale = [], []
    for path in sorted(SOURCES):
        rel = str(path.relative_to(ROOT))
        problems = legend_problems(path, table)
        pending = PENDING.get(rel, set())
        stale += [f"{rel}: {s} now follows the glossary: drop it from PENDING" for s in pending - set(problems)]
        found += [f"{rel}: {p}" for s, p in problems.items() if s not in pending]
    assert not found and not stale, "\n".join(found + stale)


@pytest.mark.parametrize("text,problem", [
    ("Legend: T = tokens, H = heads.", "H"),                  # a letter with another meaning
    ("Legend: T = tokens, Y = years.", "Y"),                  # a letter the glossary lacks
    ("Legend: T = tokens per rank, H = hidden size.", None),  # more words after the meaning
])
def test_the_legend_check_sees_a_letter_with_another_meaning(tmp_path, text, problem):
    planted = tmp_path / "planted.py"
    planted.write_text(f'"""A module.\n\n{text}\n"""\n')
    assert list(legend_problems(planted, glossary())) == ([problem] if problem else [])
