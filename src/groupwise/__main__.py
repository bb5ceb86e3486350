"""``python -m groupwise`` (also what ``torchrun -m groupwise train ...`` runs)."""

import sys

from groupwise.cli import main

sys.exit(main())
