"""``python -m flashdora.cli``: the command line (``flashdora.tools.cli``; the ``flashdora`` script calls it too)."""

import sys

from flashdora.tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
