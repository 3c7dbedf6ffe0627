"""`python -m trainer.engine --model DIR ...` (what the test fixtures start)."""

import sys

from trainer.engine.server import main

sys.exit(main(sys.argv[1:]))
