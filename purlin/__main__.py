"""``python -m purlin``: the same as the ``purlin`` command."""

import sys

from purlin.cli import main

if __name__ == "__main__":
    sys.exit(main())
