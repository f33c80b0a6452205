"""Assertions on the verdict of a self-check (``gradlab_book.exercises*``), for its tests."""

from __future__ import annotations

import re


def run(check, fn, capsys):
    """Run a check; return (verdict, printed text)."""
    verdict = check(fn)
    return verdict, capsys.readouterr().out


def assert_passes(check, fn, capsys):
    verdict, out = run(check, fn, capsys)
    assert verdict is True, out
    assert re.fullmatch(r"All \d+ cases pass\.\n", out), out


def assert_fails(check, fn, capsys, *fragments):
    verdict, out = run(check, fn, capsys)
    assert verdict is False, out
    for fragment in fragments:
        assert fragment in out, (fragment, out)
    return out
