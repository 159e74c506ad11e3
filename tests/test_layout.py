"""The shape of the code, kept: modules and functions a newcomer can read, no import cycles, the product free of
test machinery and of patches outside mixprec/compat."""
import ast
import re
from pathlib import Path

from helpers import REPO

PRODUCT = [*sorted((REPO / "mixprec").rglob("*.py")), *sorted((REPO / "recipes").rglob("*.py")),
           *sorted((REPO / "benchmarks").rglob("*.py"))]
MAX_MODULE, MAX_FUNCTION = 400, 80


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_modules_and_functions_fit_on_a_few_screens():
    too_long = []
    for path in PRODUCT:
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long


def mixprec_imports(path: Path) -> set[str]:
    """The mixprec modules `path` imports, at the top or inside functions."""
    parts = path.relative_to(REPO).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    here = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mixprec")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package if parts[-1] != "__init__" else parts[:-1])
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.startswith("mixprec"):
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m != here}


def test_no_import_cycles_in_the_package():
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (REPO / "mixprec").rglob("*.py")}
    graph = {m: {i for i in mixprec_imports(p) if i in modules} for m, p in modules.items()}
    # a package imported for a submodule is not a dependency on the package's __init__ itself
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    visiting, done, cycles = set(), set(), []

    def visit(m, path):
        if m in visiting:
            cycles.append(" -> ".join(path[path.index(m):] + [m]))
            return
        if m in done:
            return
        visiting.add(m)
        for dep in sorted(graph[m]):
            visit(dep, path + [m])
        visiting.discard(m)
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert not cycles


def test_the_product_knows_nothing_of_tests_and_patches_nothing_outside_compat():
    problems = []
    for path in PRODUCT:
        text, rel = path.read_text(), str(path.relative_to(REPO))
        if "sys.path" in text:
            problems.append(f"{rel}: edits sys.path (the package is installed: pip install -r requirements.txt)")
        if re.search(r"^\s*(from tests|import tests|import faults|from helpers)", text, re.M):
            problems.append(f"{rel}: imports test machinery")
        if re.search(r"MIXPREC_TEST|fault injection|tests/faults", text):
            problems.append(f"{rel}: mentions test faults")
        if not rel.startswith("mixprec/compat/"):
            for line in text.splitlines():
                if re.match(r"\s*(accelerate|deepspeed|torch|accelerator)\.(?!backends\.)[\w.]+\s*=[^=]", line) or \
                        re.search(r"\.__dict__\.pop\(|_reset_state\(", line):
                    problems.append(f"{rel}: patches a dependency outside mixprec/compat: {line.strip()}")
    assert not problems


def test_no_comment_or_docstring_names_an_issue_number():
    pattern = re.compile(r"\b[Ii]ssue \d+|\(issue|#\d+\b(?!\))")
    files = [*PRODUCT, *[p for p in sorted((REPO / "tests").rglob("*.py")) if p.name != "test_layout.py"]]
    hits = [f"{p.relative_to(REPO)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and "huggingface/accelerate#" not in line]
    assert not hits
