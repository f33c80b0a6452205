"""The wrong answers that the book suite shows its self-checks reject, read from its tests.

``tests/book/test_exercises*.py`` assert, in parametrized tests, that typical wrong answers
fail: ``assert_fails(check, answer, ...)`` or ``assert check(answer) is False``. This reads
those tests (their parameters and, by their source, which argument is the check and which
the answer), so that the assignments suite grades the same wrong answers without a list of
its own that could drift from the book's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

BOOK_TESTS = Path(__file__).resolve().parents[1] / "book"


@dataclass(frozen=True)
class WrongAnswer:
    check: str  # the check_* function's name
    answer: object
    where: str  # test module, test and parameter index, for the test id


def _rejections(tree: ast.AST) -> list[tuple[ast.expr, ast.expr, list[ast.expr]]]:
    """(check, answer, the check's other arguments) of each rejection a test asserts.

    The other arguments of ``assert_fails`` are the verdict's fragments, not the check's.
    """
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "assert_fails"
            and len(node.args) >= 2
        ):
            found.append((node.args[0], node.args[1], []))
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Call)
            and node.left.args
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Is)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value is False
        ):
            call = node.left
            others = [*call.args[1:], *(k.value for k in call.keywords)]
            found.append((call.func, call.args[0], others))
    return found


def _parameters(mark) -> tuple[list[str], list[tuple]]:
    names, values = mark.args[0], mark.args[1]
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    rows = []
    for value in values:
        value = getattr(value, "values", value)  # pytest.param(...)
        rows.append(tuple(value) if len(names) > 1 else (value,))
    return list(names), rows


def _resolve(expr: ast.expr, names: list[str], row: tuple, module) -> object:
    if isinstance(expr, ast.Name) and expr.id in names:
        return row[names.index(expr.id)]
    if isinstance(expr, ast.Name) and expr.id not in vars(module):
        # unpacked in the test's body (``fn, *fragments = wrong``): the row's first callable
        return next(
            v for item in row for v in (item if isinstance(item, tuple) else (item,)) if callable(v)
        )
    return eval(ast.unparse(expr), vars(module))  # the book suite's own names


def known_wrong() -> list[WrongAnswer]:
    """Every (check, wrong answer) pair that a parametrized exercise test asserts fails."""
    wrong = []
    for path in sorted(BOOK_TESTS.glob("test_exercises*.py")):
        module = importlib.import_module(path.stem)
        for name, test in vars(module).items():
            marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
            if not name.startswith("test_") or len(marks) != 1:
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(test)))
            names, rows = _parameters(marks[0])
            for check_expr, answer_expr, others in _rejections(tree):
                if any(
                    isinstance(n, ast.Name) and n.id in names for o in others for n in ast.walk(o)
                ):
                    continue  # the test varies the check's data, not the answer
                for index, row in enumerate(rows):
                    check = _resolve(check_expr, names, row, module)
                    if not getattr(check, "__name__", "").startswith("check_"):
                        continue
                    answer = _resolve(answer_expr, names, row, module)
                    wrong.append(
                        WrongAnswer(check.__name__, answer, f"{path.stem}.{name}[{index}]")
                    )
    return wrong
