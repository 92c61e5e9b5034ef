"""The installed package's version (light: the CLI reads it on every run)."""

from __future__ import annotations

import importlib.metadata


def titan_version() -> str:
    try:
        return importlib.metadata.version("titan")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
