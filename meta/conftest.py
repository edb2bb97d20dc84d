"""The project's own tests of its tooling: the benchmarks, reports, run
directories, the check runner and the CLI. They prove no invariant of the
cache, so `extkv check` does not run them and the certificate does not
count them; the README's test command runs them beside conformance/. They
use the extkv harness's fixtures, so this suite asks for it."""

from extkv.testing import harness


def pytest_configure(config):
    harness.activate(config)
