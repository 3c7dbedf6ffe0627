"""Personal mode (trainer/personal.py) against real Postgres and the real embedded engine: one
LoRA adapter per user, trained on that user's samples only, loaded into the engine under a
name of its own and named in `user_adapters` (where the proxy picks it: tests/proxy/
test_adapters.py); users stepped in turn; opt-out and deletion take the adapter away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import insert, text
from sqlalchemy.engine import Engine
from test_train_loop import PROMPT, rollout, settings_for

from clawrl.base.db import User, create_async
from clawrl.base.settings import EngineSettings
from proxy.admin import delete_user
from trainer.personal import adapter_name, ensure_adapters, train_personal

SampleFactory = Callable[..., int]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def new_user(db: Engine, name: str) -> int:
    with db.begin() as conn:
        user_id: int = conn.execute(insert(User.__table__).values(name=name)
                                    .returning(User.__table__.c.id)).scalar_one()
    return user_id


def rows(db: Engine, sql: str, **params: Any) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(text(sql), params).all())


def served_adapters(url: str) -> set[str]:
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def response_logprobs(url: str, lora: str | None, prompt: list[int],
                      response: list[int]) -> list[float]:
    body: dict[str, Any] = {"input_ids": prompt + response, "return_logprob": True,
                            "logprob_start_len": len(prompt) - 1,
                            "sampling_params": {"max_new_tokens": 0}}
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [t[0] for t in r.json()["meta_info"]["input_token_logprobs"][1:]]


def add_user_samples(add_sample: SampleFactory, url: str, user_id: int, n: int,
                     reward: int | list[int]) -> list[int]:
    """n samples of the user's; `reward` for all, or a list cycled over them."""
    rewards = reward if isinstance(reward, list) else [reward]
    return [add_sample(user_id=user_id, reward=rewards[i % len(rewards)],
                       **rollout(url, PROMPT[: 3 + i % 5])) for i in range(n)]


def personal_settings(tmp_path: Path, db_url: str, url: str, model: Path) -> Any:
    return settings_for(tmp_path, db_url, url, model, personal=True, max_wait_s=3600.0,
                        lora={"r": 4, "alpha": 16})


def test_each_user_trains_and_is_served_their_own_adapter_in_turn(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        tiny_model_dir: Path, engine_factory: Callable[..., str]) -> None:
    url = engine_factory(tiny_model_dir)
    ann, ben = new_user(db, "ann"), new_user(db, "ben")
    # Ann is busy (three batches ready), Ben has one batch, written after all of Ann's.
    # Rewards that differ within each batch: personal mode trains against the batch's mean
    # reward, so a batch all alike would teach an adapter nothing.
    ann_ids = add_user_samples(add_sample, url, ann, 12, reward=[1, 1, -1])
    ben_ids = add_user_samples(add_sample, url, ben, 4, reward=[-1, 1])
    settings = personal_settings(tmp_path, db_url, url, tiny_model_dir)
    # Replaying accepted samples: each step also trains on its own user's earlier +1 samples.
    settings.trainer = settings.trainer.model_copy(update={"replay_coef": 0.5})
    assert train_personal(settings, max_steps=4) == 4

    # In turn: Ann's oldest batch, then Ben (never trained), then Ann twice; Ben's batch did
    # not wait behind all of Ann's.
    steps = rows(db, "SELECT step, user_id, num_samples, version, "
                     "metrics->>'replay_nll' AS replay FROM training_steps ORDER BY step")
    assert [(s.user_id, s.num_samples, s.version) for s in steps] == \
        [(ann, 4, None), (ben, 4, None), (ann, 4, None), (ann, 4, None)]
    # Replay draws from the step's own user only: Ann's first step and Ben's (Ann's accepted
    # samples were trained by then) have nothing to replay; Ann's later steps do.
    assert [s.replay is not None for s in steps] == [False, False, True, True]
    # Every sample was trained by a step of its own user's adapter, and only there.
    crossed = rows(db, "SELECT s.id FROM samples s JOIN training_steps t "
                       "ON t.step = s.trained_step WHERE t.user_id <> s.user_id")
    assert crossed == []
    trained = rows(db, "SELECT id, trained_step FROM samples WHERE trained_step IS NOT NULL")
    assert {r.id for r in trained} == set(ann_ids) | set(ben_ids)

    versions = rows(db, "SELECT user_id, version, status, path FROM adapter_versions "
                        "ORDER BY user_id, version")
    assert [(v.user_id, v.version, v.status) for v in versions] == [
        (ann, 1, "published"), (ann, 2, "published"), (ann, 3, "published"),
        (ben, 1, "published")]
    for v in versions:
        folder = Path(v.path)
        assert (folder / "adapter_model.safetensors").is_file()
        assert (folder / "adapter_config.json").is_file() and (folder / ".complete").is_file()
        assert (folder / "trainer_state" / "optimizer.pt").is_file()
    # The users' rows name the newest versions; the engine has exactly those loaded (Ann's
    # older versions were unloaded as each new one came in).
    named = rows(db, "SELECT user_id, name, version, loaded FROM user_adapters ORDER BY user_id")
    assert [(r.user_id, r.name, r.version, r.loaded) for r in named] == [
        (ann, adapter_name(ann, 3), 3, True), (ben, adapter_name(ben, 1), 1, True)]
    assert served_adapters(url) == {adapter_name(ann, 3), adapter_name(ben, 1)}

    # Each adapter changes what its user is served, and the two differ from each other.
    probe = rollout(url, PROMPT)
    prompt, response = probe["prompt_ids"], probe["response_ids"]
    base = response_logprobs(url, None, prompt, response)
    ann_lp = response_logprobs(url, adapter_name(ann, 3), prompt, response)
    ben_lp = response_logprobs(url, adapter_name(ben, 1), prompt, response)
    assert max(abs(a - b) for a, b in zip(base, ann_lp, strict=True)) > 1e-4
    assert max(abs(a - b) for a, b in zip(base, ben_lp, strict=True)) > 1e-4
    assert max(abs(a - b) for a, b in zip(ann_lp, ben_lp, strict=True)) > 1e-4

    # More of Ben's turns train Ben's adapter from his v1; Ann's files stay byte for byte.
    ann_files = {p: p.read_bytes() for v in versions if v.user_id == ann
                 for p in Path(v.path).glob("adapter_model.safetensors")}
    add_user_samples(add_sample, url, ben, 4, reward=1)
    assert train_personal(settings, max_steps=1) == 1
    assert rows(db, "SELECT user_id FROM training_steps ORDER BY step DESC LIMIT 1")[0][0] == ben
    assert all(p.read_bytes() == b for p, b in ann_files.items())
    assert served_adapters(url) == {adapter_name(ann, 3), adapter_name(ben, 2)}


