"""``python -m spectr_audit.cli``: the CLI."""

import sys

from spectr_audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
