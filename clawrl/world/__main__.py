"""`python -m clawrl.world {init,build} DIR ...`, the same as `clawrl tinyworld ...`."""

import sys

from clawrl.world.cli import main

sys.exit(main(sys.argv[1:]))
