"""docs/design.md stays true about the source tree.

Pure text checks (no zeroshard or torch import): the design note's file table
has one row for every source file and names only files that exist, and every
``[Note: X]`` the code refers to is defined somewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
FILE_TABLE_HEADING = "## Source files"

# Folders that hold build outputs or caches, never sources.
_SKIPPED_DIRS = {"__pycache__", "build", ".pytest_cache"}


def _files(top: Path, suffixes: tuple[str, ...]) -> set[str]:
    found = set()
    for path in top.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in _SKIPPED_DIRS for part in rel.parts):
            continue
        if path.is_file() and path.name.endswith(suffixes):
            found.add(rel.as_posix())
    return found


def source_files() -> set[str]:
    """Every .h/.cpp under csrc/ and every .py under python/zeroshard/."""
    return _files(ROOT / "csrc", (".h", ".cpp")) | _files(ROOT / "python" / "zeroshard", (".py",))


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def table_paths() -> list[str]:
    """The first cell of every row of the file table, which must be one
    backticked repository path."""
    section = _section(DESIGN.read_text(encoding="utf-8"), FILE_TABLE_HEADING)
    paths = []
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| file |"):
            continue
        first = line.split("|")[1].strip()
        match = re.fullmatch(r"`([^`]+)`", first)
        assert match, f"a file table row of docs/design.md does not start with one `path`: {line}"
        paths.append(match.group(1))
    return paths


def test_every_source_file_has_a_row_in_the_design_note() -> None:
    listed = set(table_paths())
    missing = sorted(source_files() - listed)
    assert not missing, (
        "source files missing from docs/design.md; add a row to the file table in "
        f"docs/design.md ({FILE_TABLE_HEADING!r}) saying what each one does: " + ", ".join(missing)
    )


def test_every_file_the_design_note_names_exists() -> None:
    paths = table_paths()
    gone = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not gone, (
        "the file table in docs/design.md names files that do not exist (renamed or "
        "removed? update or drop their rows): " + ", ".join(gone)
    )
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    assert not repeated, "files with two rows in the file table of docs/design.md: " + ", ".join(
        repeated
    )


_NOTE = re.compile(r"\[Note: ([^\[\]]{1,100})\]")
# A line continuing a comment or docstring: its leading marker is dropped when
# lines are joined, so a reference broken over two lines is still found.
_CONTINUATION = re.compile(r"\s*\n\s*(?://+|#+)?\s*")
# A definition: the note's name alone on its line, after a comment marker or
# a docstring's opening quotes (or bare, inside a docstring) ...
_OWN_LINE = re.compile(r'^\s*(?://+|#+|[rbu]?""")?\s*\[Note: ([^\]]+)\]\s*$')
# ... or opening a comment block and followed by its text on the same line.
_BLOCK_START = re.compile(r"^\s*//+\s*\[Note: ([^\]]+)\]\s+\S")


def _code_files() -> list[Path]:
    roots = [ROOT / "csrc", ROOT / "python"]
    return sorted(
        p
        for top in roots
        for p in top.rglob("*")
        if p.is_file()
        and p.suffix in {".h", ".cpp", ".py"}
        and not any(part in _SKIPPED_DIRS for part in p.relative_to(ROOT).parts)
    )


def note_references() -> dict[str, set[str]]:
    """Note name -> files of csrc/ and python/ that mention it."""
    refs: dict[str, set[str]] = {}
    for path in _code_files():
        text = _CONTINUATION.sub(" ", path.read_text(encoding="utf-8"))
        for name in _NOTE.findall(text):
            refs.setdefault(" ".join(name.split()), set()).add(path.relative_to(ROOT).as_posix())
    return refs


def note_definitions() -> set[str]:
    defined = set()
    for path in [*_code_files(), *sorted((ROOT / "tests").rglob("*.h"))]:
        previous = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            own = _OWN_LINE.match(line)
            if own and (path.suffix == ".py" or line.lstrip().startswith("//")):
                defined.add(own.group(1))
            block = _BLOCK_START.match(line)
            if block and not previous.lstrip().startswith("//"):
                defined.add(block.group(1))
            previous = line
    # The design note defines a few itself, as headings.
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^#+\s+\[Note: ([^\]]+)\]\s*$", line)
        if heading:
            defined.add(heading.group(1))
    return defined


def test_every_referenced_note_is_defined() -> None:
    defined = note_definitions()
    dangling = {name: files for name, files in note_references().items() if name not in defined}
    listed = "; ".join(
        f"[Note: {name}] in {', '.join(sorted(files))}" for name, files in sorted(dangling.items())
    )
    assert not dangling, (
        "[Note: ...] references with no definition (a comment line '// [Note: X]' or "
        "'# [Note: X]' above the explanation, or a '### [Note: X]' heading in "
        "docs/design.md): " + listed
    )
