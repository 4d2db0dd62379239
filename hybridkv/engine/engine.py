"""LLMEngine: add requests, then step() = schedule -> run -> update, until every request finished.

It is the one front the offline API and the server talk to: requests in (`check_prompt`, `add_request`,
`abort`), `step()` out (the requests that finished in it, failed ones included), `stats()` for every reader of
counters, and the connector's hooks a serving loop needs (`next_deadline`, `set_waker`, `dead_threads`, ...).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.connectors.base import EngineIdentity, KVConnector, connector_factory
from hybridkv.connectors.identity import model_fingerprint
from hybridkv.engine import prompt_logprobs
from hybridkv.engine.chunking import ExactChunks, FreeChunks, exact_unit
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.device import resolve_device
from hybridkv.engine.kv_sizing import plan_for
from hybridkv.engine.scheduler import Scheduler, SchedulerConfig
from hybridkv.engine.stats import EngineStats, snapshot
from hybridkv.engine.tokenizer import Tokenizer, eos_token_ids
from hybridkv.engine.turn_end import turn_end_request
from hybridkv.events.publisher import ZmqEventPublisher
from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.events import MEDIUM_GPU, KVEventLog, public
from hybridkv.kv.hashing import BlockHasher, is_private
from hybridkv.kv.model_kv import load_hf_config
from hybridkv.kv.residency import ResidencySampler
from hybridkv.models.registry import load_model
from hybridkv.request.prompt import check_prompt
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request, RequestStatus
from hybridkv.runner.model_runner import ModelRunner
from hybridkv.runner.sampler import sample, token_logprobs
from hybridkv.structured.constraints import Compiled, Constraints
from hybridkv.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        hf = load_hf_config(config.model)
        self.plan = plan_for(config, self.device, hf)
        max_len = self.plan.max_model_len
        # None: free chunks and fast arithmetic
        self.exact_unit = exact_unit(config.batch_invariant, config.dtype, config.max_num_batched_tokens, hf, self.plan)
        if self.exact_unit is not None and config.max_num_batched_tokens < self.exact_unit:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is below {self.exact_unit}, the unit "
                "a recurrent-state prefill is split in (block size and scan chunk): raise it to at least that"
            )
        self.hasher = BlockHasher.from_environment(config.prefix_caching_hash_algo)
        if config.seed is not None:
            torch.manual_seed(config.seed)  # vLLM's --seed: the process's sampler, for requests without a seed
        events = config.kv_events_config
        self.kv_events: KVEventLog | None = KVEventLog() if events is not None and events.enabled else None
        exact_model = self.exact_unit is not None and self.plan.state is None
        self.model = load_model(config.model, dtype=config.dtype, device=self.device, batch_invariant=exact_model)
        # Exact attention models resume (prefix hits, offload loads) only where a prefill tile begins; recurrent
        # hybrids only at a state checkpoint, which their state groups ensure.
        unit = self.exact_unit // self.plan.block_size if self.exact_unit and self.plan.state is None else 1
        self.kv = KVCacheCoordinator(
            self.plan, enable_prefix_caching=config.enable_prefix_caching, events=self.kv_events, resume_unit=unit,
            state_cache_memory=config.state_cache_memory,
            residency=ResidencySampler(config.kv_cache_metrics_sample) if config.kv_cache_metrics else None,
        )  # fmt: skip
        self.runner = ModelRunner(self.model, self.plan, self.device, self.exact_unit)
        self.connector: KVConnector | None = None
        if config.kv_transfer_config is not None:
            identity = EngineIdentity(uuid.uuid4().hex, model_fingerprint(config.model), config.dtype)
            factory = connector_factory(config.kv_transfer_config.kv_connector)
            self.connector = factory(config.kv_transfer_config, identity)
            self.connector.resume_unit = unit
            self.connector.pages = self.kv.pages  # type: ignore[method-assign]
            self.connector.register(self.plan, self.runner.memory)
            if self.kv_events is not None:
                self.connector.set_kv_events(self.kv_events)
        chunking = FreeChunks()
        if self.exact_unit is not None:
            chunking = ExactChunks(self.exact_unit, config.state_checkpoints)
        # turn_end: a finished turn's prompt + answer is published in the background (`engine/turn_end.py`)
        self.publishes_turns = (
            config.state_checkpoints == "turn_end" and self.plan.state is not None and config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv,
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_len),
            self.connector,
            chunking,
        )
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(config.model)
        except ValueError:
            self.tokenizer = None
        self.eos_token_ids = eos_token_ids(config.model, hf)
        self.vocab_size: int = hf.get("text_config", hf)["vocab_size"]
        self.constraints = Constraints(
            config.model, self.vocab_size, self.eos_token_ids, config.structured_outputs_config
        )
        self._ids = itertools.count()
        self._texts: dict[str, IncrementalDetokenizer] = {}  # unfinished requests' text and stop rules
        self.kv_publisher: ZmqEventPublisher | None = None
        if self.kv_events is not None:  # last: nothing after it can fail and leave its thread and sockets behind
            groups = {g.group_id: (g.kind, g.sliding_window) for g in self.plan.groups}
            self.kv_publisher = ZmqEventPublisher(events, groups)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode_within(prompt, self.max_model_len, add_special_tokens)
        return list(prompt)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text worth tokenizing: any longer one has more than max_model_len - 1 tokens, so it
        is refused by its length alone (tokenizing 16 MiB of text took 42 s and 2 GiB)."""
        return 0 if self.tokenizer is None else self.tokenizer.max_chars(self.max_model_len - 1)

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, when it is one this engine can serve (`request.prompt.check_prompt`); else a
        ValueError. Thread-safe: the server calls it before queueing."""
        return check_prompt(self.tokenize(prompt), self.max_model_len, self.vocab_size)

    def compile_grammar(self, spec: StructuredOutputs) -> Compiled:
        """Compile (and cache) a request's constraint: ValueError names what is wrong. Thread-safe: the server
        calls it before queueing, so the engine thread only copies the compiled grammar."""
        return self.constraints.compile(spec)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: Any = None,
        cache_salt: str | None = None,
        constraint: Compiled | None = None,
    ) -> Request:
        """`kv_transfer_params`: what `accept_transfer_params` returned, or a raw dict it is applied to;
        `constraint`: the request's structured-output constraint as `compile_grammar` returned it (else it is
        compiled here, on the caller's thread)."""
        ids = self.check_prompt(prompt)
        if params.logit_bias and max(t for t, _ in params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias names token ids outside this model's vocabulary [0, {self.vocab_size})")
        if isinstance(kv_transfer_params, dict):
            (kv_transfer_params,) = self.accept_transfer_params(kv_transfer_params)
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(
            rid, ids, params, self.plan.block_size, self.eos_token_ids, cache_salt, kv_transfer_params, self.hasher
        )
        if params.structured_outputs is not None:
            req.grammar = self.constraints.matcher(params.structured_outputs, constraint)
        self.scheduler.add(req)
        self._texts[rid] = IncrementalDetokenizer(self.tokenizer, req, self.max_model_len)
        return req

    def accept_transfer_params(self, raw: Any, num_prompts: int = 1) -> list[Any]:
        """Client-supplied kv_transfer_params for `num_prompts` prompts, parsed and verified by the connector:
        one value per prompt (thread-safe: the server calls it before queueing). ValueError names a bad field;
        TransferRefused is a verification failure under kv_load_failure_policy "fail"."""
        if not raw:
            return [None] * num_prompts
        if self.connector is None:
            raise ValueError("kv_transfer_params need a server started with --kv-transfer-config")
        return self.connector.accept_transfer_params(raw, num_prompts)

    def merge_transfer_params(self, outs: list[dict | None]) -> dict | None:
        """The one kv_transfer_params a response carries for its prompts' (in order)."""
        if self.connector is None or not any(outs):
            return None
        return self.connector.merge_transfer_params(outs)

    def cancel_transfer(self, raw: Any) -> bool:
        """The client will not use kv_transfer_params this instance issued: free what they hold (thread-safe)."""
        return self.connector is not None and self.connector.cancel_transfer(raw)

    def next_deadline(self) -> float | None:
        """Seconds until `step()` is due with nothing else happening (a lease expiry); None for never."""
        return self.connector.next_deadline() if self.connector is not None else None

    def set_waker(self, wake: Callable[[], None]) -> None:
        """`wake()` is called from the connector's threads when `step()` has something new to do."""
        if self.connector is not None:
            self.connector.set_waker(wake)

    def dead_threads(self) -> list[str]:
        """The connector's and the KV event publisher's background threads that died (the server reports itself
        unhealthy; the engine keeps serving, events stop)."""
        dead = self.connector.dead_threads() if self.connector is not None else []
        if self.kv_publisher is not None and not self.kv_publisher.alive():
            dead.append("kv-events")
        return dead

    def shutdown(self) -> None:
        """Release the connector's and the KV event publisher's threads, sockets and registrations."""
        if self.connector is not None:
            self.connector.shutdown()
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.shutdown()

    def kv_events_state(self) -> dict[str, Any] | None:
        """What KV events reported so far (/admin/kv, `ZmqEventPublisher.state`) with what each tier holds. Call it
        on the thread that steps the engine: it publishes what is pending first, so replaying batches [0, last_seq]
        yields `cached` (exactly, while no offload load or store is in flight on another thread). None without KV
        events."""
        if self.kv_publisher is None:
            return None
        self._publish_kv_events()  # records an offload thread logged since the last step
        tiers = {MEDIUM_GPU: self.kv.pool.cached_hashes()}
        if self.connector is not None:
            tiers |= self.connector.kv_event_tiers()
        shared = {m: {g: [h for h in hs if not is_private(h)] for g, hs in gs.items()} for m, gs in tiers.items()}
        return self.kv_publisher.state(shared)

    def stats(self, check_integrity: bool = False) -> EngineStats:
        """The one snapshot of counters and gauges (/metrics, /admin/kv); with `check_integrity`, also the KV
        core's and the connector's invariants checked. Call it on the thread that steps the engine."""
        return snapshot(self.scheduler, self.kv, self.connector, check_integrity)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        self._texts.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def text(self, req: Request) -> str:
        """The request's output text that may be shown: all of it once it finished (a stop string cut, a stop
        token's text left out); before that, all but the end a stop string may still claim."""
        detok = self._texts.get(req.request_id)
        if detok is not None:
            return detok.visible_text()
        return req.final_text or ""

    def step(self) -> list[Request]:
        """Poll the connector, then one schedule -> run -> sample -> update. Returns the requests that finished
        in this step: stopped, at their length, or failed (a KV load, their sampling). With nothing to run it
        only polls (a server calls it when woken while idle: releases, expired leases). With KV events, what the
        caches recorded during the step goes out as one batch."""
        try:
            return self._step()
        finally:
            if self.kv_publisher is not None:
                self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        assert self.kv_events is not None and self.kv_publisher is not None
        events = public(self.kv_events.drain())
        if events:
            self.kv_publisher.publish(events)

    def _step(self) -> list[Request]:
        finished = self._poll_connector()
        self.step_tokens = 0
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.connector is not None and not finished and self.scheduler.has_unfinished():
                self.connector.wait(0.002)  # loads in flight: let them progress without spinning
            return self._collect(finished)
        req_ids, logits, every_row = self.runner.run(output)
        prompt_logprobs.record(every_row, self.scheduler.requests)
        self.step_tokens = sum(len(c.token_ids) for c in output.chunks)  # vllm:iteration_tokens_total
        reqs = [self.scheduler.requests[r] for r in req_ids]
        banned = [
            r.eos_token_ids + r.params.stop_token_ids if len(r.output_token_ids) < r.params.min_tokens else ()
            for r in reqs
        ]
        penalized = any(r.params.penalized for r in reqs)
        history = [(r.prompt_token_ids, r.output_token_ids) for r in reqs] if penalized else ()
        errors: dict[int, str] = {}
        constraints = {i: r.grammar for i, r in enumerate(reqs) if r.grammar is not None}
        params = [r.params for r in reqs]
        tokens = sample(logits, params, [r.generator for r in reqs], banned, history, errors, constraints)
        for i, reason in errors.items():  # that request fails alone; the step goes on for the others
            logger.warning("request %s failed: %s", reqs[i].request_id, reason)
            reqs[i].error = reason
            self.scheduler.finish(reqs[i].request_id, RequestStatus.FINISHED_ERROR)
            if not reqs[i].background:
                finished.append(reqs[i])
        wants = [i for i, r in enumerate(reqs) if r.logprobs is not None]
        if wants:
            rows = token_logprobs(logits[wants], [tokens[i] for i in wants], [reqs[i].params.logprobs for i in wants])
            for i, row in zip(wants, rows):
                reqs[i].logprobs.append(row)
        for req in self.scheduler.update(output, dict(zip(req_ids, tokens))):
            if req.background:  # its prompt is computed and published: done (`turn_end`)
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_LENGTH)
                continue
            token = req.output_token_ids[-1]
            if req.grammar is not None and not req.grammar.accept(token):
                req.error = f"structured output: token {token} broke the constraint: {req.grammar.error}"
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
                finished.append(req)
                continue
            status = self._texts[req.request_id].append(token)
            if status is None and req.grammar is not None and req.grammar.finished:
                status = self._texts[req.request_id].finish(RequestStatus.FINISHED_STOPPED)
            if status is not None:
                self.scheduler.finish(req.request_id, status)
                finished.append(req)
                if self.publishes_turns:
                    publish = turn_end_request(req, self.exact_unit, self.max_model_len)
                    if publish is not None:
                        self.scheduler.add_background(publish)
        return self._collect(finished)

    def _poll_connector(self) -> list[Request]:
        if self.connector is None:
            return []
        return self.scheduler.apply_connector_events(self.connector.poll())

    def _collect(self, finished: list[Request]) -> list[Request]:
        """Finished requests leave their text on the request (`final_text`) and drop their detokenizer."""
        for req in finished:
            detok = self._texts.pop(req.request_id, None)
            if detok is not None:
                req.final_text = detok.visible_text()
        return finished
