"""Comments and docstrings of `unison` and of its lab (benchmarks/lab) say why (the constraint), never a measured figure: a figure goes to
docs/benchmarks.md, beside the command that reproduces it, where it can be rerun and dated.

Read from the source: comments with `tokenize`, docstrings (module, class, function) with `ast`. A line fails when it
carries one of the clearest markers of a measurement:

* a number with a unit of time or memory (``6.6 s``, ``27.6 ms``, ``130 MiB``, ``32 GB``);
* a machine or accelerator (``Xeon``, ``EPYC``, ``H100``, ``H200``, ``A100``, ...): the machine a figure ran on;
* a date (``2026-11-27``): the day a figure was taken, or a history.

A figure written in words ("seconds", "a slow import") passes: the rule is about figures that go stale, and a
test that flagged every number would flag the mathematics.
The rule is also run on a planted figure, and must name its file and line: a rule that cannot fail is no rule.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "unison"
LAB = REPO / "benchmarks" / "lab"   # the peer comparisons `unison bench lightly` and `race` run


MEASURED = re.compile(
    r"(?<![\w.*])\d(?:[\d,]*\d)?(?:\.\d+)?(?:e-?\d+)?\s?(?:ms|µs|us|s|MiB|GiB|KiB|TiB|MB|GB|TB)\b"   # 6.6 s, 130 MiB
    r"|\b(?:Xeon|EPYC|Ryzen|H100|H200|A100|A6000|V100|L40S|RTX)\b"                              # the machine
    r"|\b20\d\d-[01]\d-[0-3]\d\b")                                                             # the day

# What may match, and why. Each entry (a file under src/unison, the figure as it matches there; "*": any) is a
# constraint the code implements or a format it reads or writes, not a measurement. Kept short: a new entry needs a
# reason of that kind.
ALLOWED: dict[tuple[str, str], str] = {
    # tables of accelerators the code looks up by name (datasheet peaks, device-name substrings)
    ("plan/gpus.py", "*"): "the GPU table of `unison plan --gpu`: datasheet values, keyed by the card's name",
    ("bench/flops.py", "*"): "bf16 peaks looked up by `torch.cuda.get_device_name()` substrings",
    # limits the code enforces, given in the unit a user thinks in
    ("data/files.py", "256 MiB"): "MAX_IMAGE_BYTES, described beside its name",
    ("data/files.py", "1 GiB"): "MAX_LIST_BYTES, described beside its name",
    ("data/source.py", "2 GiB"): "MEMORY_BUDGET, described beside its name",
    ("config/files.py", "1 MiB"): "MAX_CONFIG_BYTES, described beside its value",
    ("cli/train_args.py", "1 MiB"): "the YAML limit (MAX_CONFIG_BYTES) a user's file meets",
    ("config/train.py", "64 MiB"): "MAX_SIGNAL_IMAGES's cost, N**2 / 2 float64 values: arithmetic, not a measurement",
    ("models/weights.py", "128 GiB"): "MAX_WEIGHTS_BYTES, described beside its value",
    ("eval/finetune.py", "30 s"): "the progress line's cadence, which the code implements",
    # the syntax of durations, which the parser reads
    ("config/budget.py", "90s"): "an example of ``--time-budget``'s syntax",
    ("config/train.py", "30s"): "an example of ``--checkpoint-every``'s syntax",
    ("training/budget_advice.py", "95s"): "the format of a suggested ``--time-budget``",
    # examples of what a command writes (its format, not its figures)
    ("training/metrics.py", "2025-01-01"): "the module docstring's example of a train.log, time-stamped lines",
    ("training/metrics.py", "31 s"): "the module docstring's example of a train.log's last line (its format)",
    ("eval/knn.py", "12 s"): "an example of the kNN's progress line",
    ("training/preflight.py", "8.0 TiB"): "an example of the memory check's refusal",
}


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of `path`."""
    source = path.read_text()
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    text = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str) and first.end_lineno is not None):
                lines += [(n, text[n - 1]) for n in range(first.lineno, first.end_lineno + 1)]
    return sorted(lines)


def allowed(relative: str, match: str) -> bool:
    return (relative, "*") in ALLOWED or (relative, match) in ALLOWED


def figures(root: Path, shown_as: str = "src/unison") -> list[str]:
    """``file:line: text`` for every comment or docstring line under `root` that carries a measured figure."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        for number, line in prose_lines(path):
            hits = [m.group(0) for m in MEASURED.finditer(line)]
            if any(not allowed(relative, hit) for hit in hits):
                found.append(f"{shown_as}/{relative}:{number}: {line.strip()}")
    return found


def allowed_hit(relative: str, phrase: str) -> bool:
    """Whether `phrase` of allow-list entry `relative` still matches a figure there (an unused entry is stale)."""
    path = SRC / relative
    return any(phrase in ("*", hit) for _, line in prose_lines(path) for hit in
               (m.group(0) for m in MEASURED.finditer(line)))


def test_no_comment_or_docstring_carries_a_measured_figure() -> None:
    found = figures(SRC) + figures(LAB, "benchmarks/lab")
    assert not found, ("comments and docstrings say why, not what was measured: move the figure to "
                       "docs/benchmarks.md beside its command, or say the constraint instead:\n" + "\n".join(found))


def test_every_allowed_phrase_is_still_there() -> None:
    stale = [f"{file}: {phrase!r}" for (file, phrase) in ALLOWED if not allowed_hit(file, phrase)]
    assert not stale, "allow-list entries that no longer match (remove them):\n" + "\n".join(stale)


def test_a_planted_figure_is_named_by_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "files.py").write_text(       # an allowed file: its allowed phrase passes, a figure not
        '"""Limits: an image file at most `MAX_IMAGE_BYTES` (256 MiB)."""\n\n'
        "def read():\n"
        '    """Read it: on an H100 this took 0.13 s."""\n'
        "    return 1   # 40 ms faster than PIL\n")
    (tmp_path / "start.py").write_text(
        "# its start took 6.6 s of CPU\n"
        "class Start:\n"
        '    """Seen on 2026-11-27 (it was slow then)."""\n')
    assert figures(tmp_path) == [
        "src/unison/data/files.py:4: \"\"\"Read it: on an H100 this took 0.13 s.\"\"\"",
        "src/unison/data/files.py:5: # 40 ms faster than PIL",
        "src/unison/start.py:1: # its start took 6.6 s of CPU",
        "src/unison/start.py:3: \"\"\"Seen on 2026-11-27 (it was slow then).\"\"\"",
    ]


def test_a_number_without_a_unit_or_in_code_passes(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        '"""exp(1 / t) stays finite for t >= 0.02; a 4000 x 1 strip; s_v pixels; ``[b, 3, s, s]``; 2**31 ms; "seconds" as words."""\n'
        'TIMEOUT = "30 s"   # the timeout of a collective\n')
    assert figures(tmp_path) == []
