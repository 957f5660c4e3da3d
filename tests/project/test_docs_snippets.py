"""Every ```python block of README.md and docs/*.md runs as written: each in a fresh namespace, in this process
(on the CPU here; a block that can use CUDA picks it itself).

A block that cannot run so says why on the line just above its fence, in an HTML comment that Markdown hides:

    <!-- skip-test: REASON -->                    it needs CUDA or several processes, or is not code to run
    <!-- tested-by: tests/FILE.py::TEST_NAME -->  another test runs it as written (e.g. on gloo ranks)

A ``tested-by`` reference is checked here: that test must exist and read the document the block is in.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(skip-test|tested-by):\s*(.*?)\s*-->")


def _blocks():
    """(document, line of the fence, code, marker or None, marker argument) for every ```python block."""
    for doc in DOCUMENTS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```python":
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{doc.relative_to(ROOT)}:{i + 1}: a ```python block that never closes")
            above = lines[i - 1].strip() if i else ""
            marker = MARKER.fullmatch(above)
            if above.startswith("<!--") and "test" in above and marker is None:
                raise ValueError(f"{doc.relative_to(ROOT)}:{i}: expected <!-- skip-test: REASON --> or "
                                 f"<!-- tested-by: tests/FILE.py::TEST --> above the block, got {above!r}")
            yield (doc, i + 1, "\n".join(lines[i + 1:end]) + "\n", *(marker.groups() if marker else (None, None)))
            i = end + 1


BLOCKS = list(_blocks())

#: What a snippet that uses an integration needs installed (TRL's trainers import ``datasets``).
NEEDS = {"vpce.integrations.trl": ("trl", "datasets"), "vpce.integrations.transformers": ("transformers",),
         "vpce.integrations.torchtune": ("torchtune",), "vpce.integrations.megatron": ("megatron.core",),
         "vpce.integrations.verl": ("verl.trainer.ppo.core_algos",), "vpce.integrations.peft": ("peft",),
         "vpce.integrations.openrlhf": ("openrlhf",)}


def test_documents_have_snippets():
    names = {doc.name for doc, *_ in BLOCKS}
    assert {"README.md", "api.md", "integrations.md"} <= names, names


@pytest.mark.parametrize("doc, line, code, marker, arg", BLOCKS,
                         ids=[f"{doc.relative_to(ROOT)}:{line}" for doc, line, *_ in BLOCKS])
def test_snippet_runs_as_written(doc, line, code, marker, arg):
    where = f"{doc.relative_to(ROOT)}:{line}"
    if marker == "skip-test":
        assert arg, f"{where}: a skip-test marker needs its reason"
        pytest.skip(f"{where}: {arg}")
    if marker == "tested-by":
        path, _, name = arg.partition("::")
        test_file = ROOT / path
        assert test_file.is_file() and name, f"{where}: tested-by {arg!r}: expected tests/FILE.py::TEST_NAME"
        source = test_file.read_text()
        assert re.search(rf"(?m)^def {re.escape(name)}\(", source), f"{where}: no test {name} in {path}"
        assert doc.name in source, f"{where}: {path} does not read {doc.name}"
        return
    for integration, modules in NEEDS.items():  # CI has every extra; a GPU machine may lack one
        if integration in code:
            for module in modules:
                pytest.importorskip(module)
    exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
