"""Guardrails: input and output filters from one YAML file (`--guardrails PATH`).

```yaml
input:
  - {filter: prompt_injection, action: block}
  - {filter: email, action: flag}
output:
  - {filter: email, action: redact}
  - {filter: card_number, action: block}
  - {filter: blocklist, words: [forbidden phrase], action: block}
```

Filters: `email`, `phone` (validated by `phonenumbers`, `region` for numbers without +), `card_number`
(Luhn), `iban` (ISO 13616 mod 97), `api_key` (the key shapes of detect-secrets' provider detectors, e.g.
AWS, GitHub, GitLab, Slack, Stripe, Twilio, private keys, and a few it lacks: secret_patterns.py),
`prompt_injection` (phrases that try to override the instructions), `blocklist` (`words`). Actions:
`block` (input: 400 `content_filter`; output: the text stops before the match, finish_reason
`content_filter`), `redact` (output only: the match leaves the server as `[REDACTED:filter]`; the engine
computes the same tokens either way) and `flag` (header `X-Titan-Guardrail` where headers are still
possible, and `titan:guardrail_matches_total` always).

Streaming: each choice's text passes through an `OutputFilter` that holds back text only while a match
could still be forming at its end (a partial regex match, as stop strings are held), so nothing a filter
would block or redact ever reaches a chunk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import phonenumbers
import regex
import yaml

ACTIONS = ("block", "redact", "flag")
FLAG_HEADER = "X-Titan-Guardrail"


class GuardrailsConfigError(ValueError):
    pass


def luhn(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for position, digit in enumerate(reversed(digits)):
        if position % 2 == 1:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return total % 10 == 0


def iban_valid(candidate: str) -> bool:
    text = candidate.replace(" ", "").upper()
    if not 15 <= len(text) <= 34:
        return False
    rotated = text[4:] + text[:4]
    number = "".join(str(int(c, 36)) for c in rotated)
    return int(number) % 97 == 1


def phone_valid(region: str) -> Callable[[str], bool]:
    def check(candidate: str) -> bool:
        return any(True for _ in phonenumbers.PhoneNumberMatcher(candidate, region))
    return check


def _always(_: str) -> bool:
    return True


INJECTION_PATTERNS = (
    r"(?:ignore|disregard|forget) (?:all |any |the |your )*(?:previous|prior|above|earlier|system) "
    r"(?:instructions|prompts?|rules|messages)",
    r"(?:reveal|print|show|repeat|output) (?:me )?(?:your|the) "
    r"(?:system prompt|hidden instructions|initial instructions)",
    r"you are now (?:DAN|in developer mode|jailbroken|unrestricted)",
    r"(?:pretend|act as if) (?:you have|there are) no (?:rules|restrictions|guidelines)",
)


@dataclass(frozen=True)
class Rule:
    name: str  # the metrics label and what redaction writes
    pattern: Any  # a compiled `regex` pattern (partial matching)
    validate: Callable[[str], bool]
    action: str


def build_rule(entry: dict[str, Any], stage: str) -> Rule:
    kind = entry.get("filter")
    action = entry.get("action", "block")
    if action not in ACTIONS:
        raise GuardrailsConfigError(f"{stage} filter {kind}: action must be one of {', '.join(ACTIONS)}")
    if stage == "input" and action == "redact":
        raise GuardrailsConfigError(f"input filter {kind}: redact applies to output only (redaction never changes "
                                    "what the engine computes); use block or flag")
    flags = regex.IGNORECASE
    if kind == "email":
        pattern, check = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", _always
    elif kind == "phone":
        pattern, check = r"\+?\(?\d[\d ().-]{5,18}\d", phone_valid(str(entry.get("region", "US")))
    elif kind == "card_number":
        pattern, check = r"\b(?:\d[ -]?){12,18}\d\b", luhn
    elif kind == "iban":
        pattern, check, flags = r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b", iban_valid, 0
    elif kind == "api_key":
        pattern, check, flags = api_key_pattern(entry), _always, 0
    elif kind == "prompt_injection":
        pattern, check = "|".join(f"(?:{p})" for p in INJECTION_PATTERNS), _always
    elif kind == "blocklist":
        words = entry.get("words")
        if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
            raise GuardrailsConfigError(f"{stage} filter blocklist needs a non-empty list of words")
        pattern, check = "|".join(blocklist_pattern(word) for word in words), _always
    else:
        raise GuardrailsConfigError(f"{stage}: unknown filter {kind!r}")
    return Rule(str(entry.get("name", kind)), regex.compile(pattern, flags), check, action)


def blocklist_pattern(word: str) -> str:
    """A blocklisted word or phrase as a whole word: any run of whitespace between its words, and a word
    boundary only at an end that is a word character (`\\b` beside "C++" or "secret!" never matched)."""
    body = r"\s+".join(regex.escape(part) for part in word.split())
    start = r"(?<!\w)" if regex.match(r"\w", word.strip()) else ""
    end = r"(?!\w)" if regex.search(r"\w$", word.strip()) else ""
    return f"(?:{start}{body}{end})"


def api_key_pattern(entry: dict[str, Any]) -> str:
    """detect-secrets' provider detectors (all Titan uses, or the entry's `detectors` list) and Titan's few."""
    from titan.server.secret_patterns import UnknownDetector, secret_pattern  # imports detect-secrets

    names = entry.get("detectors")
    if names is not None and (not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)):
        raise GuardrailsConfigError("filter api_key: detectors must be a non-empty list of detector names")
    try:
        return secret_pattern(names)
    except UnknownDetector as error:
        raise GuardrailsConfigError(f"filter api_key: {error}") from error


