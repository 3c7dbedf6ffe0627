"""Run megatron-core on CPU: the small compatibility layer, active only when CUDA is absent.

megatron-core 0.16 assumes a GPU in a handful of places: `torch.cuda.current_device()` for
buffer placement, hard-coded `device="cuda"` / `.cuda()` allocations (causal mask, DDP grad
buffers, optimizer state), a CUDA RNG tracker for tensor-parallel dropout, and
`torch.cuda.synchronize()` in timers and checkpointing. On a machine with CUDA this module
does nothing but initialise the process group (NCCL) and megatron's parallel state. Without
CUDA it:

- points `torch.cuda.current_device()` at the CPU and makes `synchronize` / `empty_cache`
  no-ops (they are called unconditionally);
- installs megatron's own no-op RNG tracker (there is no dropout in our models);
- redirects `device="cuda"` allocations and `.cuda()` calls to the CPU with a
  `TorchFunctionMode`, which also answers `Tensor.type()` with the CUDA type name (the
  distributed optimizer and grad clipping assert `torch.cuda.FloatTensor`). Modes are
  thread-local, so every thread that runs megatron code must enter `megatron_context()`
  itself (the backend does, around every call);
- uses the gloo backend on a free local port when not launched by torchrun.

Keep this module small: everything megatron-specific that is not a CPU workaround lives in
`megatron_mapping.py` and `megatron.py`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

CUDA = torch.cuda.is_available()
_PATCHED = False


def import_megatron() -> None:
    """Import megatron-core quietly.

    On a machine without Transformer Engine or Apex it warns at import time that it falls
    back to torch implementations; that fallback is exactly what we want on CPU, and the
    test harness turns warnings into errors, so the import is wrapped once here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:<int>" for tensor factories; megatron passes
    # torch.cuda.current_device() results, which we make return the CPU device instead.
    return False


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made inside it."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts `param.type() == "torch.cuda.FloatTensor"` (optimizer, grad
            # clipping); answer as the CUDA type of the same dtype.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


# megatron-core 0.16 warns from inside its own code on every build and step (deprecated
# config defaults, "Apex is not installed", non-leaf .grad reads, deprecated torch
# collectives it calls). None is actionable for us and the test harness turns warnings into
# errors, so they are silenced only around megatron calls: everything megatron's own modules
# raise, plus the torch warnings its calls trigger.
_TORCH_WARNINGS = (
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)


@contextlib.contextmanager
def megatron_context() -> Iterator[None]:
    """Enter around every megatron call, in the calling thread.

    CPU: the device redirection (thread-local). Everywhere: megatron's known warnings muted.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"megatron\.")
        for category, message in _TORCH_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        if CUDA:
            yield
        else:
            with CpuDeviceMode():
                yield


def _patch_torch_cuda() -> None:
    """Point the torch.cuda entry points megatron calls unconditionally at the CPU."""
    global _PATCHED
    if CUDA or _PATCHED:
        return
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.device_count = lambda: 0
    _PATCHED = True


def free_port() -> int:
    """A TCP port nobody listens on right now (for a single-process rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Followers wait in a broadcast while the leader waits for samples: keep the collective
# timeout long (a day) so an idle trainer is not torn down by the process-group watchdog.
COLLECTIVE_TIMEOUT = timedelta(days=1)


def init_process_group() -> None:
    """torch.distributed: from torchrun's environment, or a single process on a free port."""
    _patch_torch_cuda()
    if dist.is_initialized():
        return
    backend = "nccl" if CUDA else "gloo"
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    else:  # one process; leave os.environ alone so later launches are not confused
        dist.init_process_group(
            backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
            world_size=1, timeout=COLLECTIVE_TIMEOUT,
        )


def init_model_parallel(tp: int = 1, pp: int = 1, dp: int | None = None) -> None:
    """megatron's parallel state over the current process group.

    The world size must equal tp × pp × dp; `dp=None` means "whatever remains".
    """
    import_megatron()
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp) != 0 or (dp is not None and world != tp * pp * dp):
        want = f"tp {tp} × pp {pp}" + (f" × dp {dp} = {tp * pp * dp}" if dp else "")
        raise ValueError(
            f"world size {world} does not match the parallel layout {want}: launch a "
            f"multiple of tp×pp = {tp * pp} processes (torchrun --nproc-per-node …)"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        create_gloo_process_groups=not CUDA,
    )
    if CUDA:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def shutdown_distributed() -> None:
    """Tear down megatron's parallel state and the process group (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
