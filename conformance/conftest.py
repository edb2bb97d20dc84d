"""The conformance suite runs under the extkv harness (extkv.testing.harness),
which stays inert until a suite asks for it; this is where this one does.
Installed, the suite is the package extkv_conformance and this file comes
with it, so `pytest --pyargs extkv_conformance` runs it the same way.

Every test here is certified: `extkv check` counts it under the invariants
it names with `@pytest.mark.invariant(n)` (extkv.testing.invariants), a
planted-defect test too. So a test that names none, or that carries
`harness` (a test of extkv's own tooling, counted under no invariant), is
refused at collection: its module's collection fails, naming it, and a run
with a collection error certifies nothing. The tooling's own tests live in
meta/, which `extkv check` does not run."""

import pytest

from extkv.testing import harness


def pytest_configure(config):
    harness.activate(config)


def refusal(item: pytest.Item) -> str | None:
    """Why the certificate cannot count `item`; None when it can."""
    if item.get_closest_marker("invariant") is None:
        return "names no invariant: mark what it proves with @pytest.mark.invariant(n)"
    if item.get_closest_marker("harness") is not None:
        return "carries `harness`, a test of extkv's own tooling: it belongs in meta/"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module (or class) of this suite that holds a test the certificate
    cannot count fails to collect. This conftest's hooks see only the
    collectors under its directory, so meta/ and tools/, collected in the
    same session by the README's test command, are left alone."""
    report = yield
    if not report.passed:
        return report
    refused = [(item.nodeid, why) for item in report.result if isinstance(item, pytest.Item) and (why := refusal(item))]
    if refused:
        report.outcome = "failed"
        report.result = []
        report.longrepr = "\n".join(
            [f"not certifiable: {', '.join(nodeid for nodeid, _ in refused)}"]
            + [f"{nodeid} {why}" for nodeid, why in refused]
            + ["every conformance test is counted by `extkv check`: the tooling's own tests go in meta/"]
        )
    return report
