"""``python -m spectr_audit`` (and ``torchrun --nproc-per-node N -m spectr_audit run ...``): the CLI."""

import sys

from spectr_audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
