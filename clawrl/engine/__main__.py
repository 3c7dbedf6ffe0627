"""`python -m clawrl.engine --model DIR ...` (what the test fixtures start)."""

import sys

from clawrl.engine.server import main

sys.exit(main(sys.argv[1:]))
