"""The extkv harness, as a pytest plugin: the module pytest loads.

Theory of operation
-------------------
pytest imports this module in every project of an environment where extkv
is installed (the `pytest11` entry point `extkv`), so here it costs nothing
and claims no name a project could use: it imports nothing of extkv or
torch, and registers options only, each named `--extkv...`. The harness
itself, its fixtures (`device`, `driver`, `build`, ...), markers (`gpu`,
`stress`, `invariant(n)`, ...) and hooks, is extkv.testing.harness_hooks,
which `activate(config)` imports and registers, once per process: extkv's
suites call it from their conftest (conformance/, meta/, stress/, the
benchmarks), and so does any harness option on the command line or naming
the plugin with `-p extkv` or `-p extkv.testing.harness`.

Names: the entry point is `extkv`, the name pytest shows and `-p no:extkv`
takes. The module's own name, which a checkout's conftest puts in
`pytest_plugins` and `-p` also takes, is a second entry point that
registers `MODULE_NAME_HOLDER`, which has no hooks: naming the module then
finds it loaded instead of registering it again under another name (which
pluggy refuses), and `-p no:extkv.testing.harness` blocks that name. Either
block disables the harness: nothing activates it, and a conftest that
activates it gets a usage error naming the flag.
"""

from __future__ import annotations

import sys

import pytest

#: `--extkv-device`: which tests a run keeps, by where they run.
DEVICE_CHOICES = ("all", "host", "gpu", "multi-gpu")
#: Options whose presence on the command line activates the harness.
ACTIVATING_OPTIONS = (
    "--extkv", "--extkv-stress", "--extkv-report-dir", "--extkv-progress", "--extkv-device", "--extkv-lock-dir",
)
#: The names the plugin goes by: its entry point, and its module's.
PLUGIN_NAMES = ("extkv", __name__)
#: Names of extkv.testing.harness_hooks that the suites read from here.
_FROM_HOOKS = ("DEVICE_PROPERTY", "INVARIANTS")
_ACTIVE = pytest.StashKey[bool]()


class _ModuleNameHolder:
    """Holds the plugin name `extkv.testing.harness` where the entry point
    `extkv` loaded the module (see the theory above); it has no hooks."""


MODULE_NAME_HOLDER = _ModuleNameHolder()


def pytest_addoption(parser):
    group = parser.getgroup("extkv", "extkv harness")
    group.addoption("--extkv", action="store_true", help="activate the extkv harness for this run")
    group.addoption("--extkv-stress", action="store_true", help="run tests marked stress (long, nightly)")
    group.addoption(
        "--extkv-report-dir",
        metavar="DIR",
        default=None,
        help="write DIR/<step>.json: every test's outcome, invariants and device, and the machine facts",
    )
    group.addoption(
        "--extkv-report-step",
        metavar="NAME",
        default="check",
        help="name of this run's results file in the report directory (default %(default)s: check.json)",
    )
    group.addoption(
        "--extkv-progress", metavar="FILE", default=None, help="keep FILE at `done total failed` as tests finish"
    )
    group.addoption(
        "--extkv-device",
        choices=DEVICE_CHOICES,
        default="all",
        help="keep only the tests that run on the host driver, on one GPU, or on several GPUs (default all)",
    )
    group.addoption(
        "--extkv-lock-dir",
        metavar="DIR",
        default=None,
        help="lock files in DIR keep each exclusive test alone on its device, also across pytest runs",
    )


def _blocked_name(config) -> str | None:
    """The plugin name a `-p no:NAME` blocked, or None."""
    return next((name for name in PLUGIN_NAMES if config.pluginmanager.is_blocked(name)), None)


def _asked_on_command_line(config) -> bool:
    arguments = [str(argument) for argument in config.invocation_params.args]
    named = {f"-p{name}" for name in PLUGIN_NAMES}
    return any(
        argument.split("=")[0] in ACTIVATING_OPTIONS
        or argument in named
        or (before == "-p" and argument in PLUGIN_NAMES)
        for before, argument in zip([""] + arguments, arguments)
    )


def pytest_configure(config):
    if _blocked_name(config) is None and _asked_on_command_line(config):
        activate(config)


def is_active(config) -> bool:
    return config.stash.get(_ACTIVE, False)


def activate(config) -> None:
    """Switch the harness on for this run (idempotent): register its hooks
    and fixtures (extkv.testing.harness_hooks), pin this xdist worker's GPU,
    one torch thread, the Hypothesis profile, the run record. A usage error
    where the plugin is disabled or was never loaded (its options missing)."""
    if is_active(config):
        return
    blocked = _blocked_name(config)
    if blocked is not None:
        raise pytest.UsageError(
            f"-p no:{blocked} disabled the extkv harness, which these tests need (their conftest activates it): "
            f"drop -p no:{blocked}"
        )
    if not config.pluginmanager.is_registered(sys.modules[__name__]):
        raise pytest.UsageError(
            "the extkv harness plugin is not loaded (extkv is not installed here): run pytest with -p extkv.testing.harness"
        )
    from . import harness_hooks, second_run

    config.stash[_ACTIVE] = True
    config.pluginmanager.register(harness_hooks, "extkv-harness")
    config.pluginmanager.register(second_run, "extkv-second-run")
    harness_hooks.start(config)


def __getattr__(name: str):
    if name in _FROM_HOOKS:
        from . import harness_hooks

        return getattr(harness_hooks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
