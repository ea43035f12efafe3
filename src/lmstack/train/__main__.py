"""``python -m lmstack.train`` / ``torchrun -m lmstack.train``: the same as ``lmstack train``."""

import sys

from lmstack.train.cli import main

sys.exit(main())
