"""Session inference: which earlier turn does a new request continue?

Chat clients resend the whole conversation on every request. A request continues an
earlier turn T when its messages start with T's request messages followed by T's reply.
Each stored turn carries `context_fingerprint` = sha256 of its canonical "request messages +
reply"; a new request computes the fingerprint of every prefix of its messages that ends
with an assistant message and looks for the longest one among the same user's OPEN main
turns. The messages after the matched prefix (the user's next message, or tool results)
are that turn's next state: they are attached to it, and a judge job enqueued, in the same
transaction that records the new turn.

The next state as the request arrives (`attach_next_state`): the proxy does not wait for
the new request's own reply to learn what it continues. As the request arrives, before the
engine answers it, its next state is attached to the open turn it continues and that
turn's judge job enqueued, so the judge reads a person's correction while the reply to it is
generated. The continued turn stays open until the request's own turn is stored, which
continues it as above and enqueues no second judge job (one judgment per continuation, on
the next state that arrived first). A request whose reply then fails leaves the turn open,
so the client's retry still continues it. Cases this path leaves to the store (it attaches
nothing): a side call, an opted-out user, a later choice of `n`, a session the client has
ended, an explicit session matched by id alone or that would adopt an inferred one, and a
turn not yet stored when the request arrives (a reply is sent before its turn commits, and
an agent's tool loop can answer within milliseconds). Only the turn ending with the
request's last assistant message is looked for, so an older turn of the conversation is
never attached (nor locked) in its place.

Canonical form (so cosmetic differences do not break a match, real edits do): role, text
(content parts joined, surrounding whitespace and `<think>` blocks stripped, and a reply's
leading timestamp envelope, which agents strip before replaying), tool calls as (name,
arguments as canonical JSON); reasoning fields, names and tool call ids are ignored.
System/developer messages are left out by default because agent frameworks rewrite them on
every request (`proxy.fingerprint_system`).

Context that is never replayed: agents end a request with messages of their own after the
person's (OpenClaw appends a `<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>` user message to every
request and drops it from the next). So a turn whose request ends with more than one
non-assistant message after its last assistant message also stores
`conversation_fingerprint`: the same hash with that trailing run cut to its first message
(the one that opened the request). A later request continues the turn when one of its
prefixes matches either fingerprint. Both are hashes of the whole conversation so far and of
the reply, so two conversations are joined only when everything but the dropped context is
the same; never across users.

Explicit sessions (`X-Session-Id`) attach by id: when no prefix matches (the client rewrote
its history, or sends only the new message), the request continues the session's latest
open main turn, with the messages after its last assistant message as the next state.

An `X-Session-Id` that first appears on a later request of a conversation (a client that
sends it from its second turn on) adopts the inferred session the request continues: that
session's turns move to the explicit session (`_adopt_session`), so the conversation stays
one session. Only a session with no explicit id is adopted, and only by an explicit session
that has no turns yet.

`X-Session-Done` ends a session for good (`sessions.done_at`): a later request naming the
same `X-Session-Id` is stored in it, closed, continuing nothing (never judged by a next
state), and the session stays closed. A session closed by the timeout is reopened by its
next request.

The choices of one request with `n` > 1 are one turn each (`turns.group_id`, the request's
group, and `group_index`); the first choice is stored as any turn is, and the others join
its session at the same index without continuing anything again (the turn they all continue
is continued once, by the first choice).

What is not tolerated (each starts a new session unless `X-Session-Id` names it): history
rewritten by the client (a compaction that replaces the conversation by its summary, an
edited earlier message), and a reply the client changed before replaying it.

A match consumes the turn (it is no longer open), and candidates are locked with
`FOR UPDATE SKIP LOCKED`, so two concurrent sessions with identical openings each continue
a different turn. A turn never continued is closed by `close_stale_turns` after the session
timeout and is never judged, unless it is its session's final turn and the session gets an
outcome (below).

A session's outcome (a verifier's number in [-1, 1]) is set by `set_outcome`
(`POST /v1/sessions/{id}/outcome`) or by the `X-Session-Outcome` header of any of its
requests, in the transaction that records that request; the last one set wins. Either way
the session's final main turn, which no request continues, gets an outcome-only judge job
in the same transaction (`enqueue_final_judge`), so the outcome trains it too.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, bindparam, case, delete, func, null, or_, select, text, update
from sqlalchemy.dialects.postgresql import BYTEA, JSONB
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import ARRAY

from clawrl.base.db import ChatSession, Turn
from clawrl.base.jobs import OUTCOME_ONLY, notify_stmt
from proxy.openai_types import loads_bounded
from proxy.records import TurnRecord
from proxy.turnkinds import (
    SYSTEM_ROLES,
    message_text,
    opening_index,
    opening_message,
    side_call_rule,
)

_OPEN, _CLOSE = "<think>", "</think>"
# A timestamp envelope an agent puts before each user message ("[Mon 2026-12-07 01:34 UTC] "),
# which a model may copy at the start of its reply and the agent strips before replaying it.
_ENVELOPE = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}"
                       r"(?::\d{2})? [A-Z][A-Za-z+\-0-9]{1,8}\]\s*")
_SEP = b"\x1e"  # record separator between canonical messages in the hash stream

# Explicit `X-Session-Id`s map to stable session UUIDs, so the proxy can answer
# `X-Clawrl-Session-Id` without asking the database.
_SESSION_NS = uuid.UUID("6f6b1d8e-3c1a-4e55-9a2b-1c7d0c1a5e10")
MAX_SESSION_ID = 256  # characters of an `X-Session-Id`


def explicit_session_id(user_id: int, external_id: str) -> uuid.UUID:
    return uuid.uuid5(_SESSION_NS, f"{user_id}/{external_id}")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:  # bounded: a record journaled by an older proxy may nest arbitrarily deep
            return loads_bounded(raw)
        except ValueError:
            return raw.strip()
    return raw


def strip_think(text: str) -> str:
    """`text` without `<think>…</think>` blocks (each from an opening tag to the next
    closing tag; an unclosed block is kept), in one linear pass — a lazy regex rescans the
    rest of the text from every opening tag."""
    parts, pos = [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        parts.append(text[pos:start])
        pos = end + len(_CLOSE)
    if not parts:
        return text
    parts.append(text[pos:])
    return "".join(parts)


def canonical_message(message: dict[str, Any]) -> bytes:
    """The parts of a message that identify it in a conversation, as stable bytes."""
    role = message.get("role")
    body = message_text(message)
    if role == "assistant":
        body = _ENVELOPE.sub("", strip_think(body).lstrip(), count=1)
    calls = [[(c.get("function") or {}).get("name"),
              _arguments((c.get("function") or {}).get("arguments"))]
             for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return json.dumps([role, body.strip(), calls], sort_keys=True, ensure_ascii=False,
                      separators=(",", ":")).encode()


def _included(message: dict[str, Any], include_system: bool) -> bool:
    return include_system or message.get("role") not in SYSTEM_ROLES


def conversation_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The request without the context appended after its opening message (the trailing
    non-assistant messages past the first), or None when nothing follows it."""
    i = opening_index(messages)
    if i is None or not any(m.get("role") not in SYSTEM_ROLES for m in messages[i + 1:]):
        return None
    return list(messages[:i + 1])


