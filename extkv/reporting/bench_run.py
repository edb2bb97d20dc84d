"""`extkv bench`: not built yet."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `extkv bench`; other arguments go to pytest."""


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    raise SystemExit("extkv bench: not built yet")
