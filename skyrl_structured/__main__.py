"""``python -m skyrl_structured``: the ``skyrl-structured`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
