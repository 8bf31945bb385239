"""The engine: add_request / step / abort over token ids. One step is schedule -> run -> postprocess.

Text (tokenizing prompts, detokenizing, stop strings) is not the engine's business: see
tokenmill/engine/input.py and tokenmill/engine/output.py.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from tokenmill import parallel
from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint
from tokenmill.config import (
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
    cores_per_process,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from tokenmill.engine.block_table import BlockTable
from tokenmill.engine.grammar import COMPLETE, GrammarCompiler
from tokenmill.engine.kv_cache import BlockPool, KVCacheManager, allocate_kv_caches, kv_bytes_per_token, kv_layout
from tokenmill.engine.kv_transfer import KVExporter, LoadedKV, check_loaded, read_kv, write_kv
from tokenmill.engine.request import Request, check_prompt_token_ids
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.snapshot import EngineSnapshot, StepRecord, scheduled_rows, step_record, take_snapshot
from tokenmill.engine.speculative import DraftModelProposer, NgramProposer, RowCost, Speculator, row_cost
from tokenmill.engine.workers import KVPlan, TPWorkers
from tokenmill.errors import TokenmillError
from tokenmill.layers.quant import QuantWeight
from tokenmill.models.loader import checkpoint_config, load_model, runs_quantized
from tokenmill.sampling import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# Default KV pool: a quarter of the memory still available once the weights are loaded, at most
# 4 GiB (and never more than max_num_seqs full-length requests can use).
DEFAULT_KV_FRACTION = 0.25
DEFAULT_KV_CAP = 4 << 30
FINISHED_LOG_SIZE = 4096


def available_memory(device: torch.device) -> int:
    """Bytes the KV pool could take on `device` right now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory(device: torch.device) -> int:
    """Bytes of memory `device` has in all: no KV pool can be larger."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_kv_pool_size(config: EngineConfig, num_blocks: int, rank_block_bytes: int, device: torch.device) -> None:
    """Refuse a KV pool (or a budget for one) that could never be resident (rank_block_bytes: this
    process's bytes of a block): the pool is reserved untouched, so it would fail only once requests
    filled it, killing the process."""
    limit = total_memory(device)
    if config.num_kv_blocks is None and config.kv_cache_memory is not None and config.kv_cache_memory > limit:
        raise TokenmillError(f"kv_cache_memory: {config.kv_cache_memory / 2**30:.1f} GiB is more than the "
                             f"{device.type} memory there is ({limit / 2**30:.1f} GiB)")
    if num_blocks * rank_block_bytes > limit:
        raise TokenmillError(f"num_kv_blocks: {num_blocks} blocks of {rank_block_bytes} bytes need "
                             f"{num_blocks * rank_block_bytes / 2**30:.1f} GiB, more than the {device.type} memory "
                             f"there is ({limit / 2**30:.1f} GiB)")


def default_kv_cache_memory(device: torch.device) -> int:
    return min(int(available_memory(device) * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP)



@dataclass(frozen=True)
class EngineStats:
    num_running: int            # sequences in the running batch
    num_waiting: int            # sequences waiting (new or preempted)
    num_kv_blocks: int          # blocks in the pool
    num_free_kv_blocks: int     # not held by any request (they may still hold cached prefixes)
    prefix_cache_queries: int   # prompt tokens admitted
    prefix_cache_hits: int      # of which served by the prefix cache
    num_preemptions: int
    prompt_tokens: int          # prompt tokens run through the model (not those the prefix cache served)
    generation_tokens: int      # tokens sampled
    spec_proposer: str | None = None   # speculative decoding's proposer (ngram, draft_model); None: off
    spec_num_drafts: int = 0           # request-steps that verified at least one proposed token
    spec_num_draft_tokens: int = 0     # proposed tokens verified
    spec_num_accepted_tokens: int = 0  # of which accepted
    spec_row_cost: float | None = None  # the adaptive draft length's cost of a row (speculative.RowCost)
    spec_proposal_cost: float | None = None  # and of proposing one token (speculative.ProposalCost)
    kv_transfer_role: str | None = None   # kv_producer | kv_consumer (prefill/decode disaggregation); None: off
    kv_transfer_exports: int = 0          # requests whose prompt K/V this engine exported
    kv_transfer_loaded_tokens: int = 0    # prompt tokens whose K/V this engine received instead of computing


class LLMEngine:
    def __init__(self, ckpt: GGUFCheckpoint | HFCheckpoint, config: EngineConfig, eos_token_ids: frozenset[int],
                 draft: LLMEngine | None = None, label: str = ""):
        """`draft`: the engine of the draft model, for speculative_config's method draft_model (its
        scheduler is unused: the speculator runs its model on shadow requests). `label`: what its
        log lines begin with (the draft's engine: which model they are about)."""
        self.config = config
        self.label = label
        if config.kv_transfer_config is not None and config.kv_transfer_config.kv_role is None:   # (was ignored)
            raise TokenmillError("kv_transfer_config: without a kv_role it describes `tokenmill serve`'s pair of "
                                 "engines (one prefills, one decodes); an engine of its own takes kv_role "
                                 "kv_producer or kv_consumer")
        tp_size = config.tensor_parallel_size
        threads = config.threads if config.threads is not None or tp_size == 1 else cores_per_process(tp_size)
        if threads is not None:
            # PyTorch's intra-op threads; the C kernels share its OpenMP runtime, so their parallel
            # regions in this thread take the same count.
            torch.set_num_threads(threads)
        self.device = resolve_device(config.device)
        quantized = runs_quantized(ckpt, config.quantization, self.device)
        if config.activation_precision != "int16" and not quantized:   # (it would change nothing)
            raise TokenmillError(f"activation_precision {config.activation_precision}: it applies to quantized "
                                 f"weights on CPU, and this model's weights run dense on {self.device} "
                                 f"(quantization {config.quantization})")
        self.dtype = resolve_dtype(config.dtype, self.device, quantized)
        self.workers: TPWorkers | None = None
        if tp_size > 1:
            if self.device.type != "cpu":
                raise TokenmillError(f"tensor_parallel_size {tp_size}: tensor parallelism runs on CPU (gloo) only "
                                     f"so far, not on {self.device}")
            # a split the model's heads do not allow is refused before any rank's process starts
            heads = checkpoint_config(ckpt)[1]
            parallel.kv_heads_per_rank(heads.num_heads, heads.num_kv_heads, tp_size)
            self.workers = TPWorkers(ckpt.path, config, self.dtype, self.device, tp_size, threads)
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        self.kv_exporter: KVExporter | None = None   # (set by _build; shutdown may come first)
        try:
            self._build(ckpt, config)
            self.speculator = self._speculator(config.speculative_config, draft)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, ckpt: GGUFCheckpoint | HFCheckpoint, config: EngineConfig) -> None:
        """The model (this process's rank of it), the KV pool (and the workers' slices of it), the
        runner and the scheduler."""
        tp = parallel.SINGLE if self.workers is None else self.workers.tp
        self.model, self.model_config = load_model(ckpt, self.dtype, self.device, config.show_progress,
                                                   config.quantization, config.max_model_len, config.weight_cache, tp,
                                                   config.activation_precision == "int8")
        mc: ModelConfig = self.model_config
        self.quantized = any(isinstance(m, QuantWeight) for m in self.model.modules())
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device, self.quantized)
        # Every rank holds the same blocks, of its own KV heads: the budget is for all of them.
        kv_heads = parallel.kv_heads_per_rank(mc.num_heads, mc.num_kv_heads, tp.size)
        layout = kv_layout(mc)
        per_token = kv_bytes_per_token(mc, self.kv_dtype) * sum(kv_heads) // mc.num_kv_heads
        # a block: its block_size slots in each cache tensor (one per layer of a group)
        block_bytes = per_token * layout.num_slots // mc.num_layers * config.block_size
        context = config.max_model_len or mc.max_position_embeddings
        step = config.max_num_batched_tokens
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:  # the memory budget, but no more than max_num_seqs full-length requests need
            useful = config.max_num_seqs * layout.max_blocks_held(context, config.block_size, step)
            budget = config.kv_cache_memory or default_kv_cache_memory(self.device)
            if config.kv_cache_memory is not None and budget < block_bytes:   # (100 for 100MiB was one block)
                raise TokenmillError(f"kv_cache_memory: {budget} bytes is less than one KV block ({block_bytes} "
                                     f"bytes: {config.block_size} tokens of every layer); sizes take units, e.g. 4GiB")
            num_blocks = max(1, min(budget // block_bytes, useful))
        check_kv_pool_size(config, num_blocks, block_bytes * kv_heads[0] // sum(kv_heads), self.device)
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise TokenmillError(f"max_model_len ({config.max_model_len}) exceeds the model's context length "
                                 f"({mc.max_position_embeddings})")
        # the longest request the pool holds alone (the blocks it holds grow with its length)
        self.max_model_len = bisect.bisect_right(range(1, context + 1), False, key=lambda n: layout.max_blocks_held(
            n, config.block_size, step) > num_blocks)
        if self.max_model_len < 1:
            raise TokenmillError(f"the KV pool ({num_blocks} blocks) is smaller than one block per KV cache group "
                                 f"({len(layout.windows)}); raise num_kv_blocks or kv_cache_memory")
        if config.max_model_len is not None and self.max_model_len < config.max_model_len:
            logger.warning("%smax_model_len %d lowered to %d: the KV pool (%d blocks) holds no longer request; raise "
                           "kv_cache_memory or num_kv_blocks for more", self.label, config.max_model_len,
                           self.max_model_len, num_blocks)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching, layout.windows)
        self.layout = layout
        self.kv_caches = allocate_kv_caches(mc, num_blocks, config.block_size, self.kv_dtype, self.device, kv_heads[0])
        if self.workers is not None:
            self.workers.ready(KVPlan(num_blocks, config.block_size, self.kv_dtype))
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, mc.vocab_size, self.device,
                                  config.attention_backend, self.workers, layout.layer_group)
        self.kv_role = config.kv_transfer_config.kv_role if config.kv_transfer_config is not None else None
        self.kv_exporter = KVExporter() if self.kv_role == "kv_producer" else None
        self.num_kv_exports = 0
        self.num_kv_loaded_tokens = 0
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        # Compiles structured-output constraints. Set by load_engine: it needs the tokenizer, which
        # the engine (token ids in, token ids out) does not have otherwise.
        self.grammars: GrammarCompiler | None = None
        self._ids = itertools.count()
        self.num_prompt_tokens = 0       # cumulative, for stats(): the periodic server log's throughputs
        self.num_generation_tokens = 0
        self.num_forced_tokens = 0       # of which appended by jump-forward, without a model step
        self.num_steps = 0               # steps that ran the model
        self.last_step: StepRecord | None = None
        # (request_id, finish_reason) of the latest finished requests (num_finished in all), for
        # watchers (server/monitor.py) that read them between steps
        self.finished_log: deque[tuple[str, str]] = deque(maxlen=FINISHED_LOG_SIZE)
        self.num_finished = 0
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        windows = [w for w in layout.windows if w is not None]
        groups = (f" ({len(layout.windows)} groups of layers, {len(windows)} sliding: window {windows[0]})"
                  if len(layout.windows) > 1 else f" (sliding window {windows[0]})" if windows else "")
        logger.info("%smemory plan%s: weights %.1f MiB (%s%s); KV cache (%s) %d B/token%s, %d blocks of %d tokens "
                    "(%.1f MiB); max_model_len %d: %.1f full-length requests fit at once", self.label,
                    f" ({tp.size} tensor-parallel ranks)" if tp.size > 1 else "", weight_bytes / 2**20, self.dtype,
                    ", rank 0's part" if tp.size > 1 else "", self.kv_dtype, per_token,
                    groups, num_blocks, config.block_size, num_blocks * block_bytes / 2**20, self.max_model_len,
                    num_blocks / layout.max_blocks_held(self.max_model_len, config.block_size, step))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or the
        process exits; calling it twice is harmless), and delete the K/V exports no consumer took."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.kv_exporter is not None:
            self.kv_exporter.close()

    def _speculator(self, config: SpeculativeConfig | None, draft: LLMEngine | None) -> Speculator | None:
        if config is None:
            return None
        proposer: NgramProposer | DraftModelProposer
        if config.method == "ngram":
            proposer = NgramProposer(config)
        elif draft is None:
            raise TokenmillError("speculative_config: method draft_model needs the draft's engine (load_engine "
                                 "builds it from speculative_config.model)")
        else:
            proposer = DraftModelProposer(draft.runner, draft.kv, draft.max_model_len, self.model_config.vocab_size,
                                          config.num_speculative_tokens)
        return Speculator(config, proposer, self.model_config.vocab_size, self.device,
                          RowCost(row_cost(self.device, self.quantized)))

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> Request:
        check_prompt_token_ids(prompt_token_ids, self.model_config.vocab_size)
        params.validate_for_vocab(self.model_config.vocab_size)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise TokenmillError(f"prompt: {n} tokens leave no room to generate within max_model_len "
                                 f"({self.max_model_len})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise TokenmillError(f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"max_model_len ({self.max_model_len})")
        if params.min_tokens > max_tokens:
            raise SamplingParamsError("min_tokens", f"must be <= the {max_tokens} tokens that prompt ({n} tokens) "
                                      f"leaves within max_model_len ({self.max_model_len}), got {params.min_tokens}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise TokenmillError(f"request_id {request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise TokenmillError("structured_outputs: this engine was built without a tokenizer (use "
                                     "load_engine), so it cannot compile constraints")
            grammar = self.grammars.matcher(params.structured_outputs)
        export, loaded = self._kv_transfer(params.kv_transfer_params, prompt_token_ids)
        if export:   # (checked against the max_tokens the decode side will generate, then ended after one)
            max_tokens = 1
        request = Request(request_id, list(prompt_token_ids), params, max_tokens,
                          frozenset() if params.ignore_eos else self.eos_token_ids, priority=priority,
                          grammar=grammar, kv_export=export, kv_load=loaded)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _kv_transfer(self, transfer: dict | None, prompt_token_ids: list[int]) -> tuple[bool, LoadedKV | None]:
        """A request's kv_transfer_params: (export its prompt's K/V?, the K/V it brings)."""
        if transfer is None or transfer == {"do_remote_decode": False}:
            return False, None
        wanted = "kv_consumer" if "remote_kv" in transfer else "kv_producer"
        if self.kv_role != wanted:
            raise SamplingParamsError("kv_transfer_params", f"needs a {wanted} engine, and this one is not (start it "
                                      f"with kv_transfer_config {{\"kv_connector\": ..., \"kv_role\": "
                                      f"\"{wanted}\"}})")
        if wanted == "kv_producer":
            return True, None
        loaded = read_kv(transfer["remote_kv"])
        if loaded is None:   # collected already (by an earlier sample of the same request) or expired
            logger.debug("kv_transfer_params: %s is gone; computing the prompt", transfer["remote_kv"])
            return False, None
        problem = check_loaded(loaded, prompt_token_ids, self.kv_caches)
        if problem is not None:
            logger.warning("kv_transfer_params: not using the K/V received (%s); computing the prompt", problem)
            return False, None
        return False, loaded

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that got a token, finished or failed in it.

        One request's failure never reaches the others. A step whose forward or sampling raises
        is run again one request at a time (a request's tokens do not depend on its batch, and
        seeded generators are rewound first, so greedy and seeded survivors get exactly the tokens
        the whole step would have given them); a request that fails alone too ends with finish_reason
        "error". A failure while appending a request's token ends that request alone."""
        start = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        schedule = self.scheduler.schedule()
        scheduled = schedule.scheduled
        if not scheduled:
            self._end_speculation({})
            return []
        for request, loaded, first, last in schedule.loads:
            write_kv(self.kv_caches, self.layer_tables(request), self.config.block_size, loaded, first, last)
            self.num_kv_loaded_tokens += last - first
        rows = scheduled_rows(scheduled)
        generator_states = [(r.generator, r.generator.get_state()) for r, n in scheduled
                            if r.generator is not None and r.num_computed_tokens + n == r.num_tokens]   # samples now
        failed: list[Request] = []
        try:
            model_start = time.perf_counter()
            results = self.runner.execute(scheduled)
            if self.speculator is not None:
                self.speculator.observe_step(rows, time.perf_counter() - model_start)
        except parallel.ParallelError:
            raise   # the ranks no longer run the same steps: no request can go on (see engine/workers.py)
        except Exception:
            logger.exception("an engine step of %d requests failed; running each request alone", len(scheduled))
            for generator, state in generator_states:
                generator.set_state(state)
            results = []
            for request, n in scheduled:
                try:
                    results.extend(self.runner.execute([(request, n)]))
                except parallel.ParallelError:
                    raise
                except Exception as e:
                    failed.append(request)
                    self._fail(request, e)
        new_tokens = {request.request_id: tokens for request, tokens in results}
        for request, n in scheduled:
            if not request.is_finished:
                # A preempted request's prompt counts again: it is recomputed.
                computed = request.num_computed_tokens
                self.num_prompt_tokens += max(0, min(computed + n, len(request.prompt_token_ids)) - computed)
                if request.spec_token_ids:   # rows of rejected proposals roll back (their K/V are not the request's)
                    n -= len(request.spec_token_ids) + 1 - len(new_tokens[request.request_id])
                request.num_computed_tokens += n
                if request.spec_token_ids:
                    self.kv.truncate(request)
                if request.kv_export and request.num_computed_tokens >= len(request.prompt_token_ids):
                    request.kv_export = False
                    request.kv_exported = self.kv_exporter.export(self.kv_caches, self.layer_tables(request),
                                                                  self.config.block_size, request.prompt_token_ids)
                    self.num_kv_exports += request.kv_exported is not None
                # (accepted proposals are computed before they are appended below)
                request.num_forced_pending = max(0, min(request.num_forced_pending,
                                                        request.num_tokens - request.num_computed_tokens))
                self.kv.cache_full_blocks(request)
                self.kv.release_behind_window(request)
        self._end_speculation(new_tokens)
        for request, tokens in results:
            for token in tokens:
                if request.is_finished:   # (the tokens after its stop are dropped)
                    break
                self._append(request, token.token_id, token.logprob, token.top_logprobs)
        self._jump_forward([request for request, _ in results if request.grammar is not None])
        self.num_steps += 1
        self.last_step = step_record(self.num_steps, start, time.monotonic() - start,
                                     self.scheduler.max_num_batched_tokens, rows, len(schedule.preempted),
                                     len(self.scheduler.running), len(self.scheduler.waiting))
        return failed + [request for request, _ in results]

    def layer_tables(self, request: Request) -> list[BlockTable]:
        """Each layer's block table of `request` (its KV cache group's)."""
        return [request.tables[group] for group in self.layout.layer_group]

    def _end_speculation(self, new_tokens: dict[str, list]) -> None:
        """After a step: counts and acceptance of the requests that speculated; each one's
        proposals, masks and noise cleared."""
        if self.speculator is None:
            return
        for request in self.scheduler.running + self.scheduler.waiting:
            if request.spec_token_ids or request.spec_noise is not None:
                self.speculator.verified(request, len(new_tokens.get(request.request_id, ())))

    def _append(self, request: Request, token_id: int, logprob: float | None,
                top_logprobs: list[tuple[int, float]]) -> None:
        """Add one output token to `request` and end it if that stops it; a failure here (a bug,
        or a token its grammar rejects) ends that request alone."""
        try:
            request.append_token(token_id)
            self.num_generation_tokens += 1
            if logprob is not None:
                request.logprobs.append((logprob, top_logprobs))
            request.check_stop(self.max_model_len)
            if request.grammar is not None and not request.is_finished:
                request.grammar.accept(token_id)
        except Exception as e:
            self._fail(request, e)
            return
        if request.is_finished:
            self._release(request)

    def _jump_forward(self, requests: list[Request]) -> None:
        """Fill the next-token masks of constrained requests; where a mask allows one token only,
        append it now, without a model step (its probability under the mask is 1 whatever the
        logits are; its K/V is computed with the next step's tokens), and repeat."""
        while requests := [r for r in requests if not r.is_finished]:
            self._fill_masks(requests)
            forced = []
            for request in requests:
                if request.is_finished:   # (its mask failed)
                    continue
                try:
                    token_id = request.grammar.forced_token()
                except Exception as e:
                    self._fail(request, e)
                    continue
                if token_id == COMPLETE:   # only EOS may follow (also under ignore_eos: nothing else may)
                    request.finish("stop")
                    self._release(request)
                elif token_id is not None:
                    # Under the mask the forced token's probability is 1: log-probability 0.
                    logprob = 0.0 if request.params.logprobs is not None else None
                    self._append(request, token_id, logprob, [(token_id, 0.0)] if request.params.logprobs else [])
                    self.num_forced_tokens += 1
                    request.num_forced_pending += 1
                    forced.append(request)
            requests = forced

    def _fill_masks(self, requests: list[Request]) -> None:
        """All masks in one call; if that fails, one by one, so that a failure ends its request alone."""
        assert self.grammars is not None
        try:
            self.grammars.fill_masks([r.grammar for r in requests])
        except Exception:
            for request in requests:
                try:
                    self.grammars.fill_masks([request.grammar])
                except Exception as e:   # the request's own constraint where the grammar engine says so
                    grammar = request.grammar
                    self._fail(request, grammar.failure(f"failed to fill the mask: {e}") if grammar.failed else e)

    def _fail(self, request: Request, error: Exception) -> None:
        """End `request` alone because of `error` (a bug, or its own input that validation could not
        foresee, e.g. a grammar past a limit mid-generation): it finishes with reason "error", and its
        blocks go back to the pool."""
        request.finish("error")
        if isinstance(error, SamplingParamsError):   # its own input: the message begins with the field
            # (one line, no traceback: any client can cause it)
            logger.info("request %s ended by its own input: %s", request.request_id, error)
            request.error, request.error_param = str(error), error.field
        else:
            logger.error("request %s failed: %s: %s", request.request_id, type(error).__name__, error,
                         exc_info=error)
            request.error = f"{type(error).__name__}: {error}"
        self._release(request)

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request from outside the token loop (a stop string matched, or an abort)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        request.finish(reason, stop_reason)
        self._release(request)

    def abort(self, request_id: str) -> None:
        self.finish_request(request_id, "abort")

    def _release(self, request: Request) -> None:
        self.num_finished += 1
        self.finished_log.append((request.request_id, request.finish_reason))
        if self.speculator is not None:
            self.speculator.verified(request, 0)   # (a no-op unless it ended mid-step)
            self.speculator.release(request)
        self.scheduler.remove(request)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def snapshot(self) -> EngineSnapshot:
        """Every request's state and each KV block's holder, for a live view. Between steps only."""
        return take_snapshot(self.num_steps, self.scheduler.running, self.scheduler.waiting, self.pool.ref_count,
                             self.pool.cached_free_blocks(), self.config.block_size, self.scheduler.max_num_seqs,
                             self.scheduler.max_num_batched_tokens)

    def stats(self) -> EngineStats:
        """The engine's state now, for monitoring (the server's /metrics). Only lengths and
        counters are read, so another thread may call it while a step runs."""
        spec = {}
        if self.speculator is not None:
            counts = self.speculator.stats
            spec = dict(spec_proposer=self.speculator.proposer.name, spec_num_drafts=counts.num_drafts,
                        spec_num_draft_tokens=counts.num_draft_tokens,
                        spec_num_accepted_tokens=counts.num_accepted_tokens, spec_row_cost=self.speculator.cost.value,
                        spec_proposal_cost=self.speculator.proposal_cost.value)
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.num_blocks,
                           self.pool.num_free, self.kv.prefix_queries, self.kv.prefix_hits,
                           self.scheduler.num_preemptions, self.num_prompt_tokens, self.num_generation_tokens, **spec,
                           kv_transfer_role=self.kv_role, kv_transfer_exports=self.num_kv_exports,
                           kv_transfer_loaded_tokens=self.num_kv_loaded_tokens)

