"""The documentation is checked like code: README.md and docs/*.md.

- every repository path they name exists (`batchgen/...`, `conf/...`, `tests/...`, links between pages), and every
  `python -m MODULE` they show is a module;
- every documented `python -m batchgen.experiment` / `python -m batchgen.run` command composes with Hydra and
  passes the commands' own key check (`batchgen.overrides.check_known_keys`) and the policy's knob check, so a
  renamed key or config file breaks this test, not a reader's first try;
- every shell block runs (slow): the blocks of one page in order, in one fresh directory holding links to the
  repository's folders, with `python` the interpreter running the tests. A block that writes anything but
  `outputs/` or `multirun/` into that directory fails: examples write under `outputs/`.

A block is exempted by an HTML comment on the line before it: `<!-- docs-check: skip (why) -->` (it needs CUDA, a
cluster or minutes; its keys are still checked), or, for a code listing, `<!-- docs-check: same-as PATH -->`: the
block must equal that file (which a shell block of the page then runs).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# what a page may name as a repository path: these top-level folders and files
TOP = ("batchgen", "conf", "tests", "benchmarks", "experiments", "docs", ".ci")
TOP_FILES = ("README.md", "pyproject.toml", "mkdocs.yml")
PATH_RE = re.compile(r"(?<![\w./<-])((?:%s)/[\w./-]*)" % "|".join(re.escape(t) for t in TOP))
LINK_RE = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
MODULE_RE = re.compile(r"python3? -m ([\w.]+)")
DIRECTIVE_RE = re.compile(r"<!--\s*docs-check:\s*(skip|same-as)\b\s*(.*?)\s*-->")
FENCE_RE = re.compile(r"^```(\w*)\s*$")
COMMANDS = {"batchgen.experiment": "config", "batchgen.run": "run"}  # Hydra apps: command -> config name
WRITABLE = {"outputs", "multirun"}  # what a documented command may create in its working directory


@dataclass
class Block:
    page: Path
    line: int        # of the opening fence, 1-based
    lang: str
    text: str
    directive: str   # "", "skip" or "same-as"
    argument: str    # the skip's reason, or the same-as path

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, each with the docs-check directive on the line before it (if any)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        d = DIRECTIVE_RE.search(prev)
        found.append(Block(page, start + 1, m.group(1), "\n".join(body) + "\n",
                           d.group(1) if d else "", d.group(2) if d else ""))
    return found


def shell_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("bash", "sh", "shell", "console")]


def commands(block: Block) -> list[list[str]]:
    """The command lines of a shell block (continuations joined, heredoc bodies and comments dropped), each split
    at `&&` into words."""
    text = block.text.replace("\\\n", " ")
    out, heredoc = [], None
    for line in text.splitlines():
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?\s*'?(\w+)'?", line)
        if m:
            heredoc = m.group(1)
        words = shlex.split(line, comments=True)
        for is_sep, group in itertools.groupby(words, key=lambda w: w in ("&&", ";", "||")):
            if not is_sep:
                out.append(list(group))
    return out


def hydra_command(words: list[str]) -> tuple[str, list[str]] | None:
    """(command, overrides) of a `python -m batchgen.experiment|run ...` (or torchrun ... -m ...) line, else None."""
    for i, w in enumerate(words[:-1]):
        if w == "-m" and words[i + 1] in COMMANDS:
            return words[i + 1], [a for a in words[i + 2:] if a not in ("-m", "--multirun")]
    return None


def expanded(overrides: list[str]) -> list[list[str]]:
    """One override list per point of a sweep (`key=a,b`), by Hydra's own parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for o, text in zip(parsed, overrides):
        if o.is_sweep_override():
            key = text.split("=", 1)[0]
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(point) for point in itertools.product(*choices)]


# -- (a) paths and modules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    text = page.read_text()
    missing = []
    for m in PATH_RE.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if not (ROOT / path).exists():
            missing.append(path)
    for m in LINK_RE.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        if not (page.parent / target).exists():
            missing.append(f"link {target}")
    for name in re.findall(r"`(%s)`" % "|".join(map(re.escape, TOP_FILES)), text):
        if not (ROOT / name).exists():
            missing.append(name)
    assert not missing, f"{page.name} names what the repository lacks: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_modules_exist(page):
    missing = sorted({name for name in MODULE_RE.findall(page.read_text())
                      if name.split(".")[0] == "batchgen" and find_spec(name) is None})
    assert not missing, f"{page.name} shows `python -m` of modules that do not exist: {missing}"


