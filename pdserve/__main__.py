"""`python -m pdserve ...`: the same command line as the `pdserve` script (pdserve/cli.py)."""

import sys

from pdserve.cli import main

sys.exit(main())
