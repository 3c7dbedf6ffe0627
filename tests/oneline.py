"""A command's argument error: one line on stderr, nothing on stdout, exit status 2."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def one_line_exit(main: Callable[[list[str]], object], args: list[str],
                  capsys: pytest.CaptureFixture[str]) -> str:
    """Run `main(args)`, which must exit 2 with exactly one line on stderr; that line."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    return err
