"""Test-wide settings: never touch a model hub, and keep converted models in one local cache."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TITAN_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".titan-cache"))
