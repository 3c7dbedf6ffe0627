"""`python -m clawrl.cli COMMAND …`: the `clawrl` console script, without the script."""

import sys

from clawrl.cli.main import main

sys.exit(main())
