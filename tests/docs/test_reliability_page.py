"""docs/reliability.md, where the exit codes are documented and every fault and bad input is a row (what you did,
what unison does, exit code, proof): the exit codes are the ones `unison.errors` defines, and every row's proof
names a test that exists in the file it links to."""

from __future__ import annotations

import re
from pathlib import Path

import unison.errors as errors

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "reliability.md").read_text()
PROOF = re.compile(r"\[`(test_\w+)(?:\[[^\]]*\])?(?:\.py)?`\]\(\.\./(tests/[^)#\s]+)\)")   # a test, or its file


def _section(title: str) -> str:
    return PAGE.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _cells(line: str) -> list[str]:
    """A table row's cells; a pipe inside a code span is part of its cell."""
    cells, cell, code = [], "", False
    for c in line.strip().strip("|"):
        code = not code if c == "`" else code
        if c == "|" and not code and not cell.endswith("\\"):
            cells.append(cell.strip())
            cell = ""
        else:
            cell += c
    return [*cells, cell.strip()]


def test_the_exit_codes_are_those_unison_errors_defines():
    rows = [_cells(line) for line in _section("Exit codes").splitlines() if re.match(r"\| \d+ \|", line)]
    documented = {int(code) for code, *_ in rows}
    kinds = {cls.exit_code for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.UnisonError)}
    assert documented == {0, *kinds, errors.PREEMPTED_EXIT_CODE, errors.INTERRUPTED_EXIT_CODE,
                          errors.BROKEN_PIPE_EXIT_CODE}
    for code, _, classes in rows:
        for name in re.findall(r"`(\w+)`", classes):
            exc = getattr(errors, name, None) or {"KeyboardInterrupt": KeyboardInterrupt}[name]
            assert errors.exit_code_of(exc.__new__(exc)) == int(code), (name, code)


def test_every_case_has_an_exit_code_and_a_proof_that_exists():
    cases = [_cells(line) for line in PAGE.splitlines()
             if line.startswith("| ") and not line.startswith(("| What you did", "| Code", "| Command", "| What |"))]
    cases = [c for c in cases if len(c) == 4 and c[0] not in ("---", "")]
    assert len(cases) > 300
    for did, _, code, proof in cases:
        assert re.fullmatch(r"-|non-zero|-?\d+(, -?\d+)*(, then \d+)?", code), (did, code)
        tests = PROOF.findall(proof)
        assert tests, (did, proof)
        for name, path in tests:
            assert (ROOT / path).is_file(), path
            if path.endswith(".py") and not path.endswith(f"/{name}.py"):
                assert re.search(rf"\bdef {name}\(", (ROOT / path).read_text()), f"{path} has no {name}"
