"""`python -m extkv.peer --peer SOCKET_PATH`: the receiving side of
`SegmentExportConnector`, as a process of its own (see extkv.connector).

A module apart from extkv.connector because the package imports that one, and
runpy warns when the module it runs was already imported."""

import sys

from .connector import main

if __name__ == "__main__":
    sys.exit(main())
