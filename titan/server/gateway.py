"""What sits between HTTP and the engine for one request: tenant checks, input and output guardrails,
the result and semantic caches, and the tenant's token charge.

`handle_generation` asks the `Gateway` (on `app.state.gateway`, None when no feature is on) for a
`RequestPlan` once the prompts are tokenized; the plan answers from a cache or lets the request run,
filters what leaves, stores the response and charges its tokens. Nothing here touches engine state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import Request

from titan.engine.outputs import RequestOutput
from titan.server.cache_store import CacheStore
from titan.server.coalesce import Flight, Flights
from titan.server.errors import APIError
from titan.server.gateway_metrics import GatewayMetrics
from titan.server.guardrails import FLAG_HEADER, Guardrails, OutputFilter, check_input
from titan.server.result_cache import CACHE_HEADER, cache_key, decode_entry, deterministic, encode_entry
from titan.server.serving import PRIORITY_CLASSES, wants_timeline
from titan.server.tenant_quota import Quota
from titan.server.tenants import RequestQuota, Tenant, quota_of, tenant_of

if TYPE_CHECKING:
    from titan.engine.llm_engine import EngineInfo
    from titan.server.generation import GenerationRoute, Prepared
    from titan.server.semantic_cache import SemanticCache

logger = logging.getLogger("titan.server")


def content_filtered(message: str, param: str) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code="content_filter")


@dataclass
class Gateway:
    metrics: GatewayMetrics
    store: CacheStore | None = None  # the result cache's store; None: no result cache
    ttl_seconds: float = 300.0
    shared: bool = False  # cache entries shared across tenants
    guardrails: Guardrails | None = None
    semantic: SemanticCache | None = None
    quota: Quota | None = None  # where tenants' token buckets live (None: in-process)
    flights: Flights | None = None  # identical deterministic requests in flight (None: not coalesced)
    # Keys isolated tenants' prefix-cache namespaces; the cache lives in this process, so this may too.
    salt_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def start(self) -> None:
        if self.semantic is not None:
            self.semantic.start()

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        if self.semantic is not None:
            await self.semantic.close()
        if self.quota is not None:
            await self.quota.close()

    def tenant(self, request: Request) -> Tenant | None:
        return tenant_of(request.scope)

    def admit(self, request: Request, route: GenerationRoute, model: str, info: EngineInfo) -> list[str]:
        """Tenant model allow-list, then the input filters (400 on block); returns the input flags."""
        tenant = self.tenant(request)
        if tenant is not None:
            tenant.check_model(model)
        if self.guardrails is None or not self.guardrails.input:
            return []
        texts = input_texts(route, info)
        param = "messages" if hasattr(route.body, "messages") else "prompt"
        flags: list[str] = []
        for text in texts:
            for match in check_input(self.guardrails.input, text):
                rule = match.rule
                self.metrics.guardrail_matches.labels(rule.name, "input", rule.action).inc()
                if rule.action == "block":
                    raise content_filtered(f"The input was refused by the {rule.name} filter.", param)
                flags.append(f"input:{rule.name}")
        return sorted(set(flags))

    def cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The request's prefix-cache salt: an isolated tenant's own namespace (keyed by a secret of this
        process, so no client can name it in its cache_salt), with the request's salt inside it."""
        tenant = self.tenant(request)
        if tenant is None or not tenant.spec.isolate_prefix_cache:
            return salt
        namespace = hmac.new(self.salt_secret, tenant.spec.tenant.encode(), hashlib.sha256).hexdigest()
        return f"tenant:{namespace}" + ("" if salt is None else f":{salt}")

    def priority(self, request: Request, priority: int) -> int:
        """A tenant's class is a floor: a batch tenant cannot ask for interactive priority."""
        tenant = self.tenant(request)
        if tenant is None or tenant.spec.priority is None:
            return priority
        return max(priority, PRIORITY_CLASSES[tenant.spec.priority])

    async def plan(self, request: Request, route: GenerationRoute, prepared: Prepared, info: EngineInfo,
                   model: str, input_flags: list[str]) -> RequestPlan:
        body = route.body
        tenant = self.tenant(request)
        plan = RequestPlan(self, tenant, input_flags, quota_of(request.scope))
        if self.guardrails is not None and self.guardrails.output:
            if route.wants_logprobs():
                raise APIError(HTTPStatus.BAD_REQUEST, "logprobs cannot be combined with output guardrails (they "
                               "would reveal filtered text)", param="logprobs", code="unsupported_parameter")
            if body.return_token_ids:
                raise APIError(HTTPStatus.BAD_REQUEST, "return_token_ids cannot be combined with output guardrails "
                               "(the ids would reveal filtered text)", param="return_token_ids",
                               code="unsupported_parameter")
            plan.filters = {choice.index: OutputFilter(self.guardrails.output) for choice in prepared.choices}
        # A stored reply keeps its choices' text, not the token ids a return_token_ids request wants back, nor
        # the timeline asked for in the body or by header (by header, a hit came back without it).
        opted_out = (getattr(body, "titan_cache", None) is False or body.return_token_ids
                     or wants_timeline(body.titan_timeline, request.headers))
        cacheable = not opted_out and all(deterministic(choice.params) for choice in prepared.choices)
        scope = "*" if self.shared or tenant is None else f"tenant:{tenant.name}"
        if self.guardrails is not None and self.guardrails.output:
            # Replies stored under other output rules (a restart, a replica sharing the Redis) are not these
            # rules' replies: a hit skipped the filters and served what they would block.
            scope += f"|output-rules:{self.guardrails.output_digest}"
        if self.store is not None:
            if not cacheable:
                self.metrics.cache_requests.labels("result", "skip").inc()
            else:
                dumped = body.model_dump(mode="json", exclude_none=True) | dict(body.model_extra or {})
                prompts = [choice.prompt_token_ids for choice in prepared.choices]
                plan.key = cache_key(scope, model, route.object, dumped, prompts, info.sampling_defaults)
                started = time.perf_counter()
                raw = await self.store.get(plan.key)
                self.metrics.cache_lookup.labels("result").observe(time.perf_counter() - started)
                entry = decode_entry(raw) if raw is not None else None
                kind = "hit"
                if entry is None and self.flights is not None:  # the same request may be running now
                    entry, kind = await self.flights.follow(plan.key), "coalesced"
                    if entry is None:
                        plan.flight = self.flights.lead(plan.key, request.scope)
                self.metrics.cache_requests.labels("result", kind if entry else "miss").inc()
                if entry is not None:
                    plan.hit, plan.hit_kind = entry, kind
                    self.metrics.cache_tokens_saved.labels("result").inc(entry["usage"]["total_tokens"])
                    return plan
        if getattr(body, "titan_semantic_cache", False) and not opted_out:
            if self.semantic is None:
                raise semantic_unavailable("this server runs without --semantic-cache")
            plan.semantic_key = self.semantic.scope_of(scope, model, route, info)
            if plan.semantic_key is None:
                raise semantic_unavailable("it needs one text prompt, or a conversation ending with a user message")
            entry = await self.semantic.lookup(plan.semantic_key, route)
            if entry is not None:
                plan.hit, plan.hit_kind = entry, "semantic-hit"
                self.metrics.cache_tokens_saved.labels("semantic").inc(entry["usage"]["total_tokens"])
        return plan


