"""The tree as a whole: the words it uses about itself, and the shape of the package's imports.

- The repository speaks of the software only. Words about how the work on it was organised (its numbered or
  ordinal working periods and runs, the machines' rental, tracker numbers) belong in the tracker, not in code,
  docs, tests or metadata. The patterns are precise: a pytest session, a process group or a function call are not
  flagged. (This file spells the words it looks for with a character class or split strings, so that it does not
  flag itself.)
- The package ``vpce`` has no import cycle (imports inside functions count), and no module imports another
  package's private (underscore) name: what is shared across packages has a public name.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vpce"

_ORDINAL = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(?:st|nd|rd|th)")
PROCESS_WORDS = {
    "an ordinal working period": rf"\b(?:{_ORDINAL})[ -]+sessio[n]",
    "a working period named by its place": r"\b(?:next|this|last|previous|earlier|later) sessio[n]\b",
    "a numbered working period": r"\bsessio[n]s? #?\d+\b",
    "the machines' time": r"\bdevic[e][ -]time\b",
    "the machines' rental": r"\bl[e]ases?\b",
    "a numbered run": r"\bcall[s]?[ -]#?\d+\b",
    "a tracker issue": r"\b(?:issues?|tickets?|tracker)[ -]#?\d+\b",
    "a tracker number": r"(?<![\w/&#.])#\d{2,3}\b(?![\w-])",
}
_PATTERN = re.compile("|".join(f"(?:{p})" for p in PROCESS_WORDS.values()), re.IGNORECASE)
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".in", ".sh", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".json", ""}
_SKIP_PARTS = {".git", "__pycache__", "build", "dist", "bench-out", "demo-out"}


def _tracked_files() -> list[pathlib.Path]:
    """The repository's files: git's list where this is a checkout, else every text file under ROOT (an sdist)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        names = [n for n in out.stdout.decode().split("\0") if n]
        if names:
            return [ROOT / n for n in names]
    except (OSError, subprocess.SubprocessError):
        pass
    return [p for p in ROOT.rglob("*") if p.is_file() and not _SKIP_PARTS.intersection(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


def _text_files():
    for path in _tracked_files():
        if path.suffix in _TEXT_SUFFIXES and path.is_file():
            try:
                yield path, path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


@pytest.mark.parametrize("text, flagged", [
    ("as measured in the thirteenth " + "session", True),
    ("the 2nd-" + "session figures", True),
    ("prepared for the next " + "session", True),
    ("ran as c" + "all 14 of the l" + "ease", True),
    ("cut off when the devi" + "ce time ran out", True),
    ("issue #" + "36's bars", True),
    ("(#" + "54)", True),
    ("a pytest session fixture", False),
    ("torch.distributed's process group", False),
    ("the first call recomputes the logits", False),
    ("calls the kernel twice", False),
    ("color #ff0000, hex #123456", False),
    ("release notes", False),
])
def test_process_word_patterns(text, flagged):
    """The patterns flag what they are for and nothing of the software's own vocabulary."""
    assert bool(_PATTERN.search(text)) is flagged, (text, _PATTERN.search(text))


def test_no_words_about_how_the_work_was_organised():
    hits = []
    for path, text in _text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            m = _PATTERN.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "words about how the work was organised, not about the software:\n" + "\n".join(hits[:40])


def _modules() -> dict[str, pathlib.Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def _imports(mods):
    """(importer, imported module, names) for every ``from ... import`` of a vpce module, at any depth."""
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base == "vpce" or base.startswith("vpce."):
                    yield mod, base, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("vpce."):
                        yield mod, a.name, []


def test_no_import_cycles():
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, base, names in _imports(mods):
        for name in names or [None]:
            target = f"{base}.{name}" if name and f"{base}.{name}" in mods else base
            if target in mods and target != mod:
                graph[mod].add(target)

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    cycles = sorted({m for m in mods if m in reach(m)})
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_no_private_name_imported_from_another_package():
    mods = _modules()
    bad = []
    for mod, base, names in _imports(mods):
        importer_pkg = mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]
        for name in names:
            if not name.startswith("_") or name.startswith("__"):
                continue
            source = f"{base}.{name}" if f"{base}.{name}" in mods else base
            source_pkg = source if source in mods and mods[source].name == "__init__.py" else source.rpartition(".")[0]
            if source_pkg != importer_pkg:
                bad.append(f"{mod} imports {name} from {base}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_every_autograd_function_refuses_a_double_backward():
    """Every ``torch.autograd.Function`` of the package runs ``refuse_double_backward`` first in its backward: its
    gradients are formed by kernels, held from forward or exchanged, none of it recorded by autograd."""
    missing = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any(ast.unparse(b).endswith("autograd.Function") for b in node.bases):
                continue
            backward = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "backward"), None)
            body = [s for s in (backward.body if backward else []) if not (isinstance(s, ast.Expr) and
                                                                        isinstance(s.value, ast.Constant))]
            first = ast.unparse(body[0]) if body else ""
            if not first.startswith("refuse_double_backward("):
                missing.append(f"{mod}.{node.name}")
    assert not missing, f"autograd Functions whose backward does not start with refuse_double_backward: {missing}"
