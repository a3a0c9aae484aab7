"""Every README example marked as runnable runs as written, and every relative link in the docs resolves.

The convention (also in RELEASING.md, "Documentation"): a fenced block whose fence line comes right after a
line `<!-- example -->` is an example.

- A ```python block runs with this interpreter, a ```bash block with `bash -euo pipefail` and this
  interpreter's `bin/` first on PATH (so `gem-train` is the installed command), each in a fresh subprocess,
  in an empty temporary directory (examples that write files leave nothing behind), with one torch thread
  and a timeout.
- Tags after a colon, separated by spaces: `slow` (more than a few seconds on two cores: runs under
  `-m slow`); `session=NAME` (the blocks of one README with this name run in order, in one directory, as one
  test: a worked example in several steps); `file=PATH` (the block is not run but written to PATH in its
  session's directory: a config file of the walk-through, any language); `requires=MODULE[+MODULE]`
  (skipped, saying so, where a module it needs is not in this checkout).
  E.g. `<!-- example: session=own-data file=my-ads.toml -->` above a ```toml block.
- Blocks without the marker are illustrations (signatures, fragments, output) and are not run.

A failure names the README, the line of the failing block's fence, the exit status and the end of its
output.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
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
MARKER = re.compile(r"^<!--\s*example(?::\s*(?P<tags>[^>]*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
# Generous: on a loaded 2-core machine a torch import alone can take a minute of wall time.
TIMEOUT_S = {"fast": 300, "slow": 900}


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    file: str | None  # written to this path instead of run


@dataclass(frozen=True)
class Example:
    """One test: a block alone, or the blocks of a session in order."""

    readme: Path
    blocks: tuple[Block, ...]
    slow: bool
    requires: tuple[str, ...] = ()  # modules it needs (skipped, with the reason, where one is missing)

    @property
    def id(self) -> str:
        return f"{self.readme.relative_to(ROOT)}:{self.blocks[0].line}"


def _tags(text: str | None) -> dict[str, str]:
    tags: dict[str, str] = {}
    for word in (text or "").replace(",", " ").split():
        key, _, value = word.partition("=")
        tags[key] = value
    unknown = set(tags) - {"slow", "session", "file", "requires"}
    if unknown:
        known = "slow, session=NAME, file=PATH, requires=MODULE"
        raise ValueError(f"unknown example tags {sorted(unknown)} (known: {known})")
    return tags


def extract_examples(path: Path) -> list[Example]:
    """The marked fenced blocks of one Markdown file: one example per block, or per session, in order."""
    lines = path.read_text().splitlines()
    examples: list[Example] = []
    sessions: dict[str, int] = {}  # name -> index in examples
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker is None:
            i += 1
            continue
        where = f"{path}:{i + 1}"
        try:
            tags = _tags(marker.group("tags"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise ValueError(f"{where}: <!-- example --> must be followed by a fenced block")
        lang, file = fence.group("lang"), tags.get("file") or None
        if file is None and lang not in ("python", "bash"):
            raise ValueError(f"{where}: only ```python and ```bash blocks run (or give file=PATH)")
        if file is not None and "session" not in tags:
            raise ValueError(f"{where}: file=PATH belongs to a session=NAME")
        end = i + 2
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 2}: unclosed code block")
        block = Block(i + 2, lang, "\n".join(lines[i + 2 : end]) + "\n", file)
        session = tags.get("session")
        needs = tuple(m for m in tags.get("requires", "").split("+") if m)
        if session and session in sessions:
            k = sessions[session]
            old = examples[k]
            requires = (*old.requires, *needs)
            examples[k] = Example(path, (*old.blocks, block), old.slow or "slow" in tags, requires)
        else:
            if session:
                sessions[session] = len(examples)
            examples.append(Example(path, (block,), "slow" in tags, needs))
        i = end + 1
    return examples


EXAMPLES = [e for readme in READMES for e in extract_examples(readme)]


def _params() -> list[object]:
    params = []
    for e in EXAMPLES:
        limit = TIMEOUT_S["slow" if e.slow else "fast"] * len(e.blocks) + 60  # over each block's own limit
        marks = [pytest.mark.timeout(limit), *([pytest.mark.slow] if e.slow else [])]
        params.append(pytest.param(e, id=e.id, marks=marks))
    return params


def run_block(block: Block, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run one block in ``cwd`` (or write it to its file there)."""
    if block.file is not None:
        (cwd / block.file).parent.mkdir(parents=True, exist_ok=True)
        (cwd / block.file).write_text(block.code)
        return subprocess.CompletedProcess([], 0, "", "")
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    if block.lang == "python":
        script = cwd / f"readme_example_{block.line}.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    # A session of its own, so that a timeout ends the example's children too (gem-train under bash).
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_every_package_readme_has_an_example():
    """Each package README shows something that runs (the harness's reason to exist)."""
    with_examples = {e.readme for e in EXAMPLES}
    missing = [str(r.relative_to(ROOT)) for r in READMES[1:] if r not in with_examples]
    assert not missing, f"package READMEs without a <!-- example --> block: {missing}"


