"""The one place gradwire reaches its native data path (the optional distribution gradwire-native, native/).

`pip install gradwire` stays pure Python; `pip install 'gradwire[native]'` or `make install` adds the extension. It is
used only where it imports and its version is exactly gradwire's (the two are built from one tree; a stale build of
another version could disagree on the wire). `load()` says which, and why not.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import NamedTuple

from gradwire._version import VERSION
from gradwire.config import DATAPATHS
from gradwire.errors import ConfigError

log = logging.getLogger("gradwire.native")


class Native(NamedTuple):
    """The extension module where it can be used, else None and the reason."""

    module: ModuleType | None
    reason: str


@functools.cache
def load() -> Native:
    """Import gradwire_native once; never raises. Thread-safe (an import holds the import lock)."""
    try:
        module = importlib.import_module("gradwire_native")
    except ImportError as e:
        return Native(None, f"gradwire-native is not installed ({e}); `pip install 'gradwire[native]'` adds it")
    found = getattr(module, "__version__", "unknown")
    if found != VERSION:
        return Native(None, f"gradwire-native {found} does not match gradwire {VERSION}; reinstall it from this tree")
    return Native(module, f"gradwire-native {found}")


def for_datapath(datapath: str) -> ModuleType | None:
    """The extension a node's data path uses under GRADWIRE_DATAPATH=`datapath`, or None for the Python path.

    `auto`: native where it loads, else Python with one info line saying why; `native`: it must load (ConfigError
    saying why not); `python`: None. What the native path covers today: docs/native.md."""
    if datapath not in DATAPATHS:
        raise ConfigError(f"GRADWIRE_DATAPATH must be one of {', '.join(DATAPATHS)}, got {datapath!r}")
    if datapath == "python":
        return None
    loaded = load()
    if loaded.module is None and datapath == "native":
        raise ConfigError(f"GRADWIRE_DATAPATH=native, but {loaded.reason}")
    if loaded.module is None:
        _say_once(f"the Python data path: {loaded.reason}")
    return loaded.module


@functools.cache
def _say_once(line: str) -> None:
    log.info(line)


def require() -> ModuleType:
    """The extension module, or RuntimeError saying why it cannot be used."""
    native = load()
    if native.module is None:
        raise RuntimeError(native.reason)
    return native.module
