"""`python -m mirage` is the `mirage` command."""

import sys

from mirage.cli import main

sys.exit(main())
