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


# Fields of dependencies that are internal although their names do not start with an underscore.
INTERNAL_FIELDS = {"base_lrs", "lr_lambdas", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                   "fp32_groups_flat", "_optimizers", "_schedulers", "_models"}


def own_names() -> set[str]:
    """Every name the product defines: functions, classes, attributes it assigns, variables, arguments."""
    names = set()
    for path in PRODUCT:
        for node in ast.walk(tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return names


def private_reads(path: Path, ours: set[str]) -> list[str]:
    """`x._name` (or getattr/setattr/hasattr with "_name") where `_name` is no name of the product's own, and
    dependencies' known internal fields, in `path`."""
    found = []
    for node in ast.walk(tree(path)):
        name = None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNAL_FIELDS:
            name = node.value
        if name is None:
            continue
        private = name.startswith("_") and not name.startswith("__") and name not in ours
        if private or name in INTERNAL_FIELDS:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_private_fields_of_dependencies_are_touched_only_in_compat():
    """Accelerate's, torch's and DeepSpeed's private or internal fields are read or written in mixprec/compat
    only, where each has a canary in tests/test_compat.py: an upgrade that moves them fails a canary there,
    not a user's run. No file is exempt."""
    ours = own_names()
    hits = [hit for path in PRODUCT if not str(path.relative_to(REPO)).startswith("mixprec/compat/")
            for hit in private_reads(path, ours)]
    assert not hits


def test_the_rule_for_private_fields_sees_what_it_must():
    """The check above is not blind: it flags each way of reaching a dependency's private field."""
    sample = REPO / "mixprec" / "_layout_probe.py"
    sample.write_text("def f(accelerator, scheduler, optimizer):\n    a = accelerator._optimizers\n"
                      "    scheduler.base_lrs = [1]\n    b = getattr(optimizer, '_step_supports_amp_scaling')\n"
                      "    c = torch.nn.modules.batchnorm._BatchNorm\n    return a, b, c\n")
    try:
        hits = private_reads(sample, own_names())
    finally:
        sample.unlink()
    assert sorted(h.rsplit(" ", 1)[1] for h in hits) == ["_BatchNorm", "_optimizers", "_step_supports_amp_scaling",
                                                         "base_lrs"]


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_packages_depend_one_way():
    """The precision report (doctor/) and the precision diff (numerics/) import neither each other; the training
    path (training/, precision/, health/, and what recipes/train.py imports) imports neither tool; the number
    formats (formats/) import nothing of the package above them."""
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (REPO / "mixprec").rglob("*.py")}
    imports = {m: {package_of(i) for i in mixprec_imports(p)} for m, p in modules.items()}
    problems = []
    for module, deps in sorted(imports.items()):
        pkg = package_of(module)
        for tool, other in (("mixprec.doctor", "mixprec.numerics"), ("mixprec.numerics", "mixprec.doctor")):
            if pkg == tool and other in deps:
                problems.append(f"{module} imports {other}")
        if pkg in ("mixprec.training", "mixprec.precision", "mixprec.health") and \
                deps & {"mixprec.doctor", "mixprec.numerics"}:
            problems.append(f"{module} (training path) imports {sorted(deps & {'mixprec.doctor', 'mixprec.numerics'})}")
        if pkg == "mixprec.formats" and deps - {"mixprec.formats", "mixprec.errors"}:
            problems.append(f"{module} (number formats) imports {sorted(deps - {'mixprec.formats'})}")
    assert not problems
