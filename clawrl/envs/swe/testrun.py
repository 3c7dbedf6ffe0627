"""The test runner of a SWE project, run inside its sandbox (standard library only: the
environment passes this file's text to `python3 -I -S -B -c`, so it never lies in the
sandbox where the agent could edit it).

    python3 -I -S -B -c "$(cat testrun.py)" file tests/test_textkit.py   # the visible tests
    python3 -I -S -B -c "$(cat testrun.py)" source "TEST SOURCE" NONCE   # tests as source
    python3 -I -S -B -c "$(cat testrun.py)" calls MODULE NONCE CALL...   # the hidden tests

Runs every `test_*` function of the tests in order, from the project folder (the current
directory). Prints each failure (at most 5 in full: the assertion's message, or the exception
and the project lines it came through), then `N passed, M failed` (and `, 1 error` when the
tests cannot even be loaded, e.g. the module does not import). With a NONCE, a last line
`RESULT NONCE passed failed errors` that the environment reads: a run that dies before it
(killed, `os._exit`) counts as every test failed.

`calls` is how the hidden tests run for the verdict: the module is imported and each call
evaluated, one line per call, `CALL NONCE ["INDEX", "value", REPR]` or `CALL NONCE ["INDEX",
"raised", [CLASS NAMES]]`. Nothing here judges them: the environment compares each against
the answer it alone holds, outside the sandbox (clawrl/envs/swe/verdict.py). Code of the
project runs in this process and can print anything, the nonce included (it is on the
command line); without the answers it cannot print a right one.
"""

import os
import sys
import traceback
import types

SHOWN = 5


def describe(exc: BaseException, cwd: str) -> str:
    """The exception in one line, then the project lines its traceback went through."""
    text = type(exc).__name__ + (": " + str(exc) if str(exc) else "")
    if isinstance(exc, AssertionError):
        return text
    lines = [text]
    for frame in traceback.extract_tb(exc.__traceback__):
        name = frame.filename
        if name.startswith(cwd + os.sep):
            name = name[len(cwd) + 1:]
        elif not name.startswith("tests") and name != "hidden tests":
            continue
        lines.append(f"  {name}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}")
    return "\n".join(lines)


def calls(module_name: str, nonce: str, exprs: list[str]) -> int:
    import importlib
    import json

    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # noqa: BLE001 - the project's own errors: no call answers
        print(f"ERROR importing {module_name}: {type(exc).__name__}")
        return 1
    for index, expr in enumerate(exprs):
        try:
            value = eval(expr, {module_name: module})  # noqa: S307 - the task's own calls
            line: list[object] = [str(index), "value", repr(value)]
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a raised exception is the answer
            line = [str(index), "raised", [c.__name__ for c in type(exc).__mro__]]
        print(f"CALL {nonce} {json.dumps(line)}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    mode, arg = argv[0], argv[1]
    if mode == "calls":
        exprs = argv[3:]
        del sys.argv[1:]
        sys.path.insert(0, os.getcwd())
        return calls(arg, argv[2], exprs)
    nonce = argv[2] if len(argv) > 2 else None
    del sys.argv[1:]  # the project's code need not see the nonce or the hidden tests
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    if mode == "file":
        name = arg
        with open(arg, encoding="utf-8") as f:
            text = f.read()
    else:
        name, text = "hidden tests", arg
    module = types.ModuleType("tests_under_run")
    try:
        exec(compile(text, name, "exec"), module.__dict__)
    except BaseException as exc:  # noqa: BLE001 - the project's own errors, reported
        print(f"ERROR loading {name}: {describe(exc, cwd)}")
        print("0 passed, 0 failed, 1 error")
        if nonce:
            print(f"RESULT {nonce} 0 0 1")
        return 1
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and callable(f)]
    passed = failed = 0
    for test_name, test in tests:
        try:
            test()
            passed += 1
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit from the project counts too
            failed += 1
            if failed <= SHOWN:
                print(f"FAILED {test_name}: {describe(exc, cwd)}")
    if failed > SHOWN:
        print(f"({failed - SHOWN} more failures not shown)")
    print(f"{passed} passed, {failed} failed")
    if nonce:
        print(f"RESULT {nonce} {passed} {failed} 0")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # no atexit handlers of the project's