def context_fingerprint(messages: Sequence[dict[str, Any]], reply: dict[str, Any],
                        *, include_system: bool) -> bytes:
    """sha256 of a turn's canonical request messages followed by its reply."""
    h = hashlib.sha256()
    for message in [*messages, reply]:
        if _included(message, include_system):
            h.update(canonical_message(message) + _SEP)
    return h.digest()


def prefix_fingerprints(messages: Sequence[dict[str, Any]],
                        *, include_system: bool) -> list[tuple[int, bytes]]:
    """(prefix length, fingerprint) for every proper prefix ending with an assistant
    message, longest first; hashed incrementally, so this is linear in the request size."""
    h = hashlib.sha256()
    found: list[tuple[int, bytes]] = []
    for i, message in enumerate(messages):
        if _included(message, include_system):
            h.update(canonical_message(message) + _SEP)
        if message.get("role") == "assistant" and i + 1 < len(messages):
            found.append((i + 1, h.copy().digest()))
    found.reverse()
    return found


_FPS = bindparam("fps", type_=ARRAY(BYTEA))
_NO_POSITION = 1 << 30
_MATCH = (
    select(Turn.id, Turn.session_id, Turn.index_in_session, Turn.context_fingerprint,
           Turn.conversation_fingerprint)
    .where(Turn.user_id == bindparam("user_id"), Turn.state == "open", Turn.kind == "main",
           or_(Turn.context_fingerprint == func.any(_FPS),
               Turn.conversation_fingerprint == func.any(_FPS)))
    # Longest prefix first (fps is ordered longest first), then the oldest turn.
    .order_by(func.least(
        func.coalesce(func.array_position(_FPS, Turn.context_fingerprint), _NO_POSITION),
        func.coalesce(func.array_position(_FPS, Turn.conversation_fingerprint),
                      _NO_POSITION)), Turn.id)
    .limit(1)
    .with_for_update(skip_locked=True)
)
# An explicit session's latest open main turn, for a request that matches no prefix.
_LATEST_OPEN = (
    select(Turn.id, Turn.session_id, Turn.index_in_session, Turn.request_messages)
    .where(Turn.session_id == bindparam("session_id"), Turn.state == "open",
           Turn.kind == "main")
    .order_by(Turn.index_in_session.desc(), Turn.id.desc())
    .limit(1)
    .with_for_update(skip_locked=True)
)


