"""`extkv stress`: not built yet."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `extkv stress`; other arguments go to pytest."""


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    raise SystemExit("extkv stress: not built yet")
