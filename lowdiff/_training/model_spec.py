"""Describe a live model + optimizer by names: what the manifest records and replay relies on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowdiff._storage.format import dtype_name, encode_value
from lowdiff._storage.manifest import Manifest, TensorSpec
from lowdiff.config import Config
from lowdiff.errors import ModelMismatchError, UnsupportedError


@dataclass
class BufferSlot:
    """Where a persistent buffer lives, so a reassigned buffer (``module.x = new``) is still found."""

    name: str
    module: torch.nn.Module
    attr: str

    def get(self) -> torch.Tensor:
        return self.module._buffers[self.attr]  # type: ignore[return-value]


@dataclass
class ModelSpec:
    manifest: Manifest
    params: dict[str, torch.nn.Parameter]
    """Every canonical model parameter by name."""
    optimized: list[tuple[str, torch.nn.Parameter]]
    """Optimizer parameters in state_dict index order."""
    buffers: list[BufferSlot]
    stored: Manifest | None = None
    """Under fully_shard on several ranks: the manifest of the stored shards (lowdiff._storage.layout.view)."""

    @property
    def stored_manifest(self) -> Manifest:
        """What the files this process writes list: the run's manifest, or its sharded layout's view."""
        return self.stored if self.stored is not None else self.manifest


def wrapper_chain(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and each module it wraps, to the innermost: through DDP (``module``) and ``torch.compile``
    (``_orig_mod``), in any nesting. The run records the innermost module's names (no ``module.`` or
    ``_orig_mod.`` prefix), so it does not depend on how the model was wrapped for training (torch's distributed
    checkpoint state dicts drop the same prefixes); the wrappers share its parameters and buffers."""
    chain = [model]
    while True:
        m = chain[-1]
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            inner = m.module
        elif type(m).__name__ == "OptimizedModule":  # torch._dynamo's, without importing torch._dynamo for it
            inner = getattr(m, "_orig_mod", None)
        else:
            return chain
        if not isinstance(inner, torch.nn.Module):
            return chain
        chain.append(inner)


def describe(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config) -> ModelSpec:
    sd = model.state_dict(keep_vars=True)
    canonical: dict[int, str] = {}
    keys: list[tuple[str, str]] = []
    param_specs, buffer_specs = [], []
    params: dict[str, torch.nn.Parameter] = {}
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"model state_dict entry {key!r} is a {type(t).__name__}; lowdiff checkpoints "
                                   "tensors only")
        if t.is_sparse or not t.is_contiguous() and not isinstance(t, torch.nn.Parameter):
            raise UnsupportedError(f"model state_dict entry {key!r} is sparse or non-contiguous")
        if id(t) not in canonical:
            canonical[id(t)] = key
            spec = TensorSpec(name=key, shape=tuple(t.shape), dtype=dtype_name(t.dtype),
                              requires_grad=bool(t.requires_grad))
            if isinstance(t, torch.nn.Parameter):
                param_specs.append(spec)
                params[key] = t
            else:
                buffer_specs.append(spec)
        keys.append((key, canonical[id(t)]))
    groups: list[list[str]] = []
    optimized: list[tuple[str, torch.nn.Parameter]] = []
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for pi, p in enumerate(group["params"]):
            name = canonical.get(id(p))
            if name is None or name not in params:
                raise ModelMismatchError(f"optimizer group {gi} parameter {pi} (shape {tuple(p.shape)}) is not a "
                                         "parameter of the model passed to lowdiff.wrap")
            names.append(name)
            optimized.append((name, p))
        groups.append(names)
    try:
        defaults = encode_value(dict(optimizer.defaults))
    except TypeError as e:
        raise UnsupportedError(f"optimizer defaults cannot be recorded: {e}") from e
    cls = type(optimizer)
    manifest = Manifest(params=param_specs, buffers=buffer_specs, state_dict_keys=keys,
                        optimizer_class=f"{cls.__module__}.{cls.__qualname__}", optimizer_defaults=defaults,
                        param_groups=groups, config=config.to_dict())
    buffer_names = {b.name for b in buffer_specs}
    slots = []
    for mod_name, module in model.named_modules():
        for attr, buf in module._buffers.items():
            full = f"{mod_name}.{attr}" if mod_name else attr
            if buf is not None and full in buffer_names:
                slots.append(BufferSlot(full, module, attr))
    return ModelSpec(manifest=manifest, params=params, optimized=optimized, buffers=slots)
