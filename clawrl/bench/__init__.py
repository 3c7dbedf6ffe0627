"""Benchmarks (`clawrl bench NAME`) and the stand-in engine they and the tests run
(fake_engine.py). Outside the product: may import any room but cli/; nothing in the
product imports it."""

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line (`PROG: message`), not usage plus the error."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)
