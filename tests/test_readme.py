"""README must not drift from the files: its loop is the recipe's loop, its paths exist."""
import re

from helpers import REPO


def readme() -> str:
    return (REPO / "README.md").read_text()


def test_the_loop_in_readme_is_the_loop_in_the_recipe():
    block = readme().split("## The loop", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    recipe = [line.strip() for line in (REPO / "recipes" / "train.py").read_text().splitlines()]
    wanted = [line.strip() for line in block.splitlines() if line.strip()]
    position = 0
    for line in wanted:  # every line, in the same order
        assert line in recipe[position:], line
        position = recipe.index(line, position) + 1


def test_paths_named_in_readme_exist():
    for path in set(re.findall(r"`((?:recipes|mixprec|accelerate_configs|slurm|tests|benchmarks)/[\w./-]+)`",
                               readme())):
        assert (REPO / path.rstrip("/")).exists(), path


def test_benchmark_tables_in_readme_are_the_committed_results():
    text = readme()
    results = sorted((REPO / "benchmarks" / "results").glob("*/benchmark.md"))
    assert results, "no committed benchmark results"
    for md in results:
        rows = [line for line in md.read_text().splitlines() if line.startswith("| ") and "runner" not in line]
        assert rows and all(row in text for row in rows), md
        assert f"benchmarks/results/{md.parent.name}" in text, md.parent.name
