"""The one definition of where on-disk caches live (weights, compiled components, builds)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Root of on-disk caches; `$PIE_CACHE_DIR` overrides the default `~/.cache/pie-python`."""
    return Path(os.environ.get("PIE_CACHE_DIR", Path.home() / ".cache" / "pie-python"))
