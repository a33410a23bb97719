"""Lines of the library (``veloxquant_mlx/``, the count issue #15 sets a bound on), by folder and by kind.

``python scripts/library_lines.py`` prints, per folder (files directly in it), the lines ``wc -l`` counts and how
many of them are blank, docstring, comment or code (a docstring: the first string of a module, class or function).
"""

from __future__ import annotations

import ast
import pathlib
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent / "veloxquant_mlx"


def kinds(path: pathlib.Path) -> Counter:
    src = path.read_text()
    doc = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    counts = Counter()
    for i, line in enumerate(src.splitlines(), 1):
        text = line.strip()
        counts["blank" if not text else "docstring" if i in doc else "comment" if text.startswith("#") else "code"] += 1
    return counts


def main() -> None:
    folders: dict[str, Counter] = {}
    for path in sorted(ROOT.rglob("*.py")):
        folders.setdefault(str(path.parent.relative_to(ROOT.parent)), Counter()).update(kinds(path))
    total = sum(folders.values(), Counter())
    cols = ("blank", "docstring", "comment", "code")
    print(f"{'folder':44s} {'lines':>6s} " + " ".join(f"{c:>9s}" for c in cols))
    for name, c in [*folders.items(), ("total", total)]:
        print(f"{name:44s} {sum(c.values()):6d} " + " ".join(f"{c[k]:9d}" for k in cols))


if __name__ == "__main__":
    main()
