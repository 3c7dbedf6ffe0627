"""Random PEFT LoRA adapters on a model directory, for the engine's and the proxy's tests.

`make_adapter(model_dir, out, seed)` in process (imports torch and peft), or
`make_adapters_in_child` (`python tests/loras.py MODEL_DIR OUT SEED [OUT SEED ...]`) from a
test that keeps torch out of its process.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def quiet_peft() -> Iterator[None]:
    with warnings.catch_warnings():
        # peft 0.21 reads a property transformers 5 deprecated; harmless.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        yield


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A random LoRA (rank 4, alpha 16, every attention and MLP projection) saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    config = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    with quiet_peft():
        model = get_peft_model(base, config)
    with torch.no_grad():  # kaiming A and B are small on a 64-wide model: make it matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    model.save_pretrained(str(out))
    return out


def make_adapters_in_child(model_dir: Path, seeds: dict[Path, int]) -> list[Path]:
    """An adapter per `out: seed`, all made by one child process (torch imported once)."""
    pairs = [str(a) for out, seed in seeds.items() for a in (out, seed)]
    subprocess.run([sys.executable, __file__, str(model_dir), *pairs], check=True,
                   capture_output=True)
    return list(seeds)


if __name__ == "__main__":
    for out_arg, seed_arg in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
        make_adapter(Path(sys.argv[1]), Path(out_arg), int(seed_arg))
