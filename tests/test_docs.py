"""Docs stay true: every engine option is documented, and every code block in README.md and docs/*.md runs.

Each fenced block is run by its language: ``python`` is executed (in a
temporary directory, one namespace per block), ``bash`` runs under ``bash -e``
with ``loopline`` on the PATH, ``json`` / ``jsonc`` (``//`` comments) and
``yaml`` are parsed, ``text`` is prose (trees, formulas, log lines) and is not
run. An HTML comment right before a block changes how it runs:

* ``<!-- docs-test: skip REASON -->``: not run (real weights, a GPU, a network
  install, a long-running server); the reason is shown in the test report.
* ``<!-- docs-test: server -->``: run against a server of the bundled model on a
  free port (``127.0.0.1:8000`` and ``$URL`` in the block point at it); ``curl``
  fails on HTTP errors.
* ``<!-- docs-test: continue -->``: a python block that runs in the namespace of
  the file's previous python block.
* ``<!-- docs-test: slow REASON -->``: a long block (a CLI process that loads
  torch, a training run, a benchmark): its test carries the ``slow`` mark, so
  it runs under ``-m slow`` and not in the default run. It goes on a line of
  its own above the other markers (``server``, ``continue``) it combines with.
  A ``continue`` chain is slow as a whole: one slow block of the chain (its
  first python block and the ``continue`` blocks after it) makes every block
  of it slow, so no block runs without the namespace it continues.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from loopline.config import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "benchmarks" / "README.md"]
LANGUAGES = {"python", "bash", "json", "jsonc", "yaml", "text"}
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str | None = None
    reason: str = ""
    slow: str | None = None  # the reason of a `slow` marker (or of the chain's slow block); None: the default run
    marks: tuple[str, ...] = ()  # every marker above the block, in order

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        found = []  # the markers right above the block (blank lines between them allowed), top first
        for j in range(start - 1, -1, -1):
            if not lines[j].strip():
                continue
            mark = _MARK.match(lines[j])
            if not mark:
                break
            found.insert(0, (mark.group(1), mark.group(2)))
        slow = next((reason for name, reason in found if name == "slow"), None)
        other = [(name, reason) for name, reason in found if name != "slow"]
        out.append(Block(path, start + 1, m.group(1), "\n".join(body) + "\n", other[-1][0] if other else None,
                         other[-1][1] if other else "", slow, tuple(name for name, _ in found)))
        i += 1
    return out


def _slow_chains(blocks: list[Block]) -> list[Block]:
    """A ``continue`` chain (a block and the ``continue`` blocks right after it among the run blocks) is slow as a
    whole when any of its blocks is: under ``-m slow`` no block runs without the namespace it continues, and in the
    default run none continues a namespace that was not built."""
    chains: list[list[Block]] = []
    for b in blocks:
        if b.lang == "text":
            continue
        if b.mark == "continue" and chains and chains[-1][0].path == b.path:
            chains[-1].append(b)
        else:
            chains.append([b])
    for chain in chains:
        reason = next((b.slow for b in chain if b.slow is not None), None)
        if reason is not None:
            for b in chain:
                if b.slow is None:
                    b.slow = f"continues a slow block ({reason})"
    return blocks




BLOCKS = _slow_chains([b for p in DOC_FILES for b in _blocks(p)])


# --- static checks -----------------------------------------------------------------------------
def test_every_engine_option_is_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(EngineArgs) if f"`{f.name}`" not in text]
    assert not missing, f"document these EngineArgs fields in docs/configuration.md: {missing}"


def test_readme_has_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[dev]" && loopline generate' in readme
    assert "python -m pytest -q" in readme


def test_every_block_has_a_known_language_and_skips_say_why():
    bad = [f"{b.id} ({b.lang or 'no language'})" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"tag these blocks with one of {sorted(LANGUAGES)}: {bad}"
    assert [b.id for b in BLOCKS if b.mark == "skip" and not b.reason] == []
    assert [b.id for b in BLOCKS if b.mark not in (None, "skip", "server", "continue")] == []
    # at most one of skip / server / continue, `slow` (with its reason) first and never on a skipped block
    assert [b.id for b in BLOCKS if len([m for m in b.marks if m != "slow"]) > 1] == []
    assert [b.id for b in BLOCKS if "slow" in b.marks and (b.marks[0] != "slow" or b.marks.count("slow") > 1
                                                           or not b.slow or b.mark == "skip")] == []


def test_relative_links_point_at_files():
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not re.match(r"[a-z]+://", target) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# --- running the blocks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs_server():
    """A server of the bundled model, no API key (the `server` blocks)."""
    from loopline import AsyncLLM
    from loopline.entrypoints.openai.api_server import build_app
    from loopline.models.tiny import DEFAULT_CHECKPOINT_NAME

    from entrypoints.conftest import RunningServer

    llm = AsyncLLM(EngineArgs(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512, device="cpu",
                              kv_cache_memory_gb=1 / 16))
    srv = RunningServer(build_app(llm, DEFAULT_CHECKPOINT_NAME, shutdown_engine=False))
    yield srv
    srv.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    """A ``loopline`` command running this checkout (the installed script may point elsewhere)."""
    path = tmp_path_factory.mktemp("bin")
    shim = path / "loopline"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m loopline.entrypoints.cli "$@"\n')
    shim.chmod(0o755)
    return path


_namespaces: dict[Path, dict] = {}


def _run_python(block: Block, cwd: Path, url: str | None) -> None:
    code = block.code if url is None else block.code.replace("http://127.0.0.1:8000", url)
    ns = _namespaces[block.path] if block.mark == "continue" else {"__name__": "__main__"}  # guarded examples (spawn) run too
    _namespaces[block.path] = ns
    old = Path.cwd()
    os.chdir(cwd)
    try:
        exec(compile(code, str(block.id), "exec"), ns)
    finally:
        os.chdir(old)


def _run_bash(block: Block, cwd: Path, url: str | None, bin_dir: Path) -> None:
    code = block.code
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if url is not None:
        code = code.replace("http://127.0.0.1:8000", url)
        env["URL"] = url
        code = 'curl() { command curl --fail-with-body -sS "$@"; }\n' + code  # an HTTP error fails the block
    r = subprocess.run(["bash", "-e", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block.id} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


@pytest.fixture
def small_cpu_kv(monkeypatch, request):
    """Engines the blocks build in this process get a 64 MiB CPU KV pool instead of the 1 GiB default
    (the bundled model needs a few MiB), so the docs tests stay light on memory. Only python blocks build
    engines here, so only they pay for a collection (~0.4 s with torch loaded)."""
    # NOTE: the constant's home moves with the engine refactor; patch it wherever it lives.
    for module in ("loopline.core.engine", "loopline.worker.memory_profile"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, "_CPU_KV_GB"):
            monkeypatch.setattr(mod, "_CPU_KV_GB", 1 / 16)
    yield
    block = request.node.callspec.params["block"]
    if block.lang == "python" and block.mark != "skip":
        gc.collect()


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow is not None else [])
                                   for b in BLOCKS if b.lang != "text"])
def test_code_block_runs(block: Block, request, tmp_path, bin_dir, small_cpu_kv):
    if block.mark == "skip":
        pytest.skip(block.reason)
    if block.mark != "continue":
        _namespaces.pop(block.path, None)  # the previous chain's engines can go
    url = request.getfixturevalue("docs_server").base_url if block.mark == "server" else None
    if block.lang == "python":
        _run_python(block, tmp_path, url)
    elif block.lang == "bash":
        _run_bash(block, tmp_path, url, bin_dir)
    elif block.lang in ("json", "jsonc"):
        code = re.sub(r"\s//[^\n]*", "", block.code) if block.lang == "jsonc" else block.code
        json.loads(code)
    elif block.lang == "yaml":
        _check_yaml(block)


def _check_yaml(block: Block) -> None:
    """Parses the YAML; a first line ``# NAME: loopline CMD ...`` also checks its keys are CMD's flags."""
    import yaml

    from loopline.entrypoints.cli import build_parser, expand_config

    data = yaml.safe_load(block.code)
    assert isinstance(data, dict), f"{block.id}: a --config file is a mapping"
    first = block.code.splitlines()[0]
    m = re.match(r"#\s*(\S+\.ya?ml):\s*loopline (\w+)", first)
    if m:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"docs-{os.getpid()}-{m.group(1)}"
        path.write_text(block.code)
        try:
            build_parser().parse_args(expand_config([m.group(2), "--config", str(path)]))
        finally:
            path.unlink()


@pytest.fixture(scope="module", autouse=True)
def _drop_namespaces():
    yield
    _namespaces.clear()


def test_markers_are_used_sparingly():
    """Most blocks run: a docs change that skips everything fails here."""
    code = [b for b in BLOCKS if b.lang != "text"]
    skipped = [b for b in code if b.mark == "skip"]
    assert len(skipped) <= len(code) // 2, [b.id for b in skipped]
    assert all(textwrap.dedent(b.reason) for b in skipped)
    # slow blocks run under -m slow; still, most of the blocks that run do so in the default run
    slow = [b for b in code if b.mark != "skip" and b.slow is not None]
    assert len(slow) <= (len(code) - len(skipped)) // 2, [b.id for b in slow]
