"""The embedded engine's batching scheduler: one thread that owns the model and its KV cache.

Requests (`Sequence`) arrive in an inbox. Each loop iteration the thread
1. admits waiting sequences (up to `max_batch` running): a batch-1 prefill over the prompt,
   which also yields the prompt-token logprobs and the first sampled token, then merges the
   sequence's KV cache into the running batch;
2. runs one decode step for every running sequence at once (continuous batching).

Batch layout. The running KV cache is per layer `[B, kv_heads, T, head_dim]` with *left*
padding: row b holds its `n_cached` real positions right-aligned, the rest are zeros masked
out by `mask[b]` (`[B, T]`, 1 = real). Position ids are per row (`n_cached`), so RoPE sees the
same positions as an unpadded forward and logits match a batch-1 forward to float rounding.
Prefill is always batch 1 (no padded queries, so no fully-masked attention rows).

Logprobs of sampled tokens are those of the distribution they were sampled from, before
truncation: `log_softmax(logits / T)` at the request's temperature T (top-p/top-k not
applied), as SGLang returns by default; a greedy request (T ~ 0, or top_k 1) gets the raw
`log_softmax(logits)` (T = 1), as SGLang's greedy path does. The trainer recomputes them at the
same T (`behaviour_temperature`), so its first-step importance ratio is exactly 1. Prompt
(input) logprobs are always at T = 1: scoring samples nothing.

LoRA: each sequence may carry an `Adapter` (clawrl/engine/lora.py); before every forward the
thread writes the adapter of each batch row into `lora.rows`, and the hooks on the target
modules add that row's low-rank update, so base rows and rows of different adapters share one
forward. Hooks are added only on this thread, between steps (`call`).

Prefix cache (clawrl/engine/prefix_cache.py): a prefill first looks up the longest cached
prefix of its tokens, under the weights now serving and the sequence's adapter, and forwards
only the rest on top of that KV; `Sequence.cached_tokens` says how many it skipped. The
prompt's KV is stored right after its prefill (a request arriving meanwhile with the same
system prompt hits it), and prompt plus reply when the sequence finishes (the next turn of a
conversation is that plus a new message). Prefill computes logits only from the first
position anyone reads (the last, or `logprob_start_len` when input logprobs are asked for),
which also bounds the hit: a cached position has no logits.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from clawrl.engine.lora import Adapter, LoRAContext
from clawrl.engine.ngram import NgramDraft
from clawrl.engine.prefix_cache import PrefixCache

log = logging.getLogger("clawrl.engine")

Finish = dict[str, Any]  # SGLang finish_reason: {"type": "stop"|"length"|"abort", ...}
GREEDY_TEMPERATURE = 1e-5  # below it a request is greedy (SGLang's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    # A structured-output constraint, SGLang's sampling_params key and value (e.g.
    # ("json_schema", "{...}")); clawrl/engine/grammar.py compiles it into `Sequence.constraint`.
    grammar: tuple[str, str] | None = None
    # OpenAI's penalties on the tokens generated so far (`adjust_logits`) and biases added to
    # the logits of token ids; the logprobs returned are those of the adjusted distribution.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(eq=False)
class Sequence:
    """One generation request and its results, appended by the scheduler thread.

    The async side reads the lists while they grow (appends are atomic under the GIL) and
    treats `finish` as the last write: once it is set, nothing else changes.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    notify: Callable[[], None] = lambda: None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    weight_spans: list[dict[str, Any]] = field(default_factory=list)
    finish: Finish | None = None
    # LoRA: the adapter name the request asked for, and the adapter it holds while it runs.
    lora_name: str | None = None
    adapter: Adapter | None = None
    # The grammar the reply must follow (clawrl/engine/grammar.py `Constraint`), or None.
    constraint: Any = None
    # scheduler-private state
    aborted: str | None = None
    n_cached: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    generator: torch.Generator | None = None