def semantic_unavailable(why: str) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, f"titan_semantic_cache cannot be honoured: {why}.",
                    param="titan_semantic_cache", code="unsupported_parameter")


def input_texts(route: GenerationRoute, info: EngineInfo) -> list[str]:
    body: Any = route.body
    if hasattr(body, "messages"):
        return [message.get("content") or "" for message in body.template_messages()]
    return [p if isinstance(p, str) else info.tokenizer.decode(p) for p in body.prompts()]


@dataclass
class RequestPlan:
    gateway: Gateway
    tenant: Tenant | None
    input_flags: list[str]
    quota: RequestQuota | None = None  # the tenant's buckets (in-process or in Redis) for the token charge
    key: str | None = None  # the result cache's key; None: not cacheable
    flight: Flight | None = None  # the identical requests waiting for this one's response
    semantic_key: Any = None  # the semantic cache's scope and query embedding
    hit: dict[str, Any] | None = None  # the stored {"choices", "usage"} on a hit
    hit_kind: str = ""
    filters: dict[int, OutputFilter] = field(default_factory=dict)
    charged: bool = False

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.hit is not None:
            headers[CACHE_HEADER] = self.hit_kind
        elif self.key is not None or self.semantic_key is not None:
            headers[CACHE_HEADER] = "miss"
        flags = self.input_flags + self.output_flags()
        if flags:
            headers[FLAG_HEADER] = ", ".join(flags)
        return headers

    def output_flags(self) -> list[str]:
        names = {f"output:{m.rule.name}" for f in self.filters.values() for m in f.matches}
        return sorted(names)

    def choice_flags(self, index: int) -> list[str]:
        found = self.filters.get(index)
        return sorted({m.rule.name for m in found.matches}) if found is not None else []

    # ---- output filtering ----------------------------------------------------------------------
    def filter_output(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """The output as it may leave (released text only); None once the choice was cut by a block."""
        filt = self.filters.get(index)
        if filt is None:
            return output
        if filt.blocked is not None:
            return None
        before = len(filt.matches)
        released = filt.feed(output.new_text, final=output.finished)
        for match in filt.matches[before:]:
            self.gateway.metrics.guardrail_matches.labels(match.rule.name, "output", match.rule.action).inc()
        if filt.blocked is not None:
            return dataclasses.replace(output, new_text=released, finished=True, finish_reason="content_filter",
                                       text=filt.text, new_logprobs=None, logprobs=None)
        return dataclasses.replace(output, new_text=released, text=filt.text if output.finished else output.text)

    def filter_finals(self, finals: dict[int, RequestOutput]) -> dict[int, RequestOutput]:
        if not self.filters:
            return finals
        filtered = {}
        for index, output in finals.items():
            whole = dataclasses.replace(output, new_text=output.text)
            result = self.filter_output(index, whole)
            filtered[index] = result if result is not None else output
        return filtered

    # ---- completion ----------------------------------------------------------------------------
    def charge(self, usage: dict[str, Any]) -> None:
        """From code that cannot wait: the quota charge runs as a task (a no-op once charged)."""
        if self.count(usage) and self.quota is not None:
            self.quota.charge_later(usage["total_tokens"])

    async def settle(self, usage: dict[str, Any]) -> None:
        """Charge the tenant before the response ends, so its next request (on any replica) sees it."""
        if self.count(usage) and self.quota is not None:
            await self.quota.charge(usage["total_tokens"])

    def count(self, usage: dict[str, Any]) -> bool:
        """Count the tokens in the tenant's metrics, once; True when they still have to be charged."""
        if self.charged or self.tenant is None:
            return False
        self.charged = True
        metrics = self.gateway.metrics
        metrics.tenant_tokens.labels(self.tenant.label, "prompt").inc(usage["prompt_tokens"])
        metrics.tenant_tokens.labels(self.tenant.label, "completion").inc(usage["completion_tokens"])
        return True

    async def finish(self, choices: list[dict[str, Any]], usage: dict[str, Any], complete: bool) -> None:
        """Charge the tenant; store a complete response (every choice ended by stop, length or a filter)."""
        await self.settle(usage)
        if not complete or self.hit is not None:
            return
        reasons = {choice.get("finish_reason") for choice in choices}
        if "abort" in reasons or None in reasons:
            return  # its waiters, if any, compute on their own once the request has ended (FlightRelease)
        if any(choice.get("titan_degraded") for choice in choices):
            return  # admission cut its max_tokens under load: not the reply the request asked for
        stored = [{k: v for k, v in choice.items() if k not in ("titan_timeline", "titan_degraded")}
                  for choice in choices]
        if self.flight is not None and self.gateway.flights is not None:
            self.gateway.flights.land(self.flight, {"choices": stored, "usage": usage})
        if self.key is not None and self.gateway.store is not None:
            await self.gateway.store.set(self.key, encode_entry(stored, usage), self.gateway.ttl_seconds)
        if self.semantic_key is not None and self.gateway.semantic is not None:
            await self.gateway.semantic.store(self.semantic_key, stored, usage)


def hit_body(plan: RequestPlan, request_id: str, route_object: str, created: int, model: str) -> bytes:
    assert plan.hit is not None
    return json.dumps({"id": request_id, "object": route_object, "created": created, "model": model,
                       "choices": plan.hit["choices"], "usage": plan.hit["usage"]},
                      ensure_ascii=False, separators=(",", ":")).encode()
