"""The conformance suite runs under the extkv harness (extkv.testing.harness),
which stays inert until a suite asks for it; this is where this one does.
Installed, the suite is the package extkv_conformance and this file comes
with it, so `pytest --pyargs extkv_conformance` runs it the same way."""

from extkv.testing import harness


def pytest_configure(config):
    harness.activate(config)