class Scheduler:
    """Owns the model; runs prefill and batched decode on its own thread."""

    def __init__(self, model: Any, *, eos_ids: set[int], decode: Callable[[list[int]], str],
                 weight_version: str, max_batch: int = 32,
                 drafts: NgramDraft | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.eos_ids = eos_ids
        self.decode = decode  # token ids -> text (special tokens skipped), for stop strings
        self.weight_version = weight_version
        self.max_batch = max_batch
        self.max_len = int(model.config.max_position_embeddings)
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        # Taken off the queue for this iteration's prefill, not yet in the running batch:
        # `abort_all` must reach them too (their first token may already be streamed).
        self._admitting: list[Sequence] = []
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._frozen = self._retract = self._parked = False
        self._stopped = False
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self.lora = LoRAContext()
        self.drafts = drafts  # speculative decoding of lone greedy sequences (`_speculate`)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
        self._weights_serial = 0  # +1 per swap, even one that keeps the version label
        # Finished requests by finish type, and their prompt and generated tokens (for
        # GET /metrics; written by the scheduler thread only).
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._rng = torch.Generator().manual_seed(random.randrange(2**63))

    # ---- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> None:
        if seq.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(seq.params.seed)
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify_all()

    def abort(self, seq: Sequence, message: str) -> None:
        with self._cond:
            if seq.finish is None:
                seq.aborted = message
                self._cond.notify_all()

    def abort_all(self, message: str) -> int:
        with self._cond:
            live = [s for s in (*self._waiting, *self._admitting, *self._running)
                    if s.finish is None]
            for seq in live:
                seq.aborted = message
            self._cond.notify_all()
            return len(live)

    def freeze(self, *, retract: bool) -> None:
        """Stop stepping and return once the thread is parked.

        `retract` moves running sequences back to the queue and drops their KV cache; they
        re-prefill (under whatever weights are loaded then) after `thaw`.
        """
        with self._cond:
            self._frozen, self._retract = True, retract
            self._cond.notify_all()
            while not self._parked and not self._stopped and self._thread.is_alive():
                self._cond.wait(timeout=1.0)

    def thaw(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    def in_flight(self) -> tuple[int, int]:
        """(running with a KV cache, waiting) counts."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def swap_model(self, model: Any, weight_version: str) -> None:
        """Install new weights; only while no sequence holds a KV cache of the old ones."""
        with self._cond:
            if self._running:
                raise RuntimeError(f"{len(self._running)} requests still hold a KV cache")
            self.lora.reattach(model)  # loaded adapters apply to the new base weights too
            self.model, self.weight_version = model, weight_version
            self._weights_serial += 1  # the thread retires the old prefix cache before a step

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the scheduler thread between two steps (paused or not); its result."""
        done: Future[Any] = Future()
        with self._cond:
            if not self._thread.is_alive():  # not started (or stopped): nothing steps
                done.set_result(fn())
                return done
            self._calls.append((fn, done))
            self._cond.notify_all()
        return done

    # ---- the scheduler thread --------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                if not self._wait_for_work():
                    return
                self.prefix_cache.retire(self._weights_serial)
                self._drop_aborted()
                admit: list[Sequence] = []
                while self._waiting and len(self._running) + len(admit) < self.max_batch:
                    admit.append(self._waiting.popleft())
                self._admitting = admit
            try:
                for seq in admit:
                    self._prefill(seq)
                with self._cond:
                    self._admitting = []
                if self._running:
                    if not self._speculate():
                        self._decode_step()
            except Exception as exc:  # never leave requests hanging on a dead thread
                log.exception("engine step failed")
                failed = [s for s in (*admit, *self._running) if s.finish is None]
                with self._cond:
                    self._keep_rows([])
                    self._admitting = []
                for seq in failed:
                    self._finish(seq, {"type": "abort", "message": f"engine error: {exc!r}",
                                       "status_code": 500})

    def _wait_for_work(self) -> bool:
        """Block (holding the condition) until there is work; False once stopped.

        While frozen the thread parks here, after retracting if asked, so `freeze` can
        return knowing no step is under way.
        """
        while not self._stopped:
            while self._calls:
                fn, done = self._calls.popleft()
                try:
                    done.set_result(fn())
                except Exception as exc:
                    done.set_exception(exc)
            if self._frozen:
                if self._retract:
                    self._waiting.extendleft(reversed(self._running))
                    self._keep_rows([])
                    self._retract = False
                self._drop_aborted()
                self._parked = True
                self._cond.notify_all()
                self._cond.wait()
                continue
            self._parked = False
            if self._waiting or self._running:
                return True
            self._cond.wait()
        return False

    def _drop_aborted(self) -> None:
        for seq in [s for s in self._waiting if s.aborted]:
            self._waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": seq.aborted})
        gone = [i for i, s in enumerate(self._running) if s.aborted]
        for i in gone:
            self._finish(self._running[i], {"type": "abort", "message": self._running[i].aborted})
        if gone:
            self._keep_rows([i for i, s in enumerate(self._running) if not s.aborted])

    def _prefill(self, seq: Sequence) -> None:
        """Batch-1 forward over everything the sequence has but the pending last token, less
        the longest prefix whose KV is cached."""
        resumed = bool(seq.output_ids)  # retracted earlier: recompute the cache, sample nothing
        tokens = seq.input_ids + seq.output_ids[:-1] if resumed else seq.input_ids
        scoring = not resumed and seq.return_logprob and seq.logprob_start_len >= 0
        first = min(seq.logprob_start_len, len(tokens) - 1) if scoring else len(tokens) - 1
        namespace = _namespace(seq)
        hit, past = self.prefix_cache.lookup(namespace, tokens, limit=first)
        self.lora.rows = [seq.adapter] if seq.adapter is not None else None
        out = self.model(input_ids=torch.tensor([tokens[hit:]]),
                         cache=DynamicCache(ddp_cache_data=past) if past else None,
                         use_cache=True, logits_to_keep=len(tokens) - first)
        logits = out.logits[0].float()  # [L - first, V]: positions first .. L-1
        cache = [(k, v) for k, v, *_ in out.cache]
        self.prefix_cache.insert(namespace, tokens, [(k[0], v[0]) for k, v in cache])
        seq.n_cached = len(tokens)
        if not resumed:
            seq.cached_tokens = hit
            if seq.return_logprob and seq.logprob_start_len >= 0:
                self._input_logprobs(seq, logits)
            if seq.params.max_new_tokens == 0:  # scoring only; record which weights scored
                seq.weight_spans = [{"version": self.weight_version, "start": 0, "end": 0}]
                self._finish(seq, {"type": "length", "length": 0})
                return
            last = logits[-1]
            finish = self._append(seq, last,
                                  F.log_softmax(last / behaviour_temperature(seq.params), dim=-1))
            if finish is not None:
                self._finish(seq, finish)
                return
        self._merge(cache, seq)

    def _input_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        # SGLang: one entry per prompt position from logprob_start_len; position i is scored
        # by the logits at i-1, so the first requested position has no logprob (None).
        # `logits` are those of positions start .. L-1.
        start = min(seq.logprob_start_len, len(seq.input_ids) - 1)
        ids = torch.tensor(seq.input_ids)
        logp = F.log_softmax(logits[:-1], dim=-1)  # row j predicts token start+j+1
        targets = logp.gather(1, ids[start + 1:, None])[:, 0].tolist()
        seq.input_logprobs = [None, *targets]
        if seq.top_logprobs_num > 0:
            top = logp.topk(seq.top_logprobs_num, dim=-1)
            seq.input_top = [None, *_pairs(top.values, top.indices)]

    def _merge(self, cache: list[tuple[torch.Tensor, torch.Tensor]], seq: Sequence) -> None:
        """Add a batch-1 cache as a new row, left-padding whichever side is shorter."""
        new_len, old_len = cache[0][0].shape[2], self._mask.shape[1]
        new_mask = torch.ones(1, new_len, dtype=torch.long)
        if not self._running:
            self._cache, self._mask, self._running = cache, new_mask, [seq]
            return
        width = max(new_len, old_len)
        merged = []
        for (k_old, v_old), (k_new, v_new) in zip(self._cache, cache, strict=True):
            merged.append((
                torch.cat([_left_pad(k_old, width), _left_pad(k_new, width)]),
                torch.cat([_left_pad(v_old, width), _left_pad(v_new, width)]),
            ))
        self._mask = torch.cat([F.pad(self._mask, (width - old_len, 0)),
                                F.pad(new_mask, (width - new_len, 0))])
        self._cache = merged
        self._running.append(seq)

    def _decode_step(self) -> None:
        seqs = self._running
        input_ids = torch.tensor([[s.output_ids[-1]] for s in seqs])
        positions = torch.tensor([[s.n_cached] for s in seqs])
        mask = torch.cat([self._mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
        rows = [s.adapter for s in seqs]
        self.lora.rows = rows if any(a is not None for a in rows) else None
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         cache=DynamicCache(ddp_cache_data=self._cache), use_cache=True)
        self._cache = [(k, v) for k, v, *_ in out.cache]
        self._mask = mask
        logits = out.logits[:, -1].float()  # [B, V]
        temperature = torch.tensor([behaviour_temperature(s.params) for s in seqs])
        logp = F.log_softmax(logits / temperature[:, None], dim=-1)
        finished: dict[int, Finish] = {}
        for row, seq in enumerate(seqs):
            seq.n_cached += 1
            finish = self._append(seq, logits[row], logp[row])
            if finish is not None:
                finished[row] = finish
        if finished:
            self._remember({row: seqs[row] for row in finished})
            # Out of the running batch before anyone hears it finished: a weight update that
            # waited for the last request then finds no KV cache left.
            with self._cond:
                self._keep_rows([i for i in range(len(seqs)) if i not in finished])
            for row, finish in finished.items():
                self._finish(seqs[row], finish)

    def _speculate(self) -> bool:
        """One speculative step for a lone greedy sequence; False when there is none to take
        (a batch, sampling, an adapter, or nothing to draft): then the caller decodes.

        The sequence's pending token and up to k drafted tokens (`NgramDraft`) go through one
        forward pass. Each position's logits are what a one-token step would see there, so the
        greedy tokens are appended in order, as `_decode_step` appends them, while they agree
        with the draft; the first disagreement is still a model token (the step always gains
        at least one), and the cache keeps only the positions of appended tokens. Logprobs and
        alternatives come from each position's own logits.
        """
        if self.drafts is None or len(self._running) != 1:
            return False
        seq = self._running[0]
        p = seq.params
        if not is_greedy(p) or seq.adapter is not None or seq.constraint is not None \
                or p.adjusts:  # a draft is checked against the model's own argmax
            return False
        room = min(p.max_new_tokens - len(seq.output_ids), self.max_len - seq.n_cached - 1) - 1
        draft = self.drafts.draft(seq.input_ids[-self.drafts.max_n:] + seq.output_ids, room)
        if not draft:
            return False
        tokens = [seq.output_ids[-1], *draft]
        width = self._mask.shape[1]
        mask = torch.cat([self._mask, torch.ones(1, len(tokens), dtype=torch.long)], dim=1)
        positions = torch.arange(seq.n_cached, seq.n_cached + len(tokens))[None]
        self.lora.rows = None
        out = self.model(input_ids=torch.tensor([tokens]), attention_mask=mask,
                         position_ids=positions, cache=DynamicCache(ddp_cache_data=self._cache),
                         use_cache=True)
        logits = out.logits[0].float()  # [len(tokens), V]
        logp = F.log_softmax(logits, dim=-1)  # greedy: T = 1 (`behaviour_temperature`)
        finish: Finish | None = None
        kept = 0
        for i in range(len(tokens)):
            finish = self._append(seq, logits[i], logp[i])
            kept += 1
            if finish is not None or i == len(draft) or seq.output_ids[-1] != draft[i]:
                break
        self.drafts.proposed += len(draft)
        self.drafts.accepted += kept - 1
        self._cache = [(k[:, :, :width + kept], v[:, :, :width + kept])
                       for k, v, *_ in out.cache]
        self._mask = mask[:, :width + kept]
        seq.n_cached += kept
        if finish is not None:
            self._remember({0: seq})
            with self._cond:
                self._keep_rows([])
            self._finish(seq, finish)
        return True

    def _remember(self, rows: dict[int, Sequence]) -> None:
        """Store the KV of finishing rows (prompt and reply) in the prefix cache: the next turn
        of a conversation starts with them. Row b holds its `n_cached` positions right-aligned
        (input ids, then every output token but the last, which was never fed back)."""
        if not self.prefix_cache.enabled:
            return
        width = self._mask.shape[1]
        for row, seq in rows.items():
            n = seq.n_cached
            self.prefix_cache.insert(_namespace(seq), (seq.input_ids + seq.output_ids)[:n],
                                     [(k[row, :, width - n:], v[row, :, width - n:])
                                      for k, v in self._cache])

    def _keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self._running, self._cache = [], []
            self._mask = torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(rows)
        mask = self._mask[index]
        # Drop leading columns that are padding in every remaining row.
        first = int((mask.sum(0) > 0).nonzero()[0])
        self._mask = mask[:, first:]
        self._cache = [(k[index, :, first:], v[index, :, first:]) for k, v in self._cache]
        self._running = [self._running[i] for i in rows]

    def _append(self, seq: Sequence, logits: torch.Tensor, logp: torch.Tensor) -> Finish | None:
        """Sample from `logits` [V]; record the token with its logprob under the sampling
        distribution, `logp` [V] (`log_softmax(logits / behaviour_temperature)`).

        A constrained sequence samples from its masked logits (the tokens its grammar refuses
        at -inf), and its logprobs are those of that constrained distribution (as SGLang's).
        Returns how the sequence finished, if it did; the caller finishes it (after taking it
        out of the running batch). Otherwise the sequence's reader is told of the new token.
        """
        if seq.params.adjusts:
            logits = adjust_logits(logits, seq.params, seq.output_ids)
            if seq.constraint is None:
                logp = F.log_softmax(logits / behaviour_temperature(seq.params), dim=-1)
        if seq.constraint is not None:
            logits = seq.constraint.mask(logits)
            logp = F.log_softmax(logits / behaviour_temperature(seq.params), dim=-1)
        token = _sample(logits, seq.params, seq.generator or self._rng)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        if not seq.weight_spans or seq.weight_spans[-1]["version"] != self.weight_version:
            n = len(seq.output_ids)
            if seq.weight_spans:
                seq.weight_spans[-1]["end"] = n
            seq.weight_spans.append({"version": self.weight_version, "start": n, "end": n})
        seq.weight_spans[-1]["end"] = len(seq.output_ids) + 1
        if seq.return_logprob:
            seq.output_logprobs.append(float(logp[token]))
            if seq.top_logprobs_num > 0:
                top = logp.topk(seq.top_logprobs_num)
                # Tokens a grammar refused (-inf) are no alternatives: fewer may come back.
                seq.output_top.append([(lp, t) for lp, t in _pairs(top.values[None],
                                                                    top.indices[None])[0]
                                       if lp != float("-inf")])
        seq.output_ids.append(token)
        finish = self._check_stop(seq, token)
        if finish is None:
            seq.notify()
        return finish

    def _check_stop(self, seq: Sequence, token: int) -> Finish | None:
        p, n = seq.params, len(seq.output_ids)
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                return {"type": "stop", "matched": token}
            if p.stop:
                longest = max(len(s) for s in p.stop)
                tail = self.decode(seq.output_ids[-(4 * longest + 4):])
                for stop in p.stop:
                    if stop and stop in tail:
                        return {"type": "stop", "matched": stop}
        if n >= p.max_new_tokens or seq.n_cached + 1 >= self.max_len:
            return {"type": "length", "length": n}
        return None

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        self.finished[str(finish.get("type", "unknown"))] += 1
        self.prompt_tokens += len(seq.input_ids)
        self.cached_tokens += seq.cached_tokens
        self.generation_tokens += len(seq.output_ids)
        if self.drafts is not None and seq.output_ids and finish.get("type") != "abort":
            self.drafts.learn(seq.input_ids[-self.drafts.max_n:] + seq.output_ids)
        seq.finish = finish
        seq.notify()


def _namespace(seq: Sequence) -> int | None:
    """Whose KV this sequence makes and may reuse: the base model's (None) or its adapter's."""
    return seq.adapter.uid if seq.adapter is not None else None


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence axis (dim 2 of [B, H, T, D]) with zeros up to `width`."""
    return F.pad(x, (0, 0, width - x.shape[2], 0))


def _pairs(values: torch.Tensor, indices: torch.Tensor) -> list[list[tuple[float, int]]]:
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), indices.tolist(),
                                                          strict=True)]


def is_greedy(p: SamplingParams) -> bool:
    """Whether the request takes the argmax (temperature ~0, or top_k 1) instead of sampling."""
    return p.temperature < GREEDY_TEMPERATURE or p.top_k == 1


def behaviour_temperature(p: SamplingParams) -> float:
    """The temperature the returned logprobs are computed at: the request's, or 1 for a
    greedy request (whose argmax has no distribution of its own)."""
    return 1.0 if is_greedy(p) else float(p.temperature)


def adjust_logits(logits: torch.Tensor, p: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """OpenAI's penalties and `logit_bias` on one row's logits [V]: each token already
    generated loses `presence_penalty` once and `frequency_penalty` per time it appeared, and
    each biased token id gains its bias (ids beyond the vocabulary were refused up front)."""
    out = logits.clone()
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=out.shape[-1])[:out.shape[-1]]
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        out[ids] += torch.tensor(list(p.logit_bias.values()), dtype=out.dtype)
    return out


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """Greedy at temperature ~0; otherwise temperature, top-k, top-p (nucleus) sampling."""
    if is_greedy(p):
        return int(logits.argmax())
    return int(torch.multinomial(sampling_distribution(logits, p), 1, generator=generator))


def sampling_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The weights `_sample` draws from when not greedy: temperature, then top-k, then top-p
    (left unnormalised after top-p, as drawn); a token the sampler can never pick weighs 0."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False  # a top_p under float32's smallest (1e-300) compares as 0: keep one
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return probs
