"""Where the Hydra configs and the bundled data live, in a clone and after a regular install.

In a clone (running from the source tree, or an editable install) the configs are the checkout's
top-level ``conf/``; a wheel ships the same files as ``batchgen/conf`` (see pyproject.toml).
Both return absolute paths, as ``hydra.main(config_path=...)`` and ``initialize_config_dir`` need.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """The Hydra config directory: the checkout's ``conf/`` if there is one, else ``batchgen/conf``."""
    clone, installed = _PACKAGE.parent / "conf", _PACKAGE / "conf"
    # pyproject.toml next to conf/ tells a checkout from a site-packages holding someone else's conf/.
    if (clone / "config.yaml").is_file() and (_PACKAGE.parent / "pyproject.toml").is_file():
        return clone
    if (installed / "config.yaml").is_file():
        return installed
    raise FileNotFoundError(
        f"batchgen: no Hydra config directory with a config.yaml: looked in {clone} (a checkout) and "
        f"{installed} (an installed wheel). Run from a clone that has conf/, or reinstall batchgen."
    )


def data_dir() -> Path:
    """The bundled data directory ``batchgen/data`` (traces and their LICENSE/README)."""
    path = _PACKAGE / "data"
    if not path.is_dir():
        raise FileNotFoundError(f"batchgen: bundled data directory {path} is missing")
    return path