@pytest.mark.parametrize("example", _params())
def test_readme_example_runs(example: Example, tmp_path: Path):
    missing = [m for m in example.requires if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{example.id}: needs {', '.join(missing)}, not in this checkout")
    timeout_s = TIMEOUT_S["slow" if example.slow else "fast"]
    for block in example.blocks:
        where = f"{example.readme.relative_to(ROOT)}:{block.line}"
        try:
            done = run_block(block, tmp_path, timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where}: the {block.lang} example ran past {timeout_s} s", pytrace=False)
        if done.returncode != 0:
            tail = (done.stdout[-2000:] + "\n--- stderr ---\n" + done.stderr[-4000:]).strip()
            pytest.fail(f"{where}: the {block.lang} example exited {done.returncode}\n{tail}", pytrace=False)


def test_extract_examples_reads_the_convention(tmp_path: Path):
    """The extractor takes marked blocks only, with their fence line and tags; sessions join their blocks;
    a bad marker is an error naming the line."""
    md = tmp_path / "README.md"
    md.write_text(
        "# t\n\n```python\nnot_run()\n```\n\n<!-- example -->\n```python\nprint(1)\n```\n"
        "<!-- example: slow -->\n```bash\necho hi\n```\n"
        "<!-- example: session=s file=a.toml -->\n```toml\nx = 1\n```\ntext\n"
        "<!-- example: session=s slow requires=json+no_such_module_here -->\n```bash\ncat a.toml\n```\n"
    )
    examples = extract_examples(md)
    assert [([(b.line, b.lang, b.code, b.file) for b in e.blocks], e.slow) for e in examples] == [
        ([(8, "python", "print(1)\n", None)], False),
        ([(12, "bash", "echo hi\n", None)], True),
        ([(16, "toml", "x = 1\n", "a.toml"), (21, "bash", "cat a.toml\n", None)], True),
    ]
    session = examples[2]
    assert session.requires == ("json", "no_such_module_here")
    assert [run_block(b, tmp_path, 60).stdout for b in session.blocks] == ["", "x = 1\n"]
    for bad, message in (
        ("<!-- example -->\n\n```python\nx\n```\n", "README.md:1: <!-- example --> must be followed"),
        ("<!-- example -->\n```toml\nx\n```\n", "README.md:1: only ```python and ```bash"),
        ("<!-- example: fast -->\n```bash\nx\n```\n", r"README.md:1: unknown example tags \['fast'\]"),
    ):
        md.write_text(bad)
        with pytest.raises(ValueError, match=message):
            extract_examples(md)


def test_a_failing_example_is_reported(tmp_path: Path):
    """The runner reports a failing example's exit status (so the harness cannot pass vacuously)."""
    assert run_block(Block(3, "python", "raise SystemExit(3)\n", None), tmp_path, 60).returncode == 3
    done = run_block(Block(3, "bash", "false\necho never\n", None), tmp_path, 60)
    assert done.returncode != 0 and "never" not in done.stdout


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link that is not a URL, outside code blocks."""
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
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            found.append((n, target))
    return found


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (lower case, punctuation dropped, spaces to
    hyphens, repeats numbered)."""
    anchors: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    """Every relative link points at an existing file, and an anchor into a Markdown file at a heading."""
    broken = []
    for n, target in relative_links(doc):
        file, _, anchor = target.partition("#")
        path = doc.parent / file if file else doc
        if not path.exists():
            broken.append(f"{doc.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in github_anchors(path):
            broken.append(f"{doc.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_github_anchors(tmp_path: Path):
    md = tmp_path / "a.md"
    md.write_text(
        "# gem-train\n## Training on your own data (Parquet)\n```\n# not a heading\n```\n## A, b\n## A, b\n"
    )
    assert github_anchors(md) == {"gem-train", "training-on-your-own-data-parquet", "a-b", "a-b-1"}


def test_a_timeout_ends_the_example_and_its_children(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_block(Block(1, "bash", f"sleep 60 & echo $! > {pid_file}; wait\n", None), tmp_path, 2)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
