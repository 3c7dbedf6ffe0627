"""Model names: the one id the proxy serves, the names that reach it, and OpenAI's 404 for
any other.

The proxy serves one model. Its id is `CLAWRL_PROXY__SERVED_MODEL_NAME` when set, else the
engine's own name (`/model_info`'s `served_model_name`) made clean: both engines name a
model by the folder it was loaded from unless told otherwise, an absolute path of the
engine's machine, which no client should see and from which the openai SDK builds
`/models//srv/…` — so a path is shown as its last folder. A Hugging Face id
(`org/name`) is kept as it is.

A request may name the model by that id, by `default`, by the engine's own name, or by an
alias (`CLAWRL_PROXY__MODEL_ALIASES`, a JSON object `{"gpt-4o-mini": "default"}` for apps
that hard-code a model name); `name:suffix` is read as `name` (SGLang's `base:adapter`: the
proxy alone picks adapters). Any other name is OpenAI's 404 `model_not_found`, before the
engine is called and before anything is stored. `GET /v1/models` lists the served id;
`GET /v1/models/{id}` answers for every name a request may use.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from clawrl.base.errors import NotFound
from clawrl.base.settings import ProxySettings
from proxy.upstream import Upstream

DEFAULT = "default"


def clean_id(engine_name: str) -> str:
    """The id clients see for the engine's model name: a path's last folder, else the name."""
    name = engine_name.rstrip("/")
    if engine_name.startswith(("/", "./", "../", "~")) and posixpath.basename(name):
        return posixpath.basename(name)
    return engine_name


class ModelNotFound(NotFound):
    """OpenAI's answer for a model name it does not serve (404, `model_not_found`)."""

    code = "model_not_found"

    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(f"The model `{name}` does not exist or you do not have access to "
                         f"it.{why}", param="model")


def model_card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "clawrl"}


class ModelNames:
    """The served id and the names that reach it, from the settings and the engine's name
    (read by the proxy's `/model_info` poll, or on demand the first time it is needed)."""

    def __init__(self, settings: ProxySettings, upstream: Upstream) -> None:
        self.configured = settings.served_model_name
        self.aliases: Mapping[str, str] = settings.model_aliases
        self.upstream = upstream

    @property
    def served_id(self) -> str:
        """The id clients see (`default` until the engine's name is known)."""
        engine = self.upstream.model_name
        return self.configured or (clean_id(engine) if engine else DEFAULT)

    def engine_model(self) -> str:
        """The `model` sent to the engine: its own name when known."""
        return self.upstream.model_name or DEFAULT

    async def _own_names(self, name: str) -> set[str]:
        names = {DEFAULT}
        if self.configured:
            names.add(self.configured)
        if name not in names and self.upstream.model_name is None:
            await self.upstream.model_info()  # the poll has not read it yet; 502 when down
        engine = self.upstream.model_name
        if engine:
            names |= {engine, clean_id(engine)}
        return names

    async def resolve(self, requested: str | None) -> str:
        """The served id that `requested` names (None: the default), or ModelNotFound."""
        name = requested or DEFAULT
        if name in self.aliases:
            target = self.aliases[name]
            if target not in await self._own_names(target):
                raise ModelNotFound(name, f" (an alias of `{target}`, which is not served "
                                          f"here: the proxy's model_aliases setting)")
            return self.served_id
        base = name.split(":", 1)[0] if ":" in name else name
        if base in self.aliases or base in await self._own_names(base):
            return self.served_id
        raise ModelNotFound(name)

    async def card(self, requested: str) -> dict[str, Any]:
        """`GET /v1/models/{id}`: the model card under the name asked for, or 404."""
        await self.resolve(requested)
        return model_card(requested)

    def listing(self) -> dict[str, Any]:
        """`GET /v1/models`: the served id alone (not the aliases, nor the users' adapters)."""
        return {"object": "list", "data": [model_card(self.served_id)]}
