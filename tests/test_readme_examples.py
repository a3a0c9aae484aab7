"""Every README example marked as runnable runs as written, and every relative link in the docs resolves.

The convention (also in RELEASING.md, "Documentation"): a fenced ```python or ```bash block whose fence
line comes right after a line `<!-- example -->` is an example. Each runs in a fresh subprocess, in an
empty temporary directory (so examples that write files leave nothing behind), with this interpreter
(python blocks) or `bash -euo pipefail` with this interpreter's `bin/` first on PATH (bash blocks: the
`gem-train` command is the installed one), one torch thread, and a timeout. `<!-- example: slow -->` marks
one that takes more than a few seconds on two cores: it runs under `-m slow`. Blocks without the marker are
illustrations (signatures, config fragments, output) and are not run. A failure names the README, the
line of the block's fence, the exit status and the end of its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
DOCS = [
    *READMES,
    ROOT / "RELEASING.md",
    *sorted((ROOT / "packages").glob("*/docs/*.md")),
    *sorted((ROOT / "packages").glob("*/BENCHMARKS.md")),
]
MARKER = re.compile(r"^<!--\s*example(?::\s*(?P<tags>[\w ,-]+))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
TIMEOUT_S = {"fast": 120, "slow": 600}


@dataclass(frozen=True)
class Example:
    readme: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "python" or "bash"
    code: str
    slow: bool

    @property
    def id(self) -> str:
        return f"{self.readme.relative_to(ROOT)}:{self.line}"


def extract_examples(path: Path) -> list[Example]:
    """The marked fenced blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker is None:
            i += 1
            continue
        tags = {t.strip() for t in (marker.group("tags") or "").replace(",", " ").split()}
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group("lang") not in ("python", "bash"):
            where = f"{path}:{i + 1}"
            raise ValueError(f"{where}: <!-- example --> must be followed by a ```python or ```bash block")
        end = i + 2
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 2}: unclosed code block")
        examples.append(
            Example(path, i + 2, fence.group("lang"), "\n".join(lines[i + 2 : end]) + "\n", "slow" in tags)
        )
        i = end + 1
    return examples


EXAMPLES = [e for readme in READMES for e in extract_examples(readme)]


def _params() -> list[object]:
    return [pytest.param(e, id=e.id, marks=[pytest.mark.slow] if e.slow else []) for e in EXAMPLES]


def run_example(example: Example, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    if example.lang == "python":
        script = cwd / "example.py"
        script.write_text(example.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", example.code]
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S["slow" if example.slow else "fast"],
        check=False,
    )


def test_every_package_readme_has_an_example():
    """Each package README shows something that runs (the harness's reason to exist)."""
    with_examples = {e.readme for e in EXAMPLES}
    missing = [str(r.relative_to(ROOT)) for r in READMES[1:] if r not in with_examples]
    assert not missing, f"package READMEs without a <!-- example --> block: {missing}"


@pytest.mark.parametrize("example", _params())
def test_readme_example_runs(example: Example, tmp_path: Path):
    try:
        done = run_example(example, tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{example.id}: the {example.lang} example ran past {e.timeout} s")
    if done.returncode != 0:
        tail = (done.stdout[-2000:] + "\n--- stderr ---\n" + done.stderr[-4000:]).strip()
        what = f"{example.id}: the {example.lang} example exited {done.returncode}"
        pytest.fail(f"{what}\n{tail}", pytrace=False)


def test_extract_examples_reads_the_convention(tmp_path: Path):
    """The extractor takes marked blocks only, with their fence line and tags; a bad marker is an error."""
    md = tmp_path / "README.md"
    md.write_text(
        "# t\n\n```python\nnot_run()\n```\n\n<!-- example -->\n```python\nprint(1)\n```\n"
        "<!-- example: slow -->\n```bash\necho hi\n```\n"
    )
    examples = extract_examples(md)
    assert [(e.line, e.lang, e.code, e.slow) for e in examples] == [
        (8, "python", "print(1)\n", False),
        (12, "bash", "echo hi\n", True),
    ]
    md.write_text("<!-- example -->\n\n```python\nx\n```\n")
    with pytest.raises(ValueError, match=r"README.md:1: <!-- example --> must be followed"):
        extract_examples(md)


def test_a_failing_example_is_reported(tmp_path: Path):
    """The runner reports a failing example's exit status (so the harness cannot pass vacuously)."""
    bad = Example(tmp_path / "README.md", 3, "python", "raise SystemExit(3)\n", False)
    assert run_example(bad, tmp_path).returncode == 3
    bad_sh = Example(tmp_path / "README.md", 3, "bash", "false\necho never\n", False)
    done = run_example(bad_sh, tmp_path)
    assert done.returncode != 0 and "never" not in done.stdout


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link that is not a URL or an in-page anchor, outside code blocks."""
    found: list[tuple[int, str]] = []
    in_code = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in LINK.finditer(line):
            target = m.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            found.append((n, target))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = [
        f"{doc.relative_to(ROOT)}:{n}: {target}"
        for n, target in relative_links(doc)
        if not (doc.parent / target.split("#", 1)[0]).exists()
    ]
    assert not broken, "links to missing files:\n" + "\n".join(broken)