# Statements built once: constructing ORM statements per turn costs more CPU than running them.
_TURNS: Table = Turn.__table__  # type: ignore[assignment]
_INSERT_TURN = (pg_insert(_TURNS).on_conflict_do_nothing(index_elements=[_TURNS.c.uid])
                .returning(_TURNS.c.id))
_STORED = select(_TURNS.c.uid).where(
    _TURNS.c.uid == func.any(bindparam("uids", type_=ARRAY(PG_UUID(as_uuid=True)))))
_CONTINUE = (update(_TURNS).where(_TURNS.c.id == bindparam("matched_id"))
             .values(state="continued", next_state=bindparam("messages", type_=JSONB),
                     next_turn_id=bindparam("new_id"),
                     next_state_at=func.coalesce(_TURNS.c.next_state_at, func.now())))
# The next state of a request not yet answered (`attach_next_state`): the turn stays open.
_ATTACH = (update(_TURNS)
           .where(_TURNS.c.id == bindparam("matched_id"), _TURNS.c.state == "open",
                  _TURNS.c.next_state.is_(None))
           .values(next_state=bindparam("messages", type_=JSONB), next_state_at=func.now())
           .returning(_TURNS.c.id))


# An open turn of an inferred session (no `X-Session-Id`), for an explicit session to adopt.
_MATCH_INFERRED = _MATCH.where(Turn.session_id.in_(
    select(ChatSession.id).where(ChatSession.user_id == bindparam("user_id"),
                                 ChatSession.external_id.is_(None))))
_HAS_TURNS = select(Turn.id).where(Turn.session_id == bindparam("session_id")).limit(1)


