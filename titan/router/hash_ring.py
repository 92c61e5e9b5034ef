"""A consistent-hash ring: each backend owns many points on a 64-bit circle; a key belongs to the owner
of the first point at or after its own hash, and falls to the next owner round the circle when that one
cannot take it. Removing a backend moves only the keys it owned; adding one takes ~1/n of the keys, all
to the newcomer. Points depend on backend names only, so every router replica builds the same ring.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence

# Enough points per backend that each owns close to 1/n of the circle (about ±10% at 160).
DEFAULT_VIRTUAL_NODES = 160


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        points = sorted((hash64(f"{name}#{replica}".encode()), name)
                        for name in names for replica in range(virtual_nodes))
        self.positions = [position for position, _ in points]
        self.owners = [name for _, name in points]
        self.num_names = len(set(names))

    def walk(self, key: bytes) -> Iterator[str]:
        """Backend names in ring order from the key's position, each once: the owner first."""
        if not self.positions:
            return
        start = bisect.bisect_left(self.positions, hash64(key))
        seen: set[str] = set()
        count = len(self.positions)
        for offset in range(count):
            owner = self.owners[(start + offset) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == self.num_names:
                    return

    def owner(self, key: bytes) -> str | None:
        return next(self.walk(key), None)