@dataclass(frozen=True)
class Guardrails:
    input: tuple[Rule, ...] = ()
    output: tuple[Rule, ...] = ()
    output_digest: str = ""  # of the output rules as configured: part of the caches' keys


def load_guardrails(path: str | Path) -> Guardrails:
    try:
        document = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise GuardrailsConfigError(f"not valid YAML: {error}") from error
    if not isinstance(document, dict) or set(document) - {"input", "output"}:
        raise GuardrailsConfigError("the file must be a mapping with `input` and/or `output` lists")
    stages: dict[str, tuple[Rule, ...]] = {}
    for stage in ("input", "output"):
        entries = document.get(stage) or []
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise GuardrailsConfigError(f"{stage} must be a list of filters")
        stages[stage] = tuple(build_rule(entry, stage) for entry in entries)
    configured = json.dumps(document.get("output") or [], sort_keys=True, default=str)
    return Guardrails(stages["input"], stages["output"], hashlib.sha256(configured.encode()).hexdigest()[:16])


@dataclass(frozen=True)
class Match:
    start: int
    end: int
    rule: Rule


def growing(rule: Rule, text: str, start: int, end: int) -> int | None:
    """The first position in [start, end] where the rest of `text` is a match still forming (or complete).

    `regex` prefers a complete match to a partial one that starts earlier (a key's BEGIN line found whole
    while the longer block pattern, from the dashes before it, is still forming): so look before it too."""
    return next((q for q in range(start, end + 1) if rule.pattern.fullmatch(text, q, partial=True)), None)


def scan(rules: tuple[Rule, ...], text: str, final: bool, start: int = 0) -> tuple[list[Match], int]:
    """Complete matches in `text` from `start` (what comes before is context a lookbehind sees), and where
    text must be held back from (len(text): nothing held)."""
    hold = len(text)
    found: list[Match] = []
    for rule in rules:
        position = start
        while position <= len(text):
            match = rule.pattern.search(text, position, partial=not final)
            if match is None:
                break
            # The text from here to the end may still grow into a (longer, or valid) match: wait for more.
            forming = match.start() if match.partial else None if final else growing(rule, text, position,
                                                                                     match.start())
            if forming is not None:
                hold = min(hold, forming)
                break
            if match.end() > match.start() and rule.validate(match.group()):
                found.append(Match(match.start(), match.end(), rule))
                position = match.end()
            else:
                position = match.start() + 1
    # A match that straddles another rule's hold point is decided once the held text is known.
    for match in found:
        if match.start < hold < match.end:
            hold = match.start
    return sorted((m for m in found if m.end <= hold), key=lambda m: m.start), hold


def check_input(rules: tuple[Rule, ...], text: str) -> list[Match]:
    return scan(rules, text, final=True)[0]


@dataclass
class OutputFilter:
    """One choice's text on its way out: `feed` each delta, get back what may be released now."""

    rules: tuple[Rule, ...]
    pending: str = ""
    # The text's character before `pending`, already released: a blocklist word's start sees it, as it does in
    # the whole text (at the start of the pending text, "notsecret!" matched "secret!" in a stream only).
    before: str = ""
    released: list[str] = field(default_factory=list)
    blocked: Rule | None = None
    matches: list[Match] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> str:
        if self.blocked is not None:
            return ""
        buffer = self.pending + text
        lead = len(self.before)
        found, hold = scan(self.rules, self.before + buffer, final, lead)
        found, hold = [Match(m.start - lead, m.end - lead, m.rule) for m in found], hold - lead
        out: list[str] = []
        cursor = 0
        for match in found:
            if match.start < cursor:
                continue  # overlaps a span already redacted
            self.matches.append(match)
            if match.rule.action == "flag":
                continue
            out.append(buffer[cursor:match.start])
            if match.rule.action == "block":
                self.blocked = match.rule
                self.pending = ""
                release = "".join(out)
                self.released.append(release)
                return release
            out.append(f"[REDACTED:{match.rule.name}]")
            cursor = match.end
        out.append(buffer[cursor:hold])
        self.before = buffer[hold - 1] if hold > 0 else self.before
        self.pending = buffer[hold:]
        release = "".join(out)
        self.released.append(release)
        return release

    @property
    def text(self) -> str:
        return "".join(self.released)
