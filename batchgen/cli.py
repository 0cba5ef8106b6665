"""The command line, checked before Hydra sees it: a mistyped key or config name gets one line in the project's
voice (the closest valid key or names, and where the list is) instead of Hydra's advice to add `+` or its
multi-line block. Both entry points (`batchgen.experiment`, `batchgen.run`) wrap their Hydra main with
`checked_main`; `command_line_problem` is the check itself, a pure function of the overrides.

Only what Hydra would reject is checked here. A key added with `+` composes, and `check_known_keys`
(batchgen.overrides) rejects it afterwards with the same line; Hydra's own settings (hydra.*, hydra/...) and
flags (--cfg, --help, ...) are left to Hydra.
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

from batchgen.confdir import conf_dir
from batchgen.overrides import COMMANDS, DATA_DIRS, section_problem, top_level_problem

ABSENT = object()
# hydra/launcher=NAME -> (the plugin's module, how to install it): a missing plugin is one line, not Hydra's block
SUBMITIT = ("hydra_plugins.hydra_submitit_launcher", 'pip install "batchgen[slurm]" (hydra-submitit-launcher)')
LAUNCHERS = {"joblib": ("hydra_plugins.hydra_joblib_launcher", "pip install hydra-joblib-launcher (a dependency of "
                        "batchgen: reinstall batchgen)"),
             "slurm": SUBMITIT, "submitit_slurm": SUBMITIT, "submitit_local": SUBMITIT}


def checked_main(command: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Wrap a `@hydra.main` function: exit 2 with one `error:` line when the command line has a problem."""
    def wrap(hydra_main: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(hydra_main)
        def main() -> None:
            problem = command_line_problem(sys.argv[1:], command)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                sys.exit(2)
            if not sets_hydra_mode(sys.argv[1:]):
                _skip_mode_probe()
            hydra_main()
        return main
    return wrap


# a command line that could set `hydra.mode`: another config or search path, or Hydra's own settings
_MODE_ARGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "hydra.mode", "hydra/")


def sets_hydra_mode(argv: list[str]) -> bool:
    """Whether `hydra.mode` may be set by this command line (batchgen's own config files never set it:
    tests/test_cli.py composes every one)."""
    return any(arg.startswith(_MODE_ARGS[:6]) or any(k in arg for k in _MODE_ARGS[6:]) for arg in argv)


def _skip_mode_probe() -> None:
    """Hydra composes the whole config once only to read `hydra.mode` (its `get_mode`), then again to run; where
    nothing sets it the answer is None (Hydra then takes --multirun or a single run, as the flags say), known
    without composing."""
    from hydra._internal.hydra import Hydra

    global HYDRA_GET_MODE
    if HYDRA_GET_MODE is None:
        HYDRA_GET_MODE = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None


HYDRA_GET_MODE = None  # Hydra's own probe, kept where `_skip_mode_probe` replaced it (its test calls it)


