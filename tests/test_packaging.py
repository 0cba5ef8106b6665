"""The wheel ships the Hydra configs and the bundled data, and batchgen finds them after a plain install.

One module-scoped fixture builds a wheel from a copy of the source tree (so that concurrent runs never share
a build/ folder and the checkout stays clean), installs it with ``--no-deps`` into a fresh venv that sees the
system site-packages (torch, hydra... are not reinstalled) and runs it from a directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONF_GROUPS = ("model", "cluster", "workload", "policy")
YAML_SUFFIXES = (".yaml", ".yml")
# No "dist" or "build" here: ignore_patterns matches at any depth, and batchgen/dist is a package (only
# batchgen/ and conf/ are copied, so the build outputs at the top level never are).
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".*")


def _run(cmd: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _source_files(root: Path, suffixes: tuple[str, ...] | None = None) -> set[str]:
    """Files under root, relative to it, without caches; only those ending in suffixes if given."""
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        and (suffixes is None or p.suffix in suffixes)
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE", "setup.py", "setup.cfg"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    for name in ("batchgen", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=JUNK)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)], tmp)
    (whl,) = (tmp / "dist").glob("batchgen-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory) -> dict:
    """Install the wheel into a fresh venv; return what batchgen reports there, run from outside the checkout."""
    tmp = tmp_path_factory.mktemp("venv")
    # --without-pip: faster, and works where ensurepip is absent; the system pip is visible through
    # --system-site-packages and installs into the venv (its sys.prefix). --ignore-installed keeps pip from
    # looking at (and trying to replace) a batchgen installed in the system site, e.g. an editable one.
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp / "venv")], tmp)
    python = tmp / "venv" / "bin" / "python"
    if sys.prefix != sys.base_prefix:  # pytest itself runs in a venv: --system-site-packages would skip it
        purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp)
        outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        (Path(purelib.stdout.strip()) / "_outer_env.pth").write_text("\n".join(sorted(outer)) + "\n")
    pip = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--quiet"]
    _run(pip + [str(wheel)], tmp)
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import json, sysconfig, batchgen, batchgen.confdir as c; print(json.dumps({'file': batchgen.__file__,"
        " 'conf': str(c.conf_dir()), 'data': str(c.data_dir()), 'purelib': sysconfig.get_paths()['purelib']}))"
    )
    info = json.loads(_run([str(python), "-c", probe], elsewhere).stdout.strip().splitlines()[-1])
    return {**{k: Path(v).resolve() for k, v in info.items()}, "python": python, "cwd": elsewhere}


def test_conf_dir_in_clone_is_the_checkout_conf():
    import batchgen
    from batchgen.confdir import conf_dir, data_dir

    assert Path(batchgen.__file__).resolve().parent == REPO / "batchgen", "tests must import the checkout's batchgen"
    assert conf_dir() == REPO / "conf"
    assert (conf_dir() / "config.yaml").is_file()
    assert data_dir() == REPO / "batchgen" / "data"


def test_wheel_ships_every_module_config_and_data_file(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing_py = sorted(f"batchgen/{f}" for f in _source_files(REPO / "batchgen", (".py",)) if f"batchgen/{f}" not in names)
    missing_pkgs = sorted({str(Path(f).parent).replace("/", ".") for f in missing_py})
    assert not missing_py, (
        f"add {missing_pkgs} to [tool.setuptools] packages in pyproject.toml; the wheel lacks {missing_py}"
    )
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    empty = [p for p in listed if p != "batchgen.conf" and not list((REPO / p.replace(".", "/")).glob("*.py"))]
    assert not empty, f"{empty} hold no .py file (a clean clone lacks them): drop them from pyproject.toml"
    yaml = _source_files(REPO / "conf", YAML_SUFFIXES)
    assert "config.yaml" in yaml
    assert not sorted(f for f in yaml if f"batchgen/conf/{f}" not in names), "conf/ YAML missing from the wheel"
    data = _source_files(REPO / "batchgen" / "data")
    assert not sorted(f for f in data if f"batchgen/data/{f}" not in names), "batchgen/data files missing"
    assert "batchgen/data/traces/azure_conv_2023.csv" in names
    assert not [n for n in names if n.startswith("conf/")], "conf/ must ship as batchgen/conf, not top-level"


def test_installed_batchgen_is_the_wheel_not_the_checkout(venv: dict):
    assert venv["file"].is_relative_to(venv["purelib"]), f"{venv['file']} shadows the wheel in {venv['purelib']}"
    assert venv["conf"] == venv["purelib"] / "batchgen" / "conf"
    assert (venv["conf"] / "config.yaml").is_file()
    assert venv["data"] == venv["purelib"] / "batchgen" / "data"
    assert (venv["data"] / "traces" / "azure_conv_2023.csv").is_file()


@pytest.mark.parametrize("group", CONF_GROUPS)
def test_installed_conf_has_config_group(venv: dict, group: str):
    source = _source_files(REPO / "conf" / group, YAML_SUFFIXES) if (REPO / "conf" / group).is_dir() else set()
    if not source:
        pytest.skip(f"conf/{group}/ holds no YAML yet in the checkout, so there is nothing to ship")
    assert _source_files(venv["conf"] / group, YAML_SUFFIXES) == source


def test_installed_experiment_runs_a_job_from_elsewhere(venv: dict):
    """The installed wheel, run from a directory that is not the checkout, finds its configs and the shipped
    trace, simulates, and writes its results where Hydra says."""
    run_dir = Path(venv["cwd"]) / "run"
    _run([str(venv["python"]), "-m", "batchgen.experiment", "+policy=coroutine", "workload=azure_conv",
          "workload.num_sequences=100", "output.plot=false", f"hydra.run.dir={run_dir}"], venv["cwd"])
    import json
    results = json.loads((run_dir / "results.json").read_text())
    assert results["policy"] == "coroutine" and results["num_sequences"] == 100 and results["bct_s"] > 0


def test_installed_experiment_prints_its_config(venv: dict):
    import yaml  # a dependency of hydra-core / omegaconf

    proc = _run([str(venv["python"]), "-m", "batchgen.experiment", "--cfg", "job"], venv["cwd"])
    printed = yaml.safe_load(proc.stdout)
    assert isinstance(printed, dict) and printed, f"no config printed:\n{proc.stdout}\n{proc.stderr}"
    top = yaml.safe_load((REPO / "conf" / "config.yaml").read_text()) or {}
    expected = {k for k in top if k not in ("defaults", "hydra")}
    assert expected <= printed.keys(), f"config.yaml keys {sorted(expected - printed.keys())} not printed"