def test_engine_restart_opt_out_and_deletion_take_the_right_adapters(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        tiny_model_dir: Path, engine_factory: Callable[..., str]) -> None:
    url = engine_factory(tiny_model_dir)
    ann, ben, cy = new_user(db, "ann"), new_user(db, "ben"), new_user(db, "cy")
    for user in (ann, ben, cy):
        add_user_samples(add_sample, url, user, 4, reward=1)
    settings = personal_settings(tmp_path, db_url, url, tiny_model_dir)
    assert train_personal(settings, max_steps=3) == 3
    names = {u: adapter_name(u, 1) for u in (ann, ben, cy)}
    assert served_adapters(url) == set(names.values())
    engine = EngineSettings(url=url)

    # The engine lost Ben's adapter (a restart forgets them all): the trainer loads it again.
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": names[ben]},
                      timeout=30).json()["success"]
    assert ensure_adapters(db, engine, settings.weights_dir()) == 1
    assert served_adapters(url) == set(names.values())

    # Cy opts out of training: no adapter any more (engine, row, folders), versions retired,
    # and his new samples are skipped, never trained.
    with db.begin() as conn:
        conn.execute(text("UPDATE users SET train_opt_out = true WHERE id = :u"), {"u": cy})
    cy_folder = Path(rows(db, "SELECT path FROM adapter_versions WHERE user_id = :u",
                          u=cy)[0][0]).parent
    later = add_user_samples(add_sample, url, cy, 4, reward=1)
    ensure_adapters(db, engine, settings.weights_dir())
    assert served_adapters(url) == {names[ann], names[ben]}
    assert rows(db, "SELECT * FROM user_adapters WHERE user_id = :u", u=cy) == []
    assert [r[0] for r in rows(db, "SELECT status FROM adapter_versions WHERE user_id = :u",
                               u=cy)] == ["retired"]
    assert not cy_folder.exists()
    assert train_personal(settings.model_copy(update={"trainer": settings.trainer.model_copy(
        update={"max_wait_s": 0.0})}), once=True) == 0
    assert {r[0] for r in rows(db, "SELECT skipped_reason FROM samples WHERE id = ANY(:ids)",
                               ids=later)} == {"opted_out"}

    # Deleting Ann deletes her adapter everywhere: engine, folders, rows; Ben keeps his.
    ann_folder = Path(rows(db, "SELECT path FROM adapter_versions WHERE user_id = :u",
                           u=ann)[0][0]).parent

    async def delete() -> dict[str, int]:
        adb = create_async(db_url)
        try:
            return await delete_user(adb, "ann", None, engine)
        finally:
            await adb.dispose()

    counts = asyncio.run(delete())
    assert (counts["adapter_versions"], counts["adapters_unloaded"],
            counts["adapter_folders"]) == (1, 1, 1)
    assert served_adapters(url) == {names[ben]}
    assert not ann_folder.exists()
    for table in ("adapter_versions", "user_adapters", "training_steps", "samples"):
        assert rows(db, f"SELECT 1 FROM {table} WHERE user_id = :u", u=ann) == [], table
    assert rows(db, "SELECT version FROM adapter_versions WHERE user_id = :u", u=ben) == [(1,)]