def exit_at_once() -> None:
    """End a command that finished one run: logging closed and the output flushed, then out without the
    interpreter's teardown, which frees a large run's objects one by one (a fifth of a second for 20K sequences)
    only to return the memory to the system anyway. A sweep, or anything else still running beside the main
    thread (a launcher's worker pool, child processes, threads that are not daemons), takes the usual exit, whose
    handlers shut them down. Only after a normal return: errors and sys.exit take the usual path."""
    import logging
    import multiprocessing
    import os
    import threading

    if any(arg in ("-m", "--multirun") for arg in sys.argv[1:]) or multiprocessing.active_children() or any(
            t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def command_line_problem(argv: list[str], command: str) -> str | None:
    """One line naming the first override of `argv` that Hydra would reject and its fix, or None."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_args(argv)
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except (Exception, SystemExit):  # noqa: BLE001 - a malformed command line: Hydra says what is wrong
        return None
    if args.help or args.hydra_help or args.shell_completion or args.config_name or args.config_dir \
            or args.config_path:
        return None  # another config, or no job: Hydra's business
    config = COMMANDS[command]
    defaults = _default_groups(config)
    keys = []
    for o in overrides:
        name = o.key_or_group
        if name == "hydra/launcher":
            problem = _launcher_problem(o)
            if problem:
                return problem
        if name.startswith("hydra") or o.package is not None:
            continue
        if "." not in name and (conf_dir() / name).is_dir():
            problem = _group_problem(o, name, defaults, command)
            if problem:
                return problem
        elif not o.is_delete():
            keys.append(o)
    if not keys:
        return None
    groups = [o for o in overrides if "." not in o.key_or_group and (conf_dir() / o.key_or_group).is_dir()
              and o.key_or_group not in DATA_DIRS and not o.is_delete()]
    if _plainly_set(config, keys, groups):
        return None
    cfg = _composed(config, [_first_choice(o) for o in groups])
    if cfg is None:
        return None
    deleted = {o.key_or_group for o in overrides if o.is_delete()}
    for o in keys:
        if o.is_add() and o.key_or_group in deleted:
            continue  # ~key then +key: Hydra's way to replace a whole section's value
        problem = _key_problem(o, cfg, command)
        if problem:
            return problem
    return None


def _launcher_problem(o) -> str | None:
    """A sweep launcher whose Hydra plugin is not installed: the one line that says how to install it."""
    import importlib.util

    name = str(o.value()) if not o.is_sweep_override() else ""
    if name not in LAUNCHERS:
        return None
    module, install = LAUNCHERS[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package (hydra_plugins) is missing
        found = False
    return None if found else f"hydra/launcher={name} needs a Hydra plugin that is not installed: {install}"


def _default_groups(config: str) -> set[str]:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{config}.yaml"), resolve=False)
    return {str(k).split("@")[0] for entry in node.get("defaults", []) if isinstance(entry, Mapping) for k in entry}


def _choices(o) -> list[str] | None:
    """The config names an override picks (each value of a sweep); None when not plain names (glob, null)."""
    try:
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
    except Exception:  # noqa: BLE001 - glob() needs Hydra's config loader: Hydra expands and checks it
        return None
    return [str(v) for v in values] if all(isinstance(v, (str, int, float)) for v in values) else None


def _first_choice(o) -> str:
    names = _choices(o)
    plus = "+" if o.is_add() else "++" if o.is_force_add() else ""
    return f"{plus}{o.key_or_group}={names[0]}" if names else o.input_line


def _group_problem(o, group: str, defaults: set[str], command: str) -> str | None:
    """A config group picked with or without + as the command's defaults need, naming files that exist."""
    if group in DATA_DIRS:
        return top_level_problem(group, _first_choice(o).split("=", 1)[1], {}, command)
    if o.is_delete():
        return None
    names = _choices(o)
    shown = names[0] if names else "..."
    if o.is_add() and group in defaults:
        return f"{group} is chosen by default in python -m {command}: drop the + ({group}={shown})"
    if not (o.is_add() or o.is_force_add()) and group not in defaults:
        return f"{group} is not chosen by default in python -m {command}: add it with a + (+{group}={shown})"
    folder = conf_dir() / group
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    for name in names or []:
        if name not in options:
            close = difflib.get_close_matches(name, options, n=3, cutoff=0.5)
            hint = f" did you mean {' or '.join(close)}?" if close else ""
            return f"no {group} named {name};{hint} the {group} names are the files of {folder}: {', '.join(options)}"
    return None


def _plainly_set(config: str, keys: list, groups: list) -> bool:
    """Every key (set without +) is in the files the command composes, read as they are: the usual command
    line, passed without composing the config a second time (Hydra composes it once more to run). Any file that
    composes others or moves its package, or a key not found, leaves the answer to `_composed`."""
    from omegaconf import OmegaConf

    if any(o.is_add() or o.is_force_add() for o in keys):
        return False
    primary = OmegaConf.load(conf_dir() / f"{config}.yaml")
    chosen = {str(k): str(v) for entry in primary.get("defaults", []) if isinstance(entry, Mapping)
              for k, v in entry.items() if " " not in str(k) and "/" not in str(k)}
    for o in groups:
        names = _choices(o)
        if not names:
            return False
        chosen[o.key_or_group] = names[0]
    files: dict[str, Any] = {}
    for o in keys:
        section, _, rest = o.key_or_group.partition(".")
        if rest and section in chosen:
            path = conf_dir() / section / f"{chosen[section]}.yaml"
            if section not in files:
                text = path.read_text() if path.is_file() else ""
                files[section] = None if not text or "@package" in text else OmegaConf.create(text)
            node = files[section]
            if node is None or "defaults" in node:
                return False
            found = OmegaConf.select(node, rest, default=ABSENT) is not ABSENT
        else:
            found = False
        if not found and OmegaConf.select(primary, o.key_or_group, default=ABSENT) is ABSENT:
            return False
    return True


def _composed(config: str, overrides: list[str]):
    """The command's config with the groups chosen on the command line, without the keys; None if that fails
    (Hydra then reports why)."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose(config_name=config, overrides=overrides)
    except Exception:  # noqa: BLE001 - Hydra's own error comes when it composes again
        return None


def _key_problem(o, cfg, command: str) -> str | None:
    """A key set without + must exist; one added with + must not (Hydra rejects both otherwise)."""
    from omegaconf import OmegaConf

    key = o.key_or_group
    exists = OmegaConf.select(cfg, key, default=ABSENT) is not ABSENT
    if o.is_add() and exists:
        return f"{key} is already a key: drop the + ({o.input_line.lstrip('+')})"
    if o.is_add() or o.is_force_add() or exists:
        return None
    plain = OmegaConf.to_container(cfg, resolve=False)
    parts = key.split(".")
    if len(parts) == 1:
        return top_level_problem(key, None, plain, command)
    section, sub = parts[0], parts[1]
    node = plain.get(section, ABSENT)
    if node is ABSENT and section == "policy":
        return (f"no policy chosen, so {key} is not a key: choose one with +policy=NAME "
                f"(a file of {conf_dir() / 'policy'})")
    if not isinstance(node, Mapping):
        return top_level_problem(section, node, plain, command) if node is ABSENT else \
            f"{section} is not a section (it is {node!r}): {key} is not a key"
    if len(parts) == 2 and sub not in node:
        return _section_line(section, sub, node, plain, command)
    return f"unknown key {key}: {'.'.join(parts[:2])} has no key {parts[2] if len(parts) > 2 else sub}"


def _section_line(section: str, sub: str, node: Mapping[str, Any], cfg: Mapping[str, Any], command: str) -> str:
    """The line check_known_keys writes for `+section.sub` (the same fix, either way it was typed); a key the
    command reads but this config does not set is added with +."""
    from batchgen.overrides import valid_section_keys

    valid = valid_section_keys(section, cfg, command)
    if valid is not None and sub in valid:
        return f"{section}.{sub} is not set by this config: add it with a + (+{section}.{sub}=...)"
    if valid is None:  # the policy's knobs: those of the chosen policy's file
        close = difflib.get_close_matches(sub, list(node), n=1, cutoff=0.6)
        hint = f" did you mean {section}.{close[0]}?" if close else ""
        name = f" ({section}={node['name']})" if "name" in node else ""
        return f"unknown key {section}.{sub};{hint} valid {section} keys{name}: {', '.join(node)}"
    return section_problem(section, sub, cfg, command)