def test_listings_equal_their_files():
    listings = [b for page in PAGES for b in blocks(page) if b.directive == "same-as"]
    assert listings, "docs/extending.md shows docs/examples/fill_first.py"
    for b in listings:
        assert b.text == (ROOT / b.argument).read_text(), f"{b.where}: the listing differs from {b.argument}"


def test_directives_are_known():
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "docs-check" in line:
                assert DIRECTIVE_RE.search(line), f"{page.name}:{n}: unknown docs-check directive {line.strip()!r}"


# -- (b) config keys and names ----------------------------------------------------------------------------------

def documented_hydra_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        for b in shell_blocks(page):
            for words in commands(b):
                cmd = hydra_command(words)
                if cmd:
                    found.append((b.where, *cmd))
    return found


def test_documented_commands_are_found():
    names = {cmd for _, cmd, _ in documented_hydra_commands()}
    assert names == set(COMMANDS), names


@pytest.mark.parametrize("where,command,overrides",
                         [pytest.param(*c, id=f"{c[0]} {c[1]}") for c in documented_hydra_commands()])
def test_documented_config_keys_exist(where, command, overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from batchgen.confdir import conf_dir
    from batchgen.overrides import check_known_keys
    from batchgen.policy import make_policy

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for point in expanded(overrides):
            cfg = compose(COMMANDS[command], point)  # an unknown key, group or file name fails here ...
            check_known_keys(cfg, command)           # ... or here (a `+key` the command does not read)
            resolved = OmegaConf.to_container(cfg, resolve=True)
            if resolved.get("policy") is not None:
                make_policy(resolved["policy"])      # the policy's knobs and their types


# -- (c) every shell block runs ---------------------------------------------------------------------------------

def workdir(tmp: Path) -> Path:
    """A directory standing for the repository root: links to its folders and files, nothing else; `python` on
    PATH is this interpreter."""
    tmp.mkdir()
    for name in (*TOP, *TOP_FILES):
        if (ROOT / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.directive != "skip" for b in shell_blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_run(page, tmp_path):
    work = workdir(tmp_path / "repo")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                                 os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               BATCHGEN_PROGRESS="0", PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)
    ran = 0
    for b in shell_blocks(page):
        if b.directive == "skip":
            continue
        started = time.perf_counter()
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", b.text], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, (f"{b.where} failed ({done.returncode}) after "
                                      f"{time.perf_counter() - started:.1f} s:\n{b.text}\n"
                                      f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
        ran += 1
        stray = sorted(p.name for p in work.iterdir() if not p.is_symlink() and p.name not in WRITABLE)
        assert not stray, f"{b.where} wrote {stray} into the repository root: examples write under outputs/"
    assert ran


# -- the checker itself -----------------------------------------------------------------------------------------

def test_the_checker_reads_commands_as_a_shell_does():
    block = Block(ROOT / "README.md", 1, "bash", "python -m batchgen.batch.demo outputs/m && cat > outputs/r <<'J'\n"
                  "{\"a\": 1}\nJ\npython -m batchgen.experiment -m +policy=a,b \\\n    model=tiny_moe  # note\n", "", "")
    found = [hydra_command(words) for words in commands(block)]
    assert [f for f in found if f] == [("batchgen.experiment", ["+policy=a,b", "model=tiny_moe"])]
    assert expanded(["+policy=a,b", "seed=1"]) == [["+policy=a", "seed=1"], ["+policy=b", "seed=1"]]


@pytest.mark.parametrize("overrides", [["+policy=coroutine", "workload.num_sequence=3"],
                                       ["+policy=coroutine", "+workload.num_sequence=3"],
                                       ["+policy=coroutine", "model=no_such_model"],
                                       ["+policy=coroutine", "policy.b_moee=64"]])
def test_the_checker_refuses_a_bad_key(overrides):
    with pytest.raises(Exception):
        test_documented_config_keys_exist("here", "batchgen.experiment", overrides)
