"""The checkout's pytest wiring: the extkv harness is a plugin module of the
package (extkv.testing.harness), so an installed extkv runs the same suite
with `-p extkv.testing.harness`."""

pytest_plugins = ["extkv.testing.harness"]
