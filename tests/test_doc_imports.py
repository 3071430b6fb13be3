"""The docs name the package's code where it is: every import line of their code blocks runs, and every dotted
name `fedharness.x.y` they write is a module or an attribute of one (README.md and docs/**/*.md)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
IMPORT = re.compile(r"\s*(from fedharness[\w.]* import |import fedharness\b)")
# a dotted name, not a pattern such as `fedharness.register_*` (the lookahead refuses a name cut short)
DOTTED = re.compile(r"(?<![\w/.])fedharness(?:\.[A-Za-z_]\w*)+(?![\w*])")


def code_imports(text: str) -> list[tuple[int, str]]:
    """(line number, statement) of each import from the package in the text's fenced code blocks; a statement in
    parentheses over several lines is joined."""
    found, fenced, lines = [], False, text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and IMPORT.match(line):
            start, statement = i + 1, line.strip()
            while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                i += 1
                statement += " " + lines[i].strip()
            found.append((start, statement))
        i += 1
    return found


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module, or an attribute reached from the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_docs_import_lines_run():
    failed, ran = [], []
    for doc in DOCS:
        for line, statement in code_imports(doc.read_text()):
            where = f"{doc.relative_to(ROOT)}:{line}"
            try:
                exec(statement, {})
            except ImportError as err:
                failed.append(f"{where}: {statement}: {err}")
            ran.append((where, statement))
    assert failed == []
    # the extraction finds the lines it must: docs/tuning.md's batch example is one of them
    assert any(where.startswith("docs/tuning.md:") and "execute_batch" in s for where, s in ran), ran


def test_the_docs_dotted_names_exist():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for match in DOTTED.finditer(text):
            if not resolves(match.group(0)):
                missing.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: "
                               f"{match.group(0)}")
    assert missing == []


def test_a_wrong_path_is_caught():
    """The checks fail on the paths the docs once had wrong (execute_batch lives in runs.execute)."""
    text = "```python\nfrom fedharness.runs.batch import (Slot,\n    execute_batch)\n```\n"
    (line, statement), = code_imports(text)
    assert (line, statement) == (2, "from fedharness.runs.batch import (Slot, execute_batch)")
    try:
        exec(statement, {})
    except ImportError:
        pass
    else:
        raise AssertionError(statement)
    assert not resolves("fedharness.runs.batch.execute_batch") and resolves("fedharness.runs.execute.execute_batch")
    names = [m.group(0) for m in DOTTED.finditer("`fedharness.register_*`, `fedharness.register_model(...)`")]
    assert names == ["fedharness.register_model"]