async def _find_continued(conn: AsyncConnection, rec: TurnRecord, session_id: uuid.UUID | None,
                          include_system: bool) -> tuple[Any, int] | None:
    """The open turn this request continues and the length of the request's messages that
    turn already holds (the next state is what follows), if any. For an explicit session
    with no turns yet, the turn may be one of an inferred session (the caller adopts it)."""
    prefixes = prefix_fingerprints(rec.request_messages, include_system=include_system)
    row = None
    if prefixes:
        query = _MATCH
        if session_id is not None:  # an explicit session only continues its own turns
            query = query.where(Turn.session_id == session_id)
        fps = {"user_id": rec.user_id, "fps": [fp for _, fp in prefixes]}
        row = (await conn.execute(query, fps)).first()
        if row is None and session_id is not None and (
                await conn.execute(_HAS_TURNS, {"session_id": session_id})).first() is None:
            row = (await conn.execute(_MATCH_INFERRED, fps)).first()
    if row is not None:
        length = next(n for n, fp in prefixes
                      if fp in (row.context_fingerprint, row.conversation_fingerprint))
        return row, length
    if session_id is None:
        return None
    row = (await conn.execute(_LATEST_OPEN, {"session_id": session_id})).first()
    opening = opening_index(rec.request_messages)
    if row is None or opening is None:
        return None
    earlier = opening_message(row.request_messages)
    if earlier is not None and (canonical_message(earlier)
                                == canonical_message(rec.request_messages[opening])):
        return None  # the same request again (a retry, a regenerate): not its next state
    return row, opening


def _session_upsert(done: bool, outcome: bool) -> Any:
    """Create the session, or bump its `last_turn_at` (closing it for good when `done`,
    reopening it otherwise unless the client ended it, setting its outcome from the
    `X-Session-Outcome` header when `outcome`)."""
    closed_at = func.now() if done else null()
    values: dict[str, Any] = {}
    if outcome:
        values |= {"outcome": bindparam("outcome"), "outcome_source": "header",
                   "outcome_key_id": bindparam("outcome_key_id"), "outcome_at": func.now()}
    ended = _SESSIONS.c.done_at.is_not(None)
    return (pg_insert(_SESSIONS)
            .values(id=bindparam("session_id"), user_id=bindparam("owner_id"),
                    external_id=bindparam("external_id"), closed_at=closed_at,
                    done_at=func.now() if done else null(), **values)
            .on_conflict_do_update(index_elements=[_SESSIONS.c.id], set_={
                "last_turn_at": func.now(),
                "closed_at": case((ended, _SESSIONS.c.closed_at), else_=closed_at),
                "done_at": func.coalesce(_SESSIONS.c.done_at, func.now() if done else null()),
                **values}))


_SESSIONS: Table = ChatSession.__table__  # type: ignore[assignment]
_UPSERT_SESSION = {(done, outcome): _session_upsert(done, outcome)
                   for done in (False, True) for outcome in (False, True)}


async def _upsert_session(conn: AsyncConnection, rec: TurnRecord, session_id: uuid.UUID,
                          external_id: str | None) -> None:
    params: dict[str, Any] = {"session_id": session_id, "owner_id": rec.user_id,
                              "external_id": external_id}
    has_outcome = rec.session_outcome is not None
    if has_outcome:
        params |= {"outcome": rec.session_outcome, "outcome_key_id": rec.api_key_id}
    await conn.execute(_UPSERT_SESSION[rec.session_done, has_outcome], params)


def session_candidates(user_id: int, ref: str) -> list[uuid.UUID]:
    """The session ids a client's reference may name, in order of preference: its own
    `X-Session-Id` (mapped as `explicit_session_id` maps it), then the proxy's session UUID
    (`X-Clawrl-Session-Id`, or `sessions.id` read in SQL)."""
    found = [explicit_session_id(user_id, ref)]
    try:
        found.append(uuid.UUID(ref))
    except ValueError:
        pass
    return found


# The judge job of a continued turn, unless it has one already (enqueued as the continuing
# request arrived: `attach_next_state`). Outcome-only jobs do not count (the outcome may
# have come while the turn was its session's final one), nor failed ones.
_ENQUEUE_CONTINUED = text(f"""
INSERT INTO jobs (kind, turn_id, payload, user_id)
SELECT 'judge', CAST(:turn_id AS bigint), '{{}}'::jsonb, CAST(:user_id AS bigint)
WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.turn_id = :turn_id AND j.kind = 'judge'
                  AND j.status IN ('queued', 'running', 'done')
                  AND (j.payload ->> '{OUTCOME_ONLY}') IS DISTINCT FROM 'true')
RETURNING id
""")


