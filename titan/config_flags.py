"""Flags and `LLM(...)` keyword arguments, derived from the config dataclasses' field metadata.

Every `option(...)` field of EngineConfig and of its sections becomes `--flag-name` (the field name, or
the metadata's `flag`), with its type, default, choices and help; the same flat names are the keyword
arguments of `LLM(...)` and `engine_config(...)`. Adding a knob means adding one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from titan.config import AdmissionConfig, CacheConfig, EngineConfig, SchedulerConfig

# EngineConfig field → (section dataclass, argparse group title); the rest of EngineConfig is "engine".
SECTIONS: dict[str, tuple[type, str]] = {
    "cache": (CacheConfig, "KV cache"),
    "scheduler": (SchedulerConfig, "scheduling"),
    "admission": (AdmissionConfig, "admission control (HTTP 429 when exceeded)"),
}


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    name: str  # flat name: keyword argument and --flag (underscores → dashes)
    section: str | None  # EngineConfig field holding it; None for EngineConfig's own fields
    field_name: str
    type: type
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None


def _specs_of(cls: type, section: str | None) -> list[FlagSpec]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        kind, optional = _unwrap(hints[f.name])
        specs.append(FlagSpec(f.metadata["flag"] or f.name, section, f.name, kind, optional, f.default,
                              f.metadata["help"], f.metadata["choices"]))
    return specs


def _unwrap(hint: Any) -> tuple[type, bool]:
    """`int | None` → (int, True); `int` → (int, False)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return members[0], True
    return hint, False


FLAGS: list[FlagSpec] = _specs_of(EngineConfig, None) + [
    spec for section, (cls, _) in SECTIONS.items() for spec in _specs_of(cls, section)]
FLAG_NAMES = frozenset(spec.name for spec in FLAGS)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    groups = {None: parser.add_argument_group("engine")}
    groups.update({section: parser.add_argument_group(title) for section, (_, title) in SECTIONS.items()})
    for spec in FLAGS:
        flag = "--" + spec.name.replace("_", "-")
        group = groups[spec.section]
        if spec.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default, help=spec.help)
        elif hasattr(spec.type, "parse"):  # a JSON-valued flag (--speculative-config)
            group.add_argument(flag, type=_json_flag(spec.type), default=spec.default, help=spec.help)
        else:
            group.add_argument(flag, type=spec.type, default=spec.default, choices=spec.choices, help=spec.help)


def _json_flag(kind: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            return kind.parse(text)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from error
    parse.__name__ = kind.__name__
    return parse


def engine_config(model: str = "default", **options: Any) -> EngineConfig:
    """Flat keyword arguments (the flags' names) → the typed nested config; unknown names are an error."""
    unknown = sorted(set(options) - FLAG_NAMES)
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(FLAG_NAMES))}")
    top: dict[str, Any] = {"model": model}
    sections: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for spec in FLAGS:
        if spec.name in options and spec.name != "model":
            target = top if spec.section is None else sections[spec.section]
            target[spec.field_name] = options[spec.name]
    for section, (cls, _) in SECTIONS.items():
        top[section] = cls(**sections[section])
    return EngineConfig(**top)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config(**{spec.name: getattr(args, spec.name) for spec in FLAGS})
