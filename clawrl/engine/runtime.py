"""The engine's serving state: model, tokenizer, weight version, pause state, weight swaps.

Concurrency follows SGLang's tokenizer manager (docs/engine-protocol.md §1.3):
- every generate request first waits while the engine is paused, then holds the *reader*
  side of a writer-preferring lock for its whole life, streaming included;
- a weight update loads the new checkpoint first (a bad path fails here, old weights keep
  serving), then takes the *writer* side: it waits for in-flight requests to drain while new
  ones queue, swaps, and releases. No request fails because of an update;
- while paused, an update skips the lock (nothing is stepping) and swaps immediately.

LoRA adapters (clawrl/engine/lora.py) load and unload without that lock, as in SGLang: a
request resolves its adapter once it holds the reader side and keeps it until it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch

from clawrl.engine.grammar import Constraint, Grammars
from clawrl.engine.lora import Adapter, LoRAError, Registry, read_adapter
from clawrl.engine.ngram import NgramDraft
from clawrl.engine.prefix_cache import PrefixCache
from clawrl.engine.protocol import EngineError
from clawrl.engine.scheduler import Scheduler, Sequence
from clawrl.engine.tools import template_renders_tools

log = logging.getLogger("clawrl.engine")

# How often a request waiting for tokens checks whether its client is still there.
_DISCONNECT_POLL_S = 1.0

# Config fields that must match for new weights to fit the serving model.
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "intermediate_size")


class WeightUpdateError(Exception):
    """The requested checkpoint cannot be loaded; the old weights keep serving."""


class RWLock:
    """Writer-preferring asyncio reader/writer lock (SGLang `aio_rwlock` semantics)."""

    def __init__(self) -> None:
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    @asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        await self._wait(lambda: not self._writing and self._writers_waiting == 0)
        self._readers += 1
        try:
            yield
        finally:
            self._readers -= 1
            self._wake()

    @asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        self._writers_waiting += 1
        try:
            await self._wait(lambda: not self._writing and self._readers == 0)
        finally:
            self._writers_waiting -= 1
            self._wake()  # readers held back by this writer re-check
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
            self._wake()


def native_bfloat16(device: str) -> bool:
    """Whether bfloat16 matrix products run in hardware here: on CUDA, or on a CPU with
    AVX-512 BF16 or AMX (what oneDNN reports). Elsewhere torch converts to float32 inside
    each product, and bfloat16 is slower than float32, not faster: on an AVX2-only CPU a
    prefill-sized product ran at a ninth of float32's speed (docs/judge.md, "Which dtype")."""
    if device.startswith("cuda"):
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto`: bfloat16 where it runs natively (half the bytes read per token), float32
    elsewhere; any other name is that torch dtype."""
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    return getattr(torch, name)  # type: ignore[no-any-return]


def load_model(path: str | Path, *, device: str, dtype: torch.dtype) -> Any:
    """Load an HF causal LM for inference, refusing checkpoints with missing/unexpected keys."""
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, output_loading_info=True)
    model, info = loaded
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                 "mismatched_keys") and v}
    if bad:
        raise WeightUpdateError(f"checkpoint at {path} does not match its config: {bad}")
    return model.to(device).eval()


class Engine:
    """Everything the HTTP routes share: created once in the app lifespan."""

    def __init__(self, model_path: str, *, served_model_name: str | None = None,
                 weight_version: str = "default", device: str = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch: int = 32,
                 max_loaded_loras: int | None = None, speculative_draft_tokens: int = 0,
                 prefix_cache_mb: float = 0) -> None:
        from transformers import AutoTokenizer

        self.model_path = str(model_path)
        self.served_model_name = served_model_name or self.model_path
        self.device, self.dtype = device, dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # Whether the template puts tool schemas in the prompt; if not, clawrl/engine/tools.py
        # renders them (checked once: the template does not change while serving).
        self.renders_tools = template_renders_tools(self.tokenizer)
        model = load_model(self.model_path, device=device, dtype=dtype)
        self.config = model.config
        self.context_len = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        self.eos_ids = eos_ids(model, self.tokenizer)
        # Chat requests that leave these unset use the values generation_config.json sets
        # (not transformers' class defaults such as top_k=50), as SGLang does.
        diff = model.generation_config.to_diff_dict()
        self.generation_defaults = {k: diff[k] for k in ("temperature", "top_p", "top_k")
                                    if diff.get(k) is not None}
        # The scheduler thread decodes (stop strings) with its own Rust tokenizer instance, so
        # it never shares one with the event loop thread.
        from tokenizers import Tokenizer

        own = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        drafts = NgramDraft(speculative_draft_tokens) if speculative_draft_tokens else None
        self.scheduler = Scheduler(model, eos_ids=self.eos_ids,
                                   decode=lambda ids: own.decode(ids, skip_special_tokens=True),
                                   weight_version=weight_version, max_batch=max_batch,
                                   drafts=drafts,
                                   prefix_cache=PrefixCache(int(prefix_cache_mb * 2**20)))
        self.lock = RWLock()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.pause_mode: str | None = None
        self.updating = False
        self._update_lock = asyncio.Lock()
        self.live: dict[str, Sequence] = {}
        self._token_text: dict[int, str] = {}
        self.adapters = Registry(self._read_adapter, max_loaded=max_loaded_loras)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.abort_all("server shutting down")
        self.scheduler.thaw()
        self.scheduler.stop()

    # ---- text ---------------------------------------------------------------------------

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (SGLang `return_text_in_logprobs`)."""
        if token_id not in self._token_text:
            self._token_text[token_id] = str(self.tokenizer.decode([token_id]))
        return self._token_text[token_id]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    # ---- LoRA adapters ----------------------------------------------------------------------

    async def _read_adapter(self, name: str, path: str, pinned: bool) -> Adapter:
        """Read a PEFT directory off the event loop, then hook its modules between steps."""
        adapter = await asyncio.to_thread(read_adapter, name, path, pinned=pinned,
                                          model=self.scheduler.model, device=self.device,
                                          dtype=self.dtype)
        scheduler = self.scheduler
        await asyncio.wrap_future(scheduler.call(
            lambda: scheduler.lora.attach(scheduler.model, set(adapter.weights))))
        return adapter

    async def check_adapter(self, name: str | None) -> None:
        """Refuse (400) a request for an adapter that is not loaded, before it starts."""
        if name is not None:
            try:
                await self.adapters.resolve(name)
            except LoRAError as exc:
                raise EngineError(str(exc)) from exc

    async def _hold_adapter(self, seq: Sequence) -> str | None:
        """Give `seq` its adapter for its lifetime; an error message if it cannot have it."""
        if seq.lora_name is None:
            return None
        try:
            adapter = await self.adapters.resolve(seq.lora_name)
        except LoRAError as exc:
            return str(exc)
        if not Registry.acquire(adapter):  # unloaded between resolve and now
            return f"LoRA adapter {seq.lora_name} was unloaded"
        seq.adapter = adapter
        return None

    # ---- structured outputs -----------------------------------------------------------------

    async def constrain(self, seq: Sequence) -> None:
        """Compile the sequence's grammar (off the event loop: a large vocabulary or schema
        takes a while) and give it its matcher; EngineError (400) when the grammar is invalid."""
        if seq.params.grammar is not None:
            compiled = await asyncio.to_thread(self.grammars.compile, seq.params.grammar)
            seq.constraint = Constraint(compiled, self.vocab_size, self.grammars.utf8)

    # ---- generation -----------------------------------------------------------------------

    async def generate(self, seq: Sequence,
                       disconnected: Callable[[], Awaitable[bool]] | None = None
                       ) -> AsyncIterator[Sequence]:
        """Run `seq`; yield it each time it made progress, last when `seq.finish` is set.

        Closing the iterator early, or `disconnected()` turning true (checked while no
        progress arrives, as SGLang's tokenizer manager does), aborts the sequence.
        """
        loop = asyncio.get_running_loop()
        progressed = asyncio.Event()
        def notify() -> None:
            loop.call_soon_threadsafe(progressed.set)

        seq.notify = notify
        await self._resumed.wait()
        async with self.lock.reader():
            refused = await self._hold_adapter(seq)
            if refused is not None:
                seq.finish = {"type": "abort", "message": refused, "status_code": 400}
                yield seq
                return
            if seq.rid in self.live:
                seq.rid = f"{seq.rid}-{uuid.uuid4().hex[:8]}"
            self.live[seq.rid] = seq
            self.scheduler.submit(seq)
            try:
                while seq.finish is None:
                    try:
                        await asyncio.wait_for(progressed.wait(), timeout=_DISCONNECT_POLL_S)
                    except TimeoutError:
                        if disconnected is not None and await disconnected():
                            self.scheduler.abort(seq, "client disconnected")
                        continue
                    progressed.clear()
                    yield seq
            finally:
                if seq.finish is None:
                    self.scheduler.abort(seq, "client disconnected")
                self.live.pop(seq.rid, None)
                if seq.adapter is not None:
                    Registry.release(seq.adapter)

    async def run(self, seq: Sequence,
                  disconnected: Callable[[], Awaitable[bool]] | None = None) -> Sequence:
        async for _ in self.generate(seq, disconnected):
            pass
        return seq

    def abort(self, rid: str | None, *, abort_all: bool = False) -> int:
        if abort_all:
            return self.scheduler.abort_all("aborted by request")
        seq = self.live.get(rid or "")
        if seq is None:
            return 0
        self.scheduler.abort(seq, "aborted by request")
        return 1

    # ---- control --------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """SGLang `pause_generation`: abort (default), retract or in_place."""
        self._resumed.clear()
        self.pause_mode = mode
        if mode == "abort":
            self.scheduler.abort_all("generation paused")
        await asyncio.to_thread(self.scheduler.freeze, retract=mode != "in_place")

    def resume(self) -> None:
        self.pause_mode = None
        self.scheduler.thaw()
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None,
                                       *, abort_all_requests: bool = False) -> None:
        """Load `model_path` and swap it in; raises WeightUpdateError (old weights serve on)."""
        async with self._update_lock:
            self.updating = True
            try:
                started = time.monotonic()
                model = await asyncio.to_thread(self._load_compatible, model_path)
                if abort_all_requests:
                    self.scheduler.abort_all("aborted for a weight update")
                if self.paused:
                    self._swap(model, model_path, weight_version)
                else:
                    async with self.lock.writer():
                        self._swap(model, model_path, weight_version)
                log.info("weights updated", extra={"action": "update_weights",
                                                   "model_path": model_path,
                                                   "weight_version": self.weight_version,
                                                   "seconds": time.monotonic() - started})
            finally:
                self.updating = False

    def _load_compatible(self, model_path: str) -> Any:
        path = Path(model_path)
        if not path.is_dir():
            raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
        if not (path / "config.json").is_file():
            raise WeightUpdateError(f"model_path {model_path!r} has no config.json")
        try:
            model = load_model(path, device=self.device, dtype=self.dtype)
        except WeightUpdateError:
            raise
        except Exception as exc:  # any loader failure means: this checkpoint is unusable
            raise WeightUpdateError(f"cannot load {model_path!r}: {exc}") from exc
        for name in _SHAPE_FIELDS:
            new, old = getattr(model.config, name, None), getattr(self.config, name, None)
            if new != old:
                raise WeightUpdateError(
                    f"checkpoint {model_path!r} does not fit the served model: {name} {new} != {old}")
        return model

    def _swap(self, model: Any, model_path: str, weight_version: str | None) -> None:
        running, _ = self.scheduler.in_flight()
        if running:
            raise WeightUpdateError(f"{running} requests are paused in place with a KV cache; "
                                    "continue them or pause with mode 'retract' or 'abort'")
        self.scheduler.swap_model(model, weight_version or self.weight_version)
        self.model_path = model_path

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            # SGLang's field (a JSON string, or None): here the generation_config defaults a
            # chat request that leaves them unset is sampled with, so a client (the proxy)
            # can send them explicitly and know the distribution each reply came from.
            "preferred_sampling_params": (json.dumps(self.generation_defaults)
                                          if self.generation_defaults else None),
            "weight_version": self.weight_version,
            "load_format": "auto",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "reasoning_parser": None,
            "tool_call_parser": "qwen25",
            "model_type": self.config.model_type,
            "architectures": list(self.config.architectures or []),
            "context_length": self.context_len,
        }


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a reply: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids
