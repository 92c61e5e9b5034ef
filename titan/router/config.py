"""Router settings: defaults, overridden by a YAML file (`--config`), overridden by flags.

The YAML file uses the flags' names with underscores, plus `backends` (a list of URLs, or of
`{url: ..., name: ...}` mappings):

    policy: prefix-affinity
    port: 8080
    backends:
      - http://titan-0.titan:8000
      - {url: http://titan-1.titan:8000, name: titan-1}
    prefix_chars: 256
    health_interval: 1.0
    # Follow a headless Service's pods (discovery.py): every address its DNS name resolves to is a backend.
    discover_dns: [titan-headless.default.svc.cluster.local:8000]   # or one string
    # With model pools, a name may feed one: [primary=titan-headless:8000, fallback=titan-small-headless:8000]
    discover_interval: 5.0

`--backend` and `--discover-dns` flags replace the file's list rather than adding to it, like every other flag.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

POLICIES = ("score", "round-robin", "least-load", "prefix-affinity")
ADDRESS_FAMILIES = ("any", "ipv4", "ipv6")
# A DNS name (letters, digits, '-', '_', dots) or an IP literal (IPv6 given in brackets).
DNS_HOST = re.compile(r"[a-z0-9_.-]+|[0-9a-f:.]+")
DEFAULT_PORT = 8080


class ConfigError(ValueError):
    """A setting that cannot work; the CLI prints it and exits 2."""


@dataclass(frozen=True)
class BackendSpec:
    url: str  # the server's root, e.g. http://10.0.0.5:8000 (a trailing /v1 is dropped)
    name: str  # the `backend` label in metrics and logs; host:port unless given
    pool: str | None = None  # model pool (degrade.py): primary | fallback; None without --pool


@dataclass(frozen=True)
class DnsTarget:
    """A DNS name whose addresses are the backends, each serving plain HTTP on `port`."""

    host: str
    port: int
    pool: str | None = None  # model pool (degrade.py) its backends join; None without --pool

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class RouterConfig:
    backends: list[BackendSpec] = field(default_factory=list)
    # Discovery: each name is resolved every `discover_interval` seconds; its A/AAAA records (of
    # `discover_family`) join and leave the pool as they appear in and vanish from the answer.
    discover_dns: list[DnsTarget] = field(default_factory=list)
    discover_interval: float = 5.0
    discover_family: str = "any"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    policy: str = "score"
    # prefix-affinity: the key is the prompt's first `prefix_chars` characters in whole `chunk_chars` chunks.
    prefix_chars: int = 256
    chunk_chars: int = 64
    # Bounded load: a backend takes its keys while it has fewer outstanding requests than
    # max(ceil(load_factor * mean after adding this one), min_load).
    load_factor: float = 1.25
    min_load: int = 4
    # score (scoring.py): weights of the scorers, prompt characters hashed into blocks, blocks remembered per backend.
    score_prefix_weight: float = 1.0
    score_ttft_weight: float = 2.0
    score_queue_weight: float = 0.5
    score_kv_weight: float = 0.25
    score_prefix_chars: int = 16384
    score_blocks_per_backend: int = 32768
    health_interval: float = 1.0  # seconds between readiness polls (and load scrapes) of each backend
    health_timeout: float = 5.0
    connect_timeout: float = 3.0
    read_timeout: float = 600.0  # longest silence from a backend: a whole non-streamed generation
    retries: int = 1  # further backends tried when one fails before its first byte
    max_request_body_bytes: int = 8 * 2**20
    drain_timeout: float = 25.0  # on SIGTERM, seconds open requests get before connections are closed
    access_log: bool = False
    seed: int | None = None  # for least-load's random choices (tests)
    # Live dashboard (GET /dashboard; its data at /debug/dashboard needs this key when one is given).
    debug_api_key_file: str | None = None
    dashboard_window: float = 30.0
    dashboard_history: int = 600
    dashboard_max_spikes: int = 50
    # Model pools (degrade.py): a request's class SLO on the primary's predicted TTFT, in milliseconds.
    interactive_ttft_slo_ms: float = 2000.0
    batch_ttft_slo_ms: float = 8000.0

    def validate(self) -> RouterConfig:
        if not self.backends and not self.discover_dns:
            raise ConfigError("no backends: give --backend URL or --discover-dns HOST:PORT (both repeatable), "
                              "or 'backends:' / 'discover_dns:' in --config")
        targets = [str(target) for target in self.discover_dns]
        repeated = sorted({target for target in targets if targets.count(target) > 1})
        if repeated:
            raise ConfigError(f"discover_dns lists {', '.join(repeated)} more than once")
        if self.discover_family not in ADDRESS_FAMILIES:
            raise ConfigError(f"unknown discover_family {self.discover_family!r}; choose from "
                              f"{', '.join(ADDRESS_FAMILIES)}")
        names = [backend.name for backend in self.backends]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"backend names must be unique: {', '.join(duplicates)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.prefix_chars < 1 or self.chunk_chars < 1 or self.chunk_chars > self.prefix_chars:
            raise ConfigError("need 1 <= chunk_chars <= prefix_chars")
        if self.load_factor < 1.0:
            raise ConfigError("load_factor must be at least 1 (1 = perfectly even, no affinity under load)")
        if self.min_load < 1 or self.retries < 0:
            raise ConfigError("min_load must be at least 1 and retries at least 0")
        if min(self.score_prefix_weight, self.score_ttft_weight, self.score_queue_weight, self.score_kv_weight) < 0:
            raise ConfigError("score weights must not be negative")
        if self.score_prefix_chars < self.chunk_chars or self.score_blocks_per_backend < 1:
            raise ConfigError("need score_prefix_chars >= chunk_chars and score_blocks_per_backend >= 1")
        # --backend URLs and unnamed --discover-dns names join primary.
        sources = [*self.backends, *self.discover_dns]
        if any(source.pool for source in sources):
            if {source.pool or "primary" for source in sources} != {"primary", "fallback"}:
                raise ConfigError("pools are named primary and fallback, and both need a backend or a DNS name "
                                  "(--pool primary=URL[,URL] --pool fallback=URL[,URL], "
                                  "--discover-dns fallback=HOST:PORT)")
            self.backends = in_a_pool(self.backends)
            self.discover_dns = in_a_pool(self.discover_dns)
        if self.dashboard_history < 2 or self.dashboard_max_spikes < 1:
            raise ConfigError("need dashboard_history >= 2 and dashboard_max_spikes >= 1")
        for name in ("health_interval", "health_timeout", "connect_timeout", "read_timeout", "discover_interval",
                     "dashboard_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        return self


Pooled = TypeVar("Pooled", BackendSpec, DnsTarget)


def in_a_pool(sources: list[Pooled]) -> list[Pooled]:
    """Each backend or DNS name with its pool, primary where none was named."""
    return [source if source.pool else dataclasses.replace(source, pool="primary") for source in sources]


def parse_backend(entry: Any) -> BackendSpec:
    """A URL string or a {url, name} mapping → BackendSpec with a normalized URL."""
    if isinstance(entry, dict):
        unknown = set(entry) - {"url", "name"}
        if unknown or "url" not in entry:
            raise ConfigError(f"a backend mapping takes 'url' and optional 'name', got {sorted(entry)}")
        url, name = str(entry["url"]), entry.get("name")
    elif isinstance(entry, str):
        url, name = entry, None
    else:
        raise ConfigError(f"a backend is a URL or a {{url, name}} mapping, got {entry!r}")
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):  # OpenAI clients' base URLs end in /v1; the router adds the API path itself
        url = url[: -len("/v1")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"not an http(s) URL: {entry!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"a backend URL takes no query or fragment: {entry!r}")
    return BackendSpec(url, str(name) if name else parts.netloc)


def parse_pools(entries: list[Any]) -> list[BackendSpec]:
    """`NAME=URL[,URL...]` strings → backends labelled with their pool."""
    specs = []
    for entry in entries:
        if not isinstance(entry, str) or "=" not in entry:
            raise ConfigError(f"a pool is NAME=URL[,URL...], got {entry!r}")
        name, urls = entry.split("=", 1)
        name = name.strip()
        if not urls.strip():
            raise ConfigError(f"pool {name!r} names no backend")
        specs.extend(dataclasses.replace(parse_backend(url), pool=name) for url in urls.split(","))
    return specs


def parse_dns_target(entry: Any) -> DnsTarget:
    """`[POOL=]HOST:PORT` (IPv6 literals in brackets) → DnsTarget; the port is required (Titan's is 8000, not
    80); POOL names the model pool its backends join."""
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"a discover_dns entry is a 'HOST:PORT' string, got {entry!r}")
    pool, _, text = entry.strip().rpartition("=")
    pool, text = pool.strip() or None, text.strip()
    if pool is not None and pool not in ("primary", "fallback"):
        raise ConfigError(f"a discover_dns entry's pool is primary or fallback, got {entry!r}")
    if "://" in text or "/" in text:
        raise ConfigError(f"discover_dns takes HOST:PORT, without a scheme or path (backends are plain http): "
                          f"{entry!r}")
    try:
        parts = urlsplit("//" + text)
        port = parts.port
    except ValueError as error:
        raise ConfigError(f"bad discover_dns entry {entry!r}: {error}") from error
    host = parts.hostname
    if host and not DNS_HOST.fullmatch(host):
        raise ConfigError(f"bad host name in discover_dns entry {entry!r}")
    if not host or port is None or port == 0 or parts.username is not None or parts.query or parts.fragment:
        raise ConfigError(f"discover_dns takes HOST:PORT, e.g. titan-headless.default.svc.cluster.local:8000, "
                          f"got {entry!r}")
    return DnsTarget(host, port, pool)


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml  # PyYAML arrives with gguf; only needed here

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level")
    return data


def number(name: str, value: Any, kind: type[int] | type[float]) -> int | float:
    try:
        if isinstance(value, bool):
            raise ValueError
        converted = float(value)
        if kind is int and not converted.is_integer():
            raise ValueError
        return kind(converted)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from error


def build_config(file_settings: dict[str, Any], flag_settings: dict[str, Any]) -> RouterConfig:
    """Defaults ← file ← flags (flags that were not given are None and change nothing)."""
    known = {item.name for item in dataclasses.fields(RouterConfig)} | {"pools"}
    unknown = sorted(set(file_settings) - known)
    if unknown:
        raise ConfigError(f"unknown settings in the config file: {', '.join(unknown)}")
    merged = dict(file_settings)
    merged.update({name: value for name, value in flag_settings.items() if value is not None})
    backends = merged.pop("backends", None) or []
    if not isinstance(backends, list):
        raise ConfigError("'backends' must be a list")
    pools = merged.pop("pools", None) or []
    if not isinstance(pools, list):
        raise ConfigError("'pools' must be a list of NAME=URL[,URL...] strings")
    targets = merged.pop("discover_dns", None) or []
    if isinstance(targets, str):  # one name needs no list
        targets = [targets]
    if not isinstance(targets, list):
        raise ConfigError("'discover_dns' must be a HOST:PORT string or a list of them")
    config = RouterConfig(backends=[parse_backend(entry) for entry in backends] + parse_pools(pools),
                          discover_dns=[parse_dns_target(entry) for entry in targets])
    defaults = RouterConfig()
    for name, value in merged.items():
        default = getattr(defaults, name)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r}")
        elif isinstance(default, int | float) or (name == "seed" and value is not None):
            value = number(name, value, float if isinstance(default, float) else int)
        elif not isinstance(value, type(default)) and default is not None:
            raise ConfigError(f"{name} must be a {type(default).__name__}, got {value!r}")
        setattr(config, name, value)
    return config.validate()
