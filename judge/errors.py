"""The judge's exception tree.

Foreign errors (httpx transport errors and timeouts, engine HTTP errors, psycopg errors) are
translated into these at one boundary each (judge/backends.py for HTTP) with
`raise … from exc`. The worker only asks one question of an error: transient (retry the job
with backoff) or permanent (record the failure now).
"""

from __future__ import annotations

import httpx


class JudgeError(Exception):
    """Base class; `transient` says whether retrying the job may succeed."""

    transient: bool = False


class BackendUnavailable(JudgeError):
    """The judge or teacher endpoint could not be reached, timed out, or answered 5xx/429."""

    transient = True


# The httpx errors that mean no connection was made at all (BackendUnreachable).
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)


class BackendUnreachable(BackendUnavailable):
    """No connection could be made at all (refused, no route, connect timeout): the engine is
    down or restarting, and the request never reached it. An outage, not this job's failure:
    the worker puts the job back without counting the attempt (judge/worker.py)."""


class BackendRejected(JudgeError):
    """The endpoint answered 4xx to a well-formed request (bad key, unknown model, ...)."""

    transient = False


class BadBackendResponse(JudgeError):
    """The endpoint answered 200 with a body that is not what the protocol promises."""

    transient = True


class PromptTooLong(JudgeError):
    """The teacher prompt plus the response does not fit the model's context."""

    transient = False


# How engines word a 400 for an input over the context length (SGLang, vLLM, OpenAI).
_TOO_LONG_WORDS = ("context length", "context_length", "maximum context", "too long",
                   "longer than")


def says_too_long(message: str) -> bool:
    """Whether an engine's 400 message refuses the input for its length."""
    lowered = message.lower()
    return any(word in lowered for word in _TOO_LONG_WORDS)


class JobInvalid(JudgeError):
    """The job cannot be judged: its turn is gone or has no next state (and, for an
    outcome-only job, its session no outcome)."""

    transient = False


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of an ExceptionGroup (asyncio.TaskGroup wraps failures in one)."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
