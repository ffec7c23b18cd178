"""stratagem's messages speak one dialect: "What is wrong. Received: VALUE. What to do.", the advice a sentence
of its own that starts with its verb ("Restart the job ..."), never behind a "Fix:" label."""

from __future__ import annotations

import ast
from pathlib import Path

import stratagem

SOURCE = Path(stratagem.__file__).parent
LABEL = "Fix:"


def labelled_lines(source: str) -> list[int]:
    """The lines of ``source`` where a string constant (f-strings' literal parts included) holds the label."""
    return sorted(
        {
            node.lineno
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and LABEL in node.value
        }
    )


def test_the_scan_finds_the_label_in_plain_strings_f_strings_and_continued_literals() -> None:
    source = (
        'raise ValueError("x is bad. Received: 1. Fix: pass 2.")\n'
        'message = f"y is bad. Received: {y}. Fix: pass {z}."\n'
        'other = ("z is bad. Received: 3. "\n'
        '         "Fix: pass 4.")\n'
        'fine = "w is bad. Received: 5. Pass 6."  # Fix: a comment is not a message\n'
    )
    assert labelled_lines(source) == [1, 2, 3]


def test_no_message_in_stratagem_carries_a_fix_label() -> None:
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) > 50  # the walk reaches the package at all
    found = []
    for path in files:
        relative = path.relative_to(SOURCE).as_posix()
        found += [f"{relative}:{line}" for line in labelled_lines(path.read_text(encoding="utf-8"))]
    assert found == [], f"messages with a {LABEL!r} label (write the advice as the last sentence): {found}"
