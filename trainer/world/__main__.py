"""`python -m trainer.world {init,build} DIR ...`, the same as `clawrl tinyworld ...`."""

import sys

from trainer.world.cli import main

sys.exit(main(sys.argv[1:]))
