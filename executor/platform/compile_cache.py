"""Where compiled graphs are kept between runs (`model_config.enable_cache_compile`).

One folder (model_config.compile_cache_dir, default $INFER_RECIPES_HOME/compile_cache) with one
subfolder per compiler: inductor's own cache (`inductor/`), the AOTInductor packages (`aoti/<key>/`)
and torchair's and npugraph_ex's cache_compile folders. With the switch off every run compiles
afresh: inductor's on-disk caches are turned off and AOT packages go to a temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.utils.paths import infer_recipes_home


def default_compile_cache_dir() -> Path:
    return infer_recipes_home() / "compile_cache"


@dataclass(frozen=True, slots=True)
class CompileCache:
    root: Path | None  # None: no cache, every run compiles

    @classmethod
    def from_config(cls, enabled: bool, folder: str) -> CompileCache:
        if not enabled:
            return cls(None)
        return cls(Path(folder).expanduser() if folder else default_compile_cache_dir())

    def folder(self, compiler: str) -> Path | None:
        """The compiler's subfolder, created; None when caching is off."""
        if self.root is None:
            return None
        path = self.root / compiler
        path.mkdir(parents=True, exist_ok=True)
        return path

    def configure_inductor(self) -> None:
        """Point inductor's FX-graph and AOTAutograd caches at our folder, or turn them off."""
        import torch._functorch.config
        import torch._inductor.config

        folder = self.folder("inductor")
        torch._inductor.config.fx_graph_cache = folder is not None
        torch._functorch.config.enable_autograd_cache = folder is not None
        if folder is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)  # read by inductor at each cache access


def graph_key(model: torch.nn.Module, **settings: object) -> str:
    """A key for a compiled graph of `model`: its class, HF config, the torch version and every
    setting that changes the program (dtype, block size, table width, ...). Weights are not part
    of it: packages are built without them and read the live model's tensors."""
    config = getattr(model, "config", None)
    described = {
        "torch": torch.__version__,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config.to_dict() if config is not None else None,
        **{name: str(value) for name, value in settings.items()},
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