async def _enqueue_continued(conn: AsyncConnection, turn_id: int, user_id: int) -> bool:
    return (await conn.execute(_ENQUEUE_CONTINUED, {"turn_id": turn_id,
                                                    "user_id": user_id})).first() is not None


# The session's final main turn has no next state, so no request ever enqueues its judge
# job; its session's outcome does (an outcome-only job: judge/judgment.py). Not for a failed
# turn, one continued after all, an opted-out user's, or one that already has a judge job
# (the outcome set again). Callers hold the session row's lock (the outcome's UPDATE or
# upsert), so two outcomes of one session cannot both pass the NOT EXISTS.
_ENQUEUE_FINAL = text(f"""
INSERT INTO jobs (kind, turn_id, payload, user_id)
SELECT 'judge', t.id, '{{"{OUTCOME_ONLY}": true}}'::jsonb, t.user_id
FROM turns t JOIN users u ON u.id = t.user_id
WHERE t.id = (SELECT id FROM turns WHERE session_id = :session_id AND kind = 'main'
              ORDER BY index_in_session DESC, id DESC LIMIT 1)
  AND t.status = 'ok' AND t.next_state IS NULL AND NOT u.train_opt_out
  AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.turn_id = t.id AND j.kind = 'judge'
                  AND j.status IN ('queued', 'running', 'done'))
RETURNING id
""")


async def enqueue_final_judge(conn: AsyncConnection, session_id: uuid.UUID) -> bool:
    """Enqueue the outcome-only judge job of the session's final main turn, if it needs one
    (see `_ENQUEUE_FINAL`); whether it did. The caller sends the NOTIFY."""
    return (await conn.execute(_ENQUEUE_FINAL, {"session_id": session_id})).first() is not None


async def set_outcome(conn: AsyncConnection, *, user_id: int, ref: str, outcome: float,
                      key_id: int | None) -> uuid.UUID | None:
    """Set the outcome of `user_id`'s session named `ref` (see `session_candidates`) and
    enqueue its final turn's judge job (`enqueue_final_judge`); the session's id, or None
    when the user has no such session (another user's included)."""
    candidates = session_candidates(user_id, ref)
    target = (select(ChatSession.id)
              .where(ChatSession.user_id == user_id, ChatSession.id.in_(candidates))
              .order_by(func.array_position(
                  bindparam("ids", candidates, type_=ARRAY(PG_UUID(as_uuid=True))),
                  ChatSession.id))
              .limit(1).scalar_subquery())
    row = (await conn.execute(
        update(ChatSession).where(ChatSession.id == target)
        .values(outcome=outcome, outcome_source="api", outcome_key_id=key_id,
                outcome_at=func.now())
        .returning(ChatSession.id))).scalar()
    if row is None:
        return None
    session_id = uuid.UUID(str(row))
    if await enqueue_final_judge(conn, session_id):
        await conn.execute(notify_stmt("judge"))
    return session_id


_ENDED = select(ChatSession.done_at).where(ChatSession.id == bindparam("session_id"))
_SIBLING = (select(_TURNS.c.session_id, _TURNS.c.index_in_session)
            .where(_TURNS.c.group_id == bindparam("group_id", type_=PG_UUID(as_uuid=True)))
            .order_by(_TURNS.c.group_index).limit(1))
# An explicit session adopting an inferred one: its outcome when it has none, the earlier
# start, then the turns; the inferred session's row goes last (its turns have moved).
_ADOPT_SESSION = text("""
UPDATE sessions e SET created_at = least(e.created_at, i.created_at),
       outcome = coalesce(e.outcome, i.outcome),
       outcome_source = CASE WHEN e.outcome IS NULL THEN i.outcome_source ELSE e.outcome_source END,
       outcome_key_id = CASE WHEN e.outcome IS NULL THEN i.outcome_key_id ELSE e.outcome_key_id END,
       outcome_at = CASE WHEN e.outcome IS NULL THEN i.outcome_at ELSE e.outcome_at END
FROM sessions i WHERE e.id = :into AND i.id = :from
""")


