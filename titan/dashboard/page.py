"""The dashboard's static files, served from the installed package (no build step, nothing fetched)."""

from __future__ import annotations

from functools import cache
from importlib import resources

# Only these names are served: a request path never reaches the file system.
ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
PAGE = "dashboard.html"
STATIC_PREFIX = "/dashboard/static/"


@cache
def asset(name: str) -> tuple[bytes, str] | None:
    """(content, media type) of a known asset; None for any other name."""
    media_type = ASSETS.get(name)
    if media_type is None:
        return None
    return resources.files("titan.dashboard").joinpath("static", name).read_bytes(), media_type