def test_a_deleted_users_folders_on_the_trainers_disk_are_swept(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        tiny_model_dir: Path, engine_factory: Callable[..., str]) -> None:
    """Deleted where the folders were out of reach (another machine): the trainer deletes
    them itself, and loads nothing for that user."""
    url = engine_factory(tiny_model_dir)
    dee = new_user(db, "dee")
    add_user_samples(add_sample, url, dee, 4, reward=1)
    settings = personal_settings(tmp_path, db_url, url, tiny_model_dir)
    assert train_personal(settings, max_steps=1) == 1
    folder = settings.weights_dir() / "users" / f"u{dee}"
    assert folder.is_dir()
    with db.begin() as conn:  # a deletion that could not reach this disk
        conn.execute(text("DELETE FROM users WHERE id = :u"), {"u": dee})
    assert ensure_adapters(db, EngineSettings(url=url), settings.weights_dir()) == 0
    assert not folder.exists()


def test_personal_mode_on_megatron_is_one_clear_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.train import main

    assert main(["--personal", "--backend", "megatron"]) == 2
    assert capsys.readouterr().err.strip() == \
        "clawrl train: personal mode (one LoRA adapter per user) needs the torch backend"


def test_one_users_rollback_and_prune_leave_everyone_else_alone(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        tiny_model_dir: Path, engine_factory: Callable[..., str],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.versions import main as versions_main

    url = engine_factory(tiny_model_dir)
    ann, ben = new_user(db, "ann"), new_user(db, "ben")
    add_user_samples(add_sample, url, ann, 8, reward=1)
    add_user_samples(add_sample, url, ben, 4, reward=1)
    settings = personal_settings(tmp_path, db_url, url, tiny_model_dir)
    assert train_personal(settings, max_steps=3) == 3  # ann v1, ben v1, ann v2
    capsys.readouterr()
    monkeypatch.setenv("CLAWRL_DATABASE__URL", db_url)
    monkeypatch.setenv("CLAWRL_ENGINE__URL", url)
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path / "state"))

    assert versions_main(["rollback", "1", "--user", "ann"]) == 0
    assert capsys.readouterr().out.strip() == f"ann is now served {adapter_name(ann, 1)}"
    assert served_adapters(url) == {adapter_name(ann, 1), adapter_name(ben, 1)}
    assert [tuple(r) for r in rows(db, "SELECT version, status FROM adapter_versions "
                                       "WHERE user_id = :u ORDER BY version", u=ann)] == \
        [(1, "published"), (2, "retired")]
    # Ann's training continues from v1 under a new number; her v2 name is never reused.
    add_user_samples(add_sample, url, ann, 4, reward=1)
    assert train_personal(settings, max_steps=1) == 1
    capsys.readouterr()
    assert served_adapters(url) == {adapter_name(ann, 3), adapter_name(ben, 1)}
    # Prune keeps the served version and the newest K; Ben's folders are not touched.
    assert versions_main(["prune", "--keep", "1", "--user", "ann"]) == 0
    assert capsys.readouterr().out.strip() == "pruned 1 version(s) of ann: 1"
    assert versions_main(["list", "--user", "ann"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in listed[1:]] == [
        ["1", "1", "retired"], ["2", "3", "retired"], ["3", "4", "published"]]
    assert versions_main(["rollback", "0", "--user", "ben"]) == 0
    assert served_adapters(url) == {adapter_name(ann, 3)}
    assert rows(db, "SELECT * FROM user_adapters WHERE user_id = :u", u=ben) == []
    assert versions_main(["list", "--user", "nobody"]) == 1
    assert capsys.readouterr().err.strip() == "clawrl versions: no user named 'nobody'"


def test_adapters_step_at_their_own_learning_rate(tmp_path: Path,
                                                   tiny_model_dir: Path) -> None:
    """`adapter_lr` is the optimizer's rate under LoRA (the shared model keeps `lr`), and a
    saved adapter loaded again steps at the rate configured now, not the one it was saved
    with (AdamW's state carries its lr)."""
    from trainer.backends.torch import TorchBackend
    from trainer.config import LoraSettings, TrainerSettings

    def backend(**kw: Any) -> TorchBackend:
        b = TorchBackend(TrainerSettings(device="cpu", kl_coef=0.0, lr=1e-4, **kw))
        b.load(tiny_model_dir)
        return b

    def rates(b: TorchBackend) -> set[float]:
        assert b.optimizer is not None
        return {g["lr"] for g in b.optimizer.param_groups}

    assert rates(backend(adapter_lr=5e-3)) == {1e-4}  # no LoRA: full weights at lr
    first = backend(adapter_lr=5e-3, lora=LoraSettings(enabled=True))
    first.fresh_adapter(0)
    assert rates(first) == {5e-3}
    first.save_adapter(tmp_path / "v1")
    again = backend(adapter_lr=2e-3, lora=LoraSettings(enabled=True))
    again.load_adapter(tmp_path / "v1")
    assert rates(again) == {2e-3}
    assert rates(backend(lora=LoraSettings(enabled=True))) == {1e-4}  # unset: lr