async def _adopt_session(conn: AsyncConnection, rec: TurnRecord, inferred: uuid.UUID,
                         explicit: uuid.UUID) -> None:
    """Move the inferred session's turns (and its outcome) into the explicit session."""
    await _upsert_session(conn, rec, explicit, rec.session_external_id)
    await conn.execute(_ADOPT_SESSION, {"into": explicit, "from": inferred})
    await conn.execute(update(Turn).where(Turn.session_id == inferred)
                       .values(session_id=explicit))
    await conn.execute(delete(ChatSession).where(ChatSession.id == inferred))


async def _next_index(conn: AsyncConnection, session_id: uuid.UUID) -> int:
    last = (await conn.execute(select(func.max(Turn.index_in_session))
                               .where(Turn.session_id == session_id))).scalar()
    return 0 if last is None else int(last) + 1


async def record_turns(conn: AsyncConnection, records: Sequence[TurnRecord], *,
                       include_system: bool) -> int:
    """Store turns in order (inferring sessions, attaching next states, enqueueing judge
    jobs), skipping uids already stored. Returns how many were inserted.

    Work that does not depend on the order is done once per batch: the duplicate check,
    `last_turn_at` of continued sessions and the job notification.
    """
    stored = set((await conn.execute(_STORED, {
        "uids": [uuid.UUID(r.uid) for r in records]})).scalars())
    touched: set[uuid.UUID] = set()
    judged = inserted = 0
    for raw in records:
        if uuid.UUID(raw.uid) in stored:
            continue
        # Scrubbed before fingerprinting, so a reply and its resent copy still match.
        rec = raw.scrubbed()
        if rec.kind == "main" and rec.kind_reason is None:
            rule = side_call_rule(rec.request_messages, rec.tools)
            if rule is not None:
                rec.kind, rec.kind_reason = "side", rule
        outcome = await _record_turn(conn, rec, include_system, touched)
        if outcome is not None:
            inserted += 1
            judged += outcome
    if touched:
        await conn.execute(update(ChatSession).where(ChatSession.id.in_(touched))
                           .values(last_turn_at=func.now()))
    if judged:
        await conn.execute(notify_stmt("judge"))
    return inserted


