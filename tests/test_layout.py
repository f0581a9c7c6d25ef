"""Import rules an AST walk can check (shared/STYLE.md, "One room per idea"): a task owns its data reader's
specifics and its rewards, so generic code imports no task."""

import ast
from pathlib import Path

import grpax

PACKAGE = Path(grpax.__file__).parent


def imported_names(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file names, function-local ones included, in full:
    ``from grpax.tasks import gsm8k`` names ``grpax.tasks`` and ``grpax.tasks.gsm8k``; relative imports resolved."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]  # a module's package; for an __init__.py, the package itself
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..data import y
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def modules(folder: Path = PACKAGE) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_the_walk_sees_imports_in_every_form():
    folder = PACKAGE / "tasks"
    assert "grpax.tasks.gsm8k" in imported_names(folder / "__init__.py")
    assert "grpax.tasks.gsm8k.PROMPTS" in imported_names(folder / "prompts.py")
    assert "grpax.data.prompts.prepare_rows" in imported_names(
        PACKAGE / "cli" / "evaluate.py"
    )  # in a function


def test_no_module_outside_tasks_imports_a_gsm8k_module():
    offenders = [
        (str(path.relative_to(PACKAGE)), name)
        for path in modules()
        if path.relative_to(PACKAGE).parts[0] != "tasks"
        for name in sorted(imported_names(path))
        if any("gsm8k" in part for part in name.split("."))
    ]
    assert offenders == []


def test_data_imports_nothing_of_grpax_but_data_and_the_errors_leaf():
    for path in modules(PACKAGE / "data"):
        for name in imported_names(path):
            if name.split(".")[0] == "grpax":
                assert name.startswith("grpax.data.") or name.startswith("grpax.errors"), (path.name, name)


def test_eval_imports_no_task():
    # The statistics take the task's answer check; only the task-neutral answer helpers and the Task type are read.
    allowed = ("grpax.tasks.answers", "grpax.tasks.base")
    for path in modules(PACKAGE / "eval"):
        for name in imported_names(path):
            if name == "grpax.tasks" or name.startswith("grpax.tasks."):
                assert any(name == a or name.startswith(a + ".") for a in allowed), (path.name, name)
