"""LoRA adapters in the embedded engine: loading PEFT directories, applying them per batch row,
and the registry behind `/load_lora_adapter` and `/unload_lora_adapter` (SGLang semantics,
docs/engine-protocol.md §1.3, docs/engine.md "LoRA adapters").

An adapter is a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, and
optionally `chat_template.jinja`, the file name transformers saves a template under: chat
requests naming the adapter are rendered with it instead of the base model's, for an adapter
trained on other prompts, such as the judge's ChatML without SmolLM2's default system
message). Its weights stay separate from the base model: every target `nn.Linear` gets a forward hook that
adds `(x @ A.T) @ B.T * scale` for the batch rows whose request uses an adapter with weights
for that module (the scheduler says which adapter each row uses before every forward, in
`LoRAContext.rows`). Rows of the same adapter are gathered and done in one pair of matmuls, so
a step costs, per target module, one `[n_i, T, in] x [in, r] x [r, out]` pair per distinct
adapter in the batch (plus an index gather/scatter when the batch mixes adapters) on top of
the base matmul: rank r is small, so that is a few percent of the module's base cost per
adapter present. The base rows pay nothing but the hook call.

Lifetimes. A request holds its `Adapter` object for its whole life (`Registry.acquire` /
`release`, counted per object), so unloading or evicting never pulls weights from under a
running row: unload unregisters the name first (new requests are refused), then waits until
the object's count is zero, as SGLang's `LoRARegistry.wait_for_unload` does. The LRU bound
(`max_loaded`) evicts the least recently used unpinned adapter, preferring one no request is
using; an evicted adapter is reloaded from its path by the next request that names it
(SGLang's `lora_ref_cache`), while an explicitly unloaded one is forgotten.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("clawrl.engine")

_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
_TEMPLATE = "chat_template.jinja"
_UIDS = itertools.count(1)


class LoRAError(Exception):
    """An adapter that cannot be loaded or used; the message is the whole answer."""


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: per target module path, (A [r, in], B [out, r], scale)."""

    name: str
    path: str
    pinned: bool
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    nbytes: int = 0
    in_use: int = 0
    unregistered: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Unique per load, never reused (a reload under the same name may be other weights): the
    # prefix cache keys an adapter's KV by it.
    uid: int = field(default_factory=lambda: next(_UIDS))
    chat_template: str | None = None  # the folder's own, for chat requests naming it

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass
class LoRAContext:
    """What the hooks read: the adapter of each row in the forward under way (None = base).

    Written only by the scheduler thread right before it calls the model; `rows is None`
    or all-None means a plain base forward.
    """

    rows: list[Adapter | None] | None = None
    hooked: dict[str, Any] = field(default_factory=dict)  # module path -> hook handle

    def attach(self, model: Any, paths: set[str]) -> None:
        """Hook the modules in `paths` not hooked yet; call with no step running.

        Hooks stay once added: a module no loaded adapter targets costs one Python call."""
        modules = dict(model.named_modules())
        for path in paths - set(self.hooked):
            self.hooked[path] = modules[path].register_forward_hook(self._hook(path))

    def reattach(self, model: Any) -> None:
        """Move every hook to `model` (after a base weight swap)."""
        paths = set(self.hooked)
        for handle in self.hooked.values():
            handle.remove()
        self.hooked.clear()
        self.attach(model, paths)

    def _hook(self, path: str) -> Callable[[Any, tuple[Any, ...], torch.Tensor], torch.Tensor]:
        def add_lora(_: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            rows = self.rows
            if not rows:
                return out
            x = args[0]  # [B, T, in]; out [B, T, out]
            groups: dict[int, tuple[Adapter, list[int]]] = {}
            for i, adapter in enumerate(rows):
                if adapter is not None and path in adapter.weights:
                    groups.setdefault(id(adapter), (adapter, []))[1].append(i)
            for adapter, idx in groups.values():
                a, b, scale = adapter.weights[path]
                if len(idx) == len(rows):  # the whole batch uses this adapter
                    out = out + (x @ a.T) @ b.T * scale
                else:
                    index = torch.tensor(idx, device=x.device)
                    delta = (x[index] @ a.T) @ b.T * scale
                    out = out.index_add(0, index, delta.to(out.dtype))
            return out

        return add_lora


def read_adapter(name: str, path: str, *, pinned: bool, model: Any, device: str,
                 dtype: torch.dtype) -> Adapter:
    """Load and check a PEFT LoRA directory against the serving `model`; raises LoRAError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"lora_path {path!r} is not a directory")
    try:
        config = json.loads((folder / _CONFIG).read_text())
    except FileNotFoundError as exc:
        raise LoRAError(f"lora_path {path!r} has no {_CONFIG}") from exc
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {folder / _CONFIG}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{folder / _CONFIG} is not a JSON object")
    _check_config(name, config)
    if not (folder / _WEIGHTS).is_file():
        raise LoRAError(f"lora_path {path!r} has no {_WEIGHTS} (only safetensors adapters load)")
    try:
        tensors = load_file(str(folder / _WEIGHTS), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {folder / _WEIGHTS}: {exc}") from exc

    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        # PEFT saves `base_model.model.<module path>.lora_A.weight` (no adapter name).
        stem, dot, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        if not dot or part not in ("A.weight", "B.weight"):
            raise LoRAError(f"adapter {name!r}: unexpected tensor {key!r} (only LoRA A/B "
                            "weights of linear layers are supported)")
        pairs.setdefault(stem, {})[part[0]] = tensor
    if not pairs:
        raise LoRAError(f"adapter {name!r} has no LoRA weights")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    nbytes = 0
    for stem, ab in sorted(pairs.items()):
        target = modules.get(stem)
        if not isinstance(target, torch.nn.Linear):
            raise LoRAError(f"adapter {name!r} targets {stem!r}, which is not a linear layer "
                            "of the served model")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: {stem} lacks lora_{'AB'[int('A' in ab)]}")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.shape != (r, target.in_features) or b.shape != (target.out_features, r):
            raise LoRAError(f"adapter {name!r} does not fit the served model: {stem} has "
                            f"A {tuple(a.shape)}, B {tuple(b.shape)} for a "
                            f"{target.in_features}->{target.out_features} layer")
        scale = alpha / math.sqrt(r) if rslora else alpha / r  # PEFT's `scaling`
        a, b = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
        weights[stem] = (a, b, scale)
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
    return Adapter(name=name, path=path, pinned=pinned, weights=weights, nbytes=nbytes,
                   chat_template=read_chat_template(folder))


def read_chat_template(folder: Path) -> str | None:
    """The adapter folder's own chat template (`chat_template.jinja`), if it has one."""
    try:
        return (folder / _TEMPLATE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise LoRAError(f"cannot read {folder / _TEMPLATE}: {exc}") from exc


def _check_config(name: str, config: dict[str, Any]) -> None:
    """Refuse what the hooks would silently get wrong (SGLang refuses DoRA and new tokens too)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r} is a {config.get('peft_type')} adapter, not LORA")
    if config.get("use_dora"):
        raise LoRAError(f"Failed to load {name} because LoRA serving currently doesn't support "
                        "DoRA adapters")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r} trains biases (bias={config['bias']!r}); "
                        "only bias 'none' is supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"adapter {name!r} saves full modules {config['modules_to_save']}; "
                        "not supported")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"adapter {name!r} uses fan_in_fan_out (Conv1D layers); not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"adapter {name!r} sets {key}; one rank and alpha per adapter only")


Loader = Callable[[str, str, bool], Awaitable[Adapter]]


class Registry:
    """Adapters by name, in LRU order (most recently used last), with SGLang's semantics.

    Runs on the event loop; `lock` serialises loads and unloads (SGLang's
    `lora_update_lock`). `load` is given the coroutine that reads a directory and hooks its
    modules (the engine's, which runs the reading off the loop).
    """

    def __init__(self, loader: Loader, *, max_loaded: int | None) -> None:
        self._load = loader
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        self.evicted: dict[str, tuple[str, bool]] = {}  # name -> (path, pinned), reloadable
        self.lock = asyncio.Lock()

    def listing(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: name -> path."""
        return {name: a.path for name, a in self.loaded.items()}

    async def load(self, name: str, path: str, *, pinned: bool = False) -> dict[str, str]:
        """Load `path` as `name`; evict LRU adapters over the bound. Raises LoRAError."""
        async with self.lock:
            return await self._load_locked(name, path, pinned)

    async def _load_locked(self, name: str, path: str, pinned: bool) -> dict[str, str]:
        if not name:
            raise LoRAError("lora_name must be a non-empty string")
        if name in self.loaded:
            raise LoRAError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self.max_loaded is not None and len(self.loaded) >= self.max_loaded and \
                all(a.pinned for a in self.loaded.values()):
            raise LoRAError(f"cannot load {name!r}: all {len(self.loaded)} loaded adapters are "
                            f"pinned and --max-loaded-loras is {self.max_loaded}")
        adapter = await self._load(name, path, pinned)
        self.loaded[name] = adapter
        self.evicted.pop(name, None)
        log.info("lora adapter loaded", extra={"action": "load_lora", "lora_name": name,
                                               "lora_path": path, "bytes": adapter.nbytes})
        while self.max_loaded is not None and len(self.loaded) > self.max_loaded:
            victim = self._lru_victim(keep=name)
            await self._unload_locked(victim)
            self.evicted[victim.name] = (victim.path, victim.pinned)
            log.info("lora adapter evicted (LRU)", extra={"action": "evict_lora",
                                                          "lora_name": victim.name})
        return self.listing()

    def _lru_victim(self, keep: str) -> Adapter:
        """The least recently used unpinned adapter, one no request holds if there is one."""
        candidates = [a for n, a in self.loaded.items() if not a.pinned and n != keep]
        idle = [a for a in candidates if a.in_use == 0]
        return (idle or candidates)[0]

    async def unload(self, name: str) -> dict[str, str]:
        """Unregister `name` (new requests are refused), wait for its requests, drop it."""
        async with self.lock:
            adapter = self.loaded.get(name)
            if adapter is None:
                raise LoRAError(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                f"{list(self.loaded)}")
            await self._unload_locked(adapter)
            self.evicted.pop(name, None)
            log.info("lora adapter unloaded", extra={"action": "unload_lora", "lora_name": name})
            return self.listing()

    async def _unload_locked(self, adapter: Adapter) -> None:
        del self.loaded[adapter.name]
        adapter.unregistered = True
        await adapter.idle.wait()

    async def resolve(self, name: str) -> Adapter:
        """The adapter called `name`, reloading it if the LRU bound evicted it; marks it used.

        Raises LoRAError with SGLang's message for a name never loaded (or unloaded since).
        """
        adapter = self.loaded.get(name)
        if adapter is None:
            if name not in self.evicted:
                raise LoRAError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                f"All loaded adapters: {list(self.loaded)}.")
            path, pinned = self.evicted[name]
            log.info("reloading evicted lora adapter", extra={"action": "reload_lora",
                                                              "lora_name": name})
            async with self.lock:
                if name not in self.loaded:
                    try:
                        await self._load_locked(name, path, pinned)
                    except LoRAError as exc:
                        raise LoRAError(f"Failed to implicitly load LoRA adapter {name}: "
                                        f"{exc}") from exc
            adapter = self.loaded[name]
        self.loaded.move_to_end(name)
        return adapter

    def chat_template(self, name: str | None) -> str | None:
        """The chat template of adapter `name` (None: the base model's), also while it is
        evicted (its folder's file then), so a request renders alike either way."""
        if name is None:
            return None
        if (adapter := self.loaded.get(name)) is not None:
            return adapter.chat_template
        if name in self.evicted:
            try:
                return read_chat_template(Path(self.evicted[name][0]))
            except LoRAError:
                return None  # the reload that follows reports the folder's fault
        return None

    @staticmethod
    def acquire(adapter: Adapter) -> bool:
        """Count a request on `adapter`; False once it was unregistered (unloaded, evicted)."""
        if adapter.unregistered:
            return False
        adapter.in_use += 1
        adapter.idle.clear()
        return True

    @staticmethod
    def release(adapter: Adapter) -> None:
        adapter.in_use -= 1
        if adapter.in_use == 0:
            adapter.idle.set()