async def _record_turn(conn: AsyncConnection, rec: TurnRecord, include_system: bool,
                       touched: set[uuid.UUID]) -> bool | None:
    """Insert one turn; None if its uid exists, else whether a judge job was enqueued."""
    explicit = (explicit_session_id(rec.user_id, rec.session_external_id)
                if rec.session_external_id else None)
    main_ok = rec.kind == "main" and rec.status == "ok"
    # The client ended this explicit session earlier: the turn is stored closed in it.
    ended = explicit is not None and (await conn.execute(
        _ENDED, {"session_id": explicit})).scalar() is not None
    sibling = None
    if rec.group_id is not None and rec.group_index:  # a later choice joins the first's place
        sibling = (await conn.execute(_SIBLING, {"group_id": uuid.UUID(rec.group_id)})).first()
        if sibling is not None and sibling.session_id is None:
            sibling = None
    continued = (await _find_continued(conn, rec, explicit, include_system)
                 if main_ok and not ended and sibling is None else None)
    if sibling is not None:
        session_id: uuid.UUID | None = sibling.session_id
        index = int(sibling.index_in_session)
    elif continued is not None:
        matched, prefix_len = continued
        session_id = matched.session_id
        if explicit is not None and session_id != explicit:
            await _adopt_session(conn, rec, matched.session_id, explicit)
            session_id = explicit
        index = int(matched.index_in_session) + 1
    elif explicit is not None:
        session_id, index = explicit, -1
    elif main_ok:
        session_id, index = uuid.uuid4(), 0
    else:  # a side or failed turn outside any explicit session stands alone
        session_id, index = None, 0

    if session_id is not None:
        if (explicit is not None or index == 0 or rec.session_done
                or rec.session_outcome is not None):
            await _upsert_session(conn, rec, session_id, rec.session_external_id)
        else:
            touched.add(session_id)
        if index < 0:
            index = await _next_index(conn, session_id)

    fingerprint = conversation = None
    if main_ok:
        reply = rec.response_message or {}
        fingerprint = context_fingerprint(rec.request_messages, reply,
                                          include_system=include_system)
        kept = conversation_messages(rec.request_messages)
        if kept is not None:
            conversation = context_fingerprint(kept, reply, include_system=include_system)
    state = "open" if main_ok and not rec.session_done and not ended else "closed"
    new_id = (await conn.execute(_INSERT_TURN, {
        **rec.row(), "session_id": session_id, "index_in_session": index,
        "context_fingerprint": fingerprint, "conversation_fingerprint": conversation,
        "state": state})).scalar()
    if new_id is None:
        return None

    judged = False
    if continued is not None:
        await conn.execute(_CONTINUE, {"matched_id": matched.id, "new_id": new_id,
                                       "messages": rec.request_messages[prefix_len:]})
        if not rec.train_opt_out:
            judged = await _enqueue_continued(conn, matched.id, rec.user_id)
    if rec.session_done and session_id is not None:
        await conn.execute(update(Turn).where(Turn.session_id == session_id,
                                              Turn.state == "open").values(state="closed"))
    if rec.session_outcome is not None and session_id is not None and not rec.train_opt_out:
        # Usually the session's last request: this turn is its final one (until continued).
        judged = await enqueue_final_judge(conn, session_id) or judged
    return judged


async def attach_next_state(conn: AsyncConnection, record: TurnRecord, *,
                            include_system: bool) -> bool:
    """The request `record` has arrived and is not answered yet: if it continues an open
    turn, attach its next state to that turn and enqueue the turn's judge job (the module's
    docstring, "The next state as the request arrives"). Returns whether a job was
    enqueued."""
    rec = record.scrubbed()
    if rec.kind != "main" or rec.train_opt_out or rec.group_index:
        return False
    if side_call_rule(rec.request_messages, rec.tools) is not None:
        return False
    explicit = (explicit_session_id(rec.user_id, rec.session_external_id)
                if rec.session_external_id else None)
    if explicit is not None and (await conn.execute(
            _ENDED, {"session_id": explicit})).scalar() is not None:
        return False
    # Only the turn that ends with the request's last assistant message: a request may
    # arrive before the turn it continues is stored (its reply was sent before its commit),
    # and an older turn matching a shorter prefix must then be neither attached nor locked
    # (the store, taking turns in served order, continues the right one).
    prefixes = prefix_fingerprints(rec.request_messages, include_system=include_system)
    if not prefixes:
        return False
    length, fingerprint = prefixes[0]
    query = _MATCH if explicit is None else _MATCH.where(Turn.session_id == explicit)
    matched = (await conn.execute(query, {"user_id": rec.user_id,
                                          "fps": [fingerprint]})).first()
    if matched is None:
        return False
    attached = (await conn.execute(_ATTACH, {
        "matched_id": matched.id, "messages": rec.request_messages[length:]})).first()
    return attached is not None and await _enqueue_continued(conn, matched.id, rec.user_id)


async def close_stale_turns(conn: AsyncConnection, timeout_s: float) -> int:
    """Close open turns (and idle sessions) older than the session timeout."""
    cutoff = text("now() - make_interval(secs => :secs)").bindparams(secs=timeout_s)
    closed = await conn.execute(update(Turn).where(Turn.state == "open",
                                                   Turn.created_at < cutoff)
                                .values(state="closed"))
    await conn.execute(update(ChatSession).where(ChatSession.closed_at.is_(None),
                                                 ChatSession.last_turn_at < cutoff)
                       .values(closed_at=func.now()))
    return int(closed.rowcount or 0)

