"""`python -m lmstack ...` (and `torchrun ... -m lmstack train ...`) runs the `lmstack` command."""

import sys

from lmstack.cli import main

sys.exit(main())
