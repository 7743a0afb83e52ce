"""`python -m host.cli ...` runs `pie-run`."""

import sys

from host.cli.run import main

sys.exit(main())
