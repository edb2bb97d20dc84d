"""`python -m extkv ...`: the `extkv` command (extkv.cli), also where its
console script is not installed."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
