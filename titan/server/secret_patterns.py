"""The `api_key` guardrail's patterns: detect-secrets' provider detectors, plus the shapes it lacks.

detect-secrets (Yelp, pinned in pyproject) ships one `RegexBasedDetector` per provider, each with a
`denylist` of compiled `re` patterns. At start-up those patterns are joined into one `regex` pattern
(each keeps its own flags as a scoped group), so the streaming filter's partial matching holds text back
while any provider's key could still be forming. Only detectors whose patterns match a key's own shape
are used; the others need a source file's context or match ordinary prose:

- ArtifactoryDetector: `AP` + 9 letters matches capitalised words ("APPLICATION").
- JwtTokenDetector: its lazy tail would redact a token's header and leave its signature.
- NpmDetector: its `.+` would hold back the rest of every line holding `//` (every URL).
- KeywordDetector, the high-entropy, IBM, Cloudant and Softlayer detectors: variable names or entropy.
- IPPublicDetector: addresses are not secrets.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable

# detect-secrets module (under detect_secrets.plugins) and detector class.
DETECTORS = {
    "AWSKeyDetector": "aws",
    "AzureStorageKeyDetector": "azure_storage_key",
    "BasicAuthDetector": "basic_auth",
    "DiscordBotTokenDetector": "discord",
    "GitHubTokenDetector": "github_token",
    "GitLabTokenDetector": "gitlab_token",
    "MailchimpDetector": "mailchimp",
    "OpenAIDetector": "openai",
    "PrivateKeyDetector": "private_key",
    "PypiTokenDetector": "pypi_token",
    "SendGridDetector": "sendgrid",
    "SlackDetector": "slack",
    "SquareOAuthDetector": "square_oauth",
    "StripeDetector": "stripe",
    "TelegramBotTokenDetector": "telegram_token",
    "TwilioKeyDetector": "twilio",
}
# Shapes detect-secrets 1.5 has no detector for, and a private key's whole block (its detector matches the
# BEGIN line only: redacting that alone would let the key itself out).
TITAN_PATTERNS = (
    r"sk-[A-Za-z0-9_-]{20,}",  # OpenAI project / service-account keys (detect-secrets knows the legacy shape only)
    r"AIza[0-9A-Za-z_-]{35}",  # Google API keys
    r"-----BEGIN[A-Z ]*PRIVATE KEY(?: BLOCK)?-----[A-Za-z0-9+/=\s]*(?:-----END[A-Z ]*PRIVATE KEY(?: BLOCK)?-----)?",
)
_SCOPED_FLAGS = ((re.IGNORECASE, "i"), (re.MULTILINE, "m"), (re.DOTALL, "s"), (re.VERBOSE, "x"))


class UnknownDetector(ValueError):
    pass


def detector_patterns(names: Iterable[str]) -> list[str]:
    """Each named detector's denylist, as `regex` source with its flags scoped to it."""
    sources = []
    for name in names:
        module = DETECTORS.get(name)
        if module is None:
            raise UnknownDetector(f"unknown detector {name!r} (known: {', '.join(DETECTORS)})")
        detector = getattr(importlib.import_module(f"detect_secrets.plugins.{module}"), name)
        for pattern in detector.denylist:
            flags = "".join(letter for flag, letter in _SCOPED_FLAGS if pattern.flags & flag)
            sources.append(f"(?{flags}:{pattern.pattern})" if flags else f"(?:{pattern.pattern})")
    return sources


def secret_pattern(names: Iterable[str] | None = None) -> str:
    """One alternation: Titan's patterns first (the private-key block must win over its BEGIN line)."""
    chosen = DETECTORS if names is None else names
    return "|".join([*(f"(?:{p})" for p in TITAN_PATTERNS), *detector_patterns(chosen)])
