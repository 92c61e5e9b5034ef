"""Where every benchmark leaves its numbers: one JSON file, parent folders created."""

import json
from pathlib import Path
from typing import Any


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
