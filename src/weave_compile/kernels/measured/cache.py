"""The measured choice's cache: one answer per graph's sites and machine, on disk, never re-decided.

An entry holds what a group settled for one graph's signatures (:mod:`.choice`), under Inductor's
cache directory (``<cache_dir>/tokenweave_measured/<key>.json``). Its key covers everything that
shapes the timings: the :func:`hardware` fingerprint (GPU name and SM count, driver, CUDA and NCCL
versions and every ``NCCL_*`` variable, the group's size and ranks, the links between its
devices, torch and triton versions), Inductor's config and mode, the options that shape the op,
the source fingerprint of every candidate design and of this package (:mod:`..sources`), and the
digest of the signatures and candidates. A change to any of them is another key: an entry from
another machine, other versions or other code is never read, and an entry whose stored
fingerprint does not equal today's (a foreign or damaged file under a colliding name) is ignored
with a logged reason.

:func:`machine_digest` (the hardware fingerprint alone) is also part of the pass manager's cache
key, so Inductor's FX graph cache, shared between machines, never serves a graph whose choice was
measured on another machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from typing import Optional

import torch

from .. import registry, sources

log = logging.getLogger(__name__)

#: Bumped when an entry's meaning changes (what is timed, how it is settled).
FORMAT = 1
#: Environment variables whose values change what a collective or a kernel does.
_ENV_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_", "WEAVE_CE")


def _nvidia_driver() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def _device_facts(device_type: str, index: int) -> dict:
    if device_type != "cuda":
        return {"device": device_type, "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count()}
    props = torch.cuda.get_device_properties(index)
    count = torch.cuda.device_count()
    nccl = getattr(torch.cuda, "nccl", None)
    try:
        nccl_version = ".".join(map(str, nccl.version())) if nccl is not None else "none"
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl_version = "none"
    return {"device": "cuda", "name": props.name, "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "memory": props.total_memory,
            "driver": _nvidia_driver(), "cuda": torch.version.cuda, "nccl": nccl_version,
            # The links this process sees: peer access to every other visible device.
            "peer_access": [bool(torch.cuda.can_device_access_peer(index, j)) for j in range(count) if j != index]}


def hardware(device: torch.device, ranks: tuple[int, ...], backend: str) -> dict:
    """What the timings depend on besides the code and the options (module doc)."""
    facts = dict(_device_facts(device.type, device.index if device.index is not None else 0))
    facts.update({"ranks": list(ranks), "backend": backend,
                  "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
                  "torch": torch.__version__, "triton": _triton_version(), "python": platform.python_version()})
    return facts


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def machine_digest(device: Optional[torch.device] = None) -> str:
    """The hardware fingerprint of this process's device and environment (no group), for cache keys."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    facts = hardware(device, (), "")
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def inductor_config_digest() -> str:
    """A digest of Inductor's portable config, its custom passes and paths left out."""
    try:
        from torch._inductor import config as inductor_config

        cfg = inductor_config.save_config_portable()
    except Exception:  # noqa: BLE001 - an Inductor without it
        return "unknown"
    kept = {k: v for k, v in cfg.items() if "custom" not in k and not k.endswith(("path", "dir", "logpath"))}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def design_fingerprint(name: str) -> str:
    """The source fingerprint of a candidate (the site as written has none: plain torch's)."""
    if name in sources.DESIGN_SOURCES:
        return sources.source_fingerprint(name)
    try:
        import inspect

        return sources.file_fingerprint(inspect.getfile(registry.get(name).run))
    except (TypeError, OSError, ValueError):
        return "unknown"


def own_fingerprint() -> str:
    """This package's timing and settling code: an entry made by other code is another key."""
    here = os.path.dirname(os.path.abspath(__file__))
    texts = {}
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name)) as f:
                texts[name] = f.read()
    return sources.fingerprint(texts)


def fingerprint(device: torch.device, ranks: tuple[int, ...], backend: str, options: dict,
                candidates: list[str], digest: str) -> dict:
    """Everything an entry's key covers (module doc)."""
    return {"format": FORMAT, "hardware": hardware(device, ranks, backend), "inductor": inductor_config_digest(),
            "options": options, "code": own_fingerprint(),
            "designs": {c: design_fingerprint(c) for c in candidates if c in registry.names()},
            "digest": digest}


def key_of(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:32]


def directory() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts
        from torch._inductor.runtime.runtime_utils import cache_dir
    return os.path.join(cache_dir(), "tokenweave_measured")


def load(fp: dict) -> tuple[Optional[dict], str]:
    """``(answer or None, why not)`` of the entry for ``fp``."""
    path = os.path.join(directory(), key_of(fp) + ".json")
    try:
        with open(path) as f:
            entry = json.load(f)
    except FileNotFoundError:
        return None, "no cached entry"
    except (OSError, ValueError) as e:
        return None, f"cached entry unreadable ({e})"
    stored = json.loads(json.dumps(entry.get("fingerprint"), default=str))
    if stored != json.loads(json.dumps(fp, default=str)):
        return None, "cached entry made under another fingerprint: ignored"
    return entry.get("answer"), ""


def save(fp: dict, answer: dict) -> None:
    """Write the entry atomically (ranks sharing the directory write the same answer)."""
    try:
        os.makedirs(directory(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory())
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": fp, "answer": answer}, f, default=str)
        os.replace(tmp, os.path.join(directory(), key_of(fp) + ".json"))
    except OSError as e:  # an entry we cannot keep must not fail the compile
        log.warning("tokenweave: could not cache the measured choice: %s", e)


def entry_path(fp: dict) -> str:
    return os.path.join(directory(), key_of(fp) + ".json")
