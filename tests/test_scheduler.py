"""Scheduler: the request state machine, prefill-first batching and its budgets, with a fake engine."""

from collections.abc import Callable

import pytest
import torch

from executor.core.engine import EngineCore, EngineStep
from executor.core.kv_cache import KVCacheManager
from executor.core.scheduler import Scheduler, SchedulerLimits
from executor.types_ import (
    Batch,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    StepResult,
    StepRunner,
    TokenLogprobs,
    attention_spec,
)
from tests.factories import make_request

EOS = 0


class FakeEngine:
    """A step runner whose step emits next_token(request) for each request whose scheduled tokens
    reach the end of its sequence (none for a prompt chunk short of it), and records every batch it saw."""

    def __init__(self, next_token: Callable[[Request], int] = lambda r: 100 + r.num_tokens) -> None:
        self.next_token = next_token
        self.batches: list[tuple[bool, list[str], list[RequestStatus]]] = []
        self.scheduled: list[list[int]] = []

    def new_tokens(self, batch: Batch) -> list[list[int]]:
        self.batches.append(
            (batch.is_prefill, [r.request_id for r in batch.requests], [r.status for r in batch.requests])
        )
        self.scheduled.append(list(batch.num_scheduled_tokens))
        return [
            [self.next_token(r)] if r.num_computed_tokens + n >= r.num_tokens else []
            for r, n in zip(batch.requests, batch.num_scheduled_tokens, strict=True)
        ]

    def execute(self, batch: Batch) -> StepResult:
        new_token_ids = self.new_tokens(batch)
        return StepResult(new_token_ids, [0] * len(new_token_ids), [[] for _ in new_token_ids])


def make_scheduler(
    batch_size: int = 4,
    max_prefill_tokens: int = 1000,
    max_model_len: int = 100,
    num_blocks: int = 64,
    block_size: int = 4,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerLimits(batch_size, max_prefill_tokens, max_model_len),
        KVCacheManager(num_blocks, block_size, [attention_spec(1, 8, torch.float32)], prefix_caching),
        eos_token_ids={EOS},
    )


def request(request_id: str, prompt_len: int, max_new_tokens: int = 3, **params) -> Request:
    """A request whose prompt shares no token with another id's, so prefix caching shares nothing."""
    first = 1 + 1000 * sum(map(ord, request_id))
    return make_request(request_id, range(first, first + prompt_len), max_new_tokens=max_new_tokens, **params)


def run_step(scheduler: Scheduler, runner: StepRunner) -> EngineStep:
    """One engine-core step of `scheduler` with `runner` (the scheduler holds every state across steps)."""
    return EngineCore(scheduler, runner).step()


def run_all(scheduler: Scheduler, engine: FakeEngine, requests: list[Request]) -> list[Request]:
    for r in requests:
        scheduler.add_request(r)
    finished = []
    while scheduler.has_work():
        finished.extend(run_step(scheduler, engine).finished)
    return finished


def test_request_walks_waiting_prefilling_running_finished():
    scheduler, engine = make_scheduler(), FakeEngine()
    r = request("a", 5, max_new_tokens=3)
    scheduler.add_request(r)
    assert r.status is RequestStatus.WAITING
    run_step(scheduler, engine)
    assert engine.batches[0] == (True, ["a"], [RequestStatus.PREFILLING])
    assert r.status is RequestStatus.RUNNING and len(r.output_token_ids) == 1
    run_step(scheduler, engine)
    assert engine.batches[1] == (False, ["a"], [RequestStatus.RUNNING])
    output = run_step(scheduler, engine)
    assert output.finished == [r] and r.status is RequestStatus.FINISHED
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 3
    assert not scheduler.has_work()


def test_prefill_comes_before_decode():
    scheduler, engine = make_scheduler(), FakeEngine()
    scheduler.add_request(request("a", 4, max_new_tokens=5))
    run_step(scheduler, engine)
    scheduler.add_request(request("b", 4, max_new_tokens=5))
    run_step(scheduler, engine)
    assert engine.batches[1][:2] == (True, ["b"])
    run_step(scheduler, engine)
    assert engine.batches[2][:2] == (False, ["a", "b"])


def test_batch_size_caps_running_requests():
    scheduler, engine = make_scheduler(batch_size=2), FakeEngine()
    finished = run_all(scheduler, engine, [request(str(i), 3) for i in range(5)])
    assert len(finished) == 5
    assert max(len(ids) for _, ids, _ in engine.batches) == 2


def test_max_prefill_tokens_caps_every_prefill_step_and_the_last_prompt_is_chunked():
    scheduler, engine = make_scheduler(max_prefill_tokens=10), FakeEngine()
    run_all(scheduler, engine, [request("a", 6), request("b", 6), request("c", 4)])
    prefills = [
        (ids, n) for (is_prefill, ids, _), n in zip(engine.batches, engine.scheduled, strict=True) if is_prefill
    ]
    assert prefills == [(["a", "b"], [6, 4]), (["b", "c"], [2, 4])]


def test_eos_stops_unless_ignored():
    engine = FakeEngine(next_token=lambda r: EOS if len(r.output_token_ids) == 1 else 7)
    stopped, ignoring = request("a", 3, max_new_tokens=5), request("b", 3, max_new_tokens=5, ignore_eos=True)
    run_all(make_scheduler(), engine, [stopped, ignoring])
    assert stopped.finish_reason is FinishReason.STOP and len(stopped.output_token_ids) == 2
    assert ignoring.finish_reason is FinishReason.LENGTH and len(ignoring.output_token_ids) == 5


def test_stop_token_ids_stop_even_with_ignore_eos():
    engine = FakeEngine(next_token=lambda r: 42)
    r = request("a", 3, max_new_tokens=5, ignore_eos=True, stop_token_ids=(42,))
    run_all(make_scheduler(), engine, [r])
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == [42]


def test_max_model_len_ends_a_request():
    r = request("a", 8, max_new_tokens=50)
    run_all(make_scheduler(max_model_len=12), FakeEngine(), [r])
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 12


def test_too_long_prompt_fails_alone():
    scheduler = make_scheduler(max_model_len=10)
    bad, good = request("bad", 10), request("good", 3)
    finished = run_all(scheduler, FakeEngine(), [bad, good])
    assert {r.request_id for r in finished} == {"bad", "good"}
    assert bad.finish_reason is FinishReason.ERROR and "max_model_len" in bad.error
    assert good.finish_reason is FinishReason.LENGTH and len(good.output_token_ids) == 3


def test_prompt_over_prefill_budget_is_prefilled_in_chunks():
    scheduler, engine = make_scheduler(max_prefill_tokens=8), FakeEngine()
    long = request("long", 20, max_new_tokens=2)
    run_all(scheduler, engine, [long])
    assert engine.scheduled == [[8], [8], [4], [1]]
    assert [statuses for _, _, statuses in engine.batches[:3]] == [[RequestStatus.PREFILLING]] * 3
    assert long.finish_reason is FinishReason.LENGTH and long.output_token_ids == [120, 121]


def test_a_chunked_prompt_leaves_the_rest_of_the_budget_to_the_next_request():
    scheduler, engine = make_scheduler(max_prefill_tokens=8), FakeEngine()
    run_all(scheduler, engine, [request("long", 12), request("short", 3)])
    assert engine.batches[0][1] == ["long"] and engine.scheduled[0] == [8]
    assert engine.batches[1][1] == ["long", "short"] and engine.scheduled[1] == [4, 3]


def test_request_larger_than_the_pool_fails_alone():
    bad = request("bad", 30, max_new_tokens=10)
    ok = request("ok", 4)
    run_all(make_scheduler(num_blocks=4, block_size=4), FakeEngine(), [bad, ok])
    assert bad.finish_reason is FinishReason.ERROR and "KV blocks" in bad.error
    assert ok.finish_reason is FinishReason.LENGTH


def test_small_pool_preempts_the_newest_request_and_recomputes_it():
    # 6 usable blocks of 4: three 8-token prompts fit (2 blocks each); each decode past a block
    # boundary needs another, so the newest requests are preempted, then recomputed.
    def make_requests() -> list[Request]:
        return [request(str(i), 8, max_new_tokens=6) for i in range(3)]

    scheduler = make_scheduler(batch_size=8, num_blocks=7, block_size=4, prefix_caching=False)
    engine = FakeEngine()
    requests = make_requests()
    finished = run_all(scheduler, engine, requests)
    assert len(finished) == 3 and all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert scheduler.num_preemptions >= 2
    assert engine.batches[0][1] == ["0", "1", "2"]
    assert engine.batches[1] == (False, ["0", "1"], [RequestStatus.RUNNING] * 2)  # "2" preempted for "0"
    # A recomputed request feeds its prompt and the outputs it had (here 1), and keeps them.
    recompute = next(i for i, (prefill, ids, _) in enumerate(engine.batches) if prefill and i > 0 and "2" in ids)
    assert engine.scheduled[recompute][engine.batches[recompute][1].index("2")] == 9
    unconstrained = make_requests()
    run_all(make_scheduler(batch_size=8), FakeEngine(), unconstrained)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in unconstrained]
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_a_preempted_request_reuses_its_own_cached_blocks_when_readmitted():
    # 7 usable blocks of 4: "a" (8 tokens) and "b" (16) take 6. At the first decode "a" takes the
    # last free block and "b" preempts itself; its 4 blocks stay cached until "a" needs one more
    # (its tail block goes first), so readmitted it finds 3 blocks (12 tokens) and feeds 5.
    scheduler, engine = make_scheduler(batch_size=8, num_blocks=8, block_size=4), FakeEngine()
    first, second = request("a", 8, max_new_tokens=6), request("b", 16, max_new_tokens=6)
    unconstrained = [request("a", 8, max_new_tokens=6), request("b", 16, max_new_tokens=6)]
    run_all(scheduler, engine, [first, second])
    assert scheduler.num_preemptions == 1
    recompute = next(i for i, (prefill, ids, _) in enumerate(engine.batches) if prefill and i > 0 and "b" in ids)
    assert engine.scheduled[recompute] == [17 - 12]
    assert scheduler.kv_cache_manager.num_hit_tokens == 12
    run_all(make_scheduler(batch_size=8), FakeEngine(), unconstrained)
    assert [first.output_token_ids, second.output_token_ids] == [r.output_token_ids for r in unconstrained]


def test_preempted_request_goes_back_to_the_front_of_the_waiting_queue():
    scheduler, engine = make_scheduler(batch_size=2, num_blocks=5, block_size=4), FakeEngine()
    first, second, third = request("a", 8, max_new_tokens=2), request("b", 8, max_new_tokens=2), request("c", 4)
    for r in (first, second, third):
        scheduler.add_request(r)
    run_step(scheduler, engine)  # prefill a and b: 4 of 4 usable blocks
    run_step(scheduler, engine)  # a needs a block: b is preempted
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1


def test_blocks_follow_sequence_growth_and_are_freed_at_finish():
    scheduler, engine = make_scheduler(block_size=4), FakeEngine()
    r = request("a", 4, max_new_tokens=3)
    scheduler.add_request(r)
    run_step(scheduler, engine)
    assert len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == 1
    run_step(scheduler, engine)  # feeds token 5 -> needs a second block
    assert len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == 2
    run_step(scheduler, engine)
    assert scheduler.kv_cache_manager.get_block_ids("a") == [[]]
    assert scheduler.kv_cache_manager.num_free_blocks == 63  # all but the null block


def test_step_record_reports_phase_batch_tokens_and_the_time_of_the_forward_pass():
    now = [0.0]
    scheduler = Scheduler(
        SchedulerLimits(4, 1000, 100),
        KVCacheManager(64, 4, [attention_spec(1, 8, torch.float32)]),
        eos_token_ids={EOS},
        clock=lambda: now[0],
    )

    class SlowEngine(FakeEngine):
        def new_tokens(self, batch: Batch) -> list[list[int]]:
            now[0] += 0.007
            return super().new_tokens(batch)

    scheduler.add_request(request("a", 5))
    scheduler.add_request(request("b", 7))
    record = run_step(scheduler, SlowEngine()).record
    assert (record.step, record.phase, record.batch_size, record.num_tokens) == (1, "prefill", 2, 12)
    assert record.step_time_ms == pytest.approx(7.0) and "prefill" in record.log_line()


class MultiTokenEngine(FakeEngine):
    """Returns three tokens per request per step, as a verify step that accepts every draft would."""

    def __init__(self, tokens: Callable[[Request], list[int]]) -> None:
        super().__init__()
        self.tokens = tokens

    def new_tokens(self, batch: Batch) -> list[list[int]]:
        super().new_tokens(batch)
        return [self.tokens(r) for r in batch.requests]


def test_several_tokens_per_step_are_cut_at_a_stop_token_and_at_max_new_tokens():
    def three_tokens(r: Request) -> list[int]:
        start = len(r.output_token_ids)
        if r.request_id == "stops":
            return [[10, 11, 12], [13, 42, 14]][start // 3]  # 42 is a stop token, in the middle
        if r.request_id == "eos":
            return [20, EOS, 21]
        return [30 + start, 31 + start, 32 + start]

    engine = MultiTokenEngine(three_tokens)
    stops = request("stops", 3, max_new_tokens=10, stop_token_ids=(42,))
    eos = request("eos", 3, max_new_tokens=10)
    capped = request("capped", 3, max_new_tokens=4)
    run_all(make_scheduler(), engine, [stops, eos, capped])
    assert stops.output_token_ids == [10, 11, 12, 13, 42] and stops.finish_reason is FinishReason.STOP
    assert eos.output_token_ids == [20, EOS] and eos.finish_reason is FinishReason.STOP
    assert capped.output_token_ids == [30, 31, 32, 33] and capped.finish_reason is FinishReason.LENGTH


def test_after_a_multi_token_step_the_next_step_feeds_every_token_not_yet_computed():
    engine = MultiTokenEngine(lambda r: [7, 8, 9])
    r = request("a", 4, max_new_tokens=6)
    run_all(make_scheduler(), engine, [r])
    assert engine.scheduled == [[4], [3]]  # the prompt, then the three tokens of the first step
    assert r.output_token_ids == [7, 8, 9, 7, 8, 9]


def test_empty_prompt_fails_alone():
    r = Request("e", "", [], SamplingParams())
    finished = run_all(make_scheduler(), FakeEngine(), [r])
    assert finished == [r] and r.error == "empty prompt"


def test_token_ids_between_spans_prompt_and_output():
    r = make_request("a", [1, 2, 3], [4, 5])
    assert r.token_ids_between(0, 3) == [1, 2, 3]
    assert r.token_ids_between(4, 5) == [5]
    assert r.token_ids_between(2, 5) == [3, 4, 5]


class ScriptedRunner:
    """Returns the StepResults it is given, one per step, and records every batch it saw."""

    def __init__(self, results: list[StepResult]) -> None:
        self.results = results
        self.batches: list[Batch] = []

    def execute(self, batch: Batch) -> StepResult:
        self.batches.append(batch)
        return self.results[len(self.batches) - 1]


def test_the_scheduler_applies_a_step_result_accepted_drafts_logprobs_and_next_drafts():
    """The runner only returns what a step computed; the scheduler writes it into the request."""
    scheduler = make_scheduler(block_size=4)
    r = request("a", 5, max_new_tokens=10, logprobs=0)
    logprob = [TokenLogprobs(token_id, -0.5) for token_id in (11, 5, 9)]
    runner = ScriptedRunner(
        [
            StepResult([[11]], [0], [[logprob[0]]], next_drafts=[[5, 6]]),  # prefill: one token, two drafts
            StepResult([[5, 9]], [1], [logprob[1:]], next_drafts=[[]]),  # verify: draft 5 accepted, 6 rejected
        ]
    )
    scheduler.add_request(r)
    run_step(scheduler, runner)
    assert (r.num_computed_tokens, r.output_token_ids, r.spec_token_ids) == (5, [11], [5, 6])
    record = run_step(scheduler, runner).record
    assert runner.batches[1].draft_token_ids == [[5, 6]] and runner.batches[1].num_scheduled_tokens == [3]
    # fed 11, 5, 6: the K/V of the rejected 6 is void
    assert (r.num_computed_tokens, r.output_token_ids, r.spec_token_ids) == (7, [11, 5, 9], [])
    assert r.output_logprobs == logprob
    assert (record.num_draft_tokens, record.num_accepted_tokens, record.num_verified_requests) == (2, 1, 1)
    assert (record.drafted_per_position, record.accepted_per_position) == ([1, 1], [1, 0])


def test_lookahead_slots_are_allocated_with_the_step_and_given_back_after_a_verify():
    """num_lookahead_tokens (MTP's drafts after the first) are slots past the fed tokens, allocated
    by the scheduler through allocate_slots; a verify step's unused ones are freed after it."""
    scheduler = Scheduler(
        SchedulerLimits(4, 1000, 100),
        KVCacheManager(64, 4, [attention_spec(1, 8, torch.float32)]),
        eos_token_ids={EOS},
        num_lookahead_tokens=3,
    )
    r = request("a", 4, max_new_tokens=10)
    runner = ScriptedRunner(
        [StepResult([[11]], [0], [[]], next_drafts=[[5, 6]]), StepResult([[5, 9]], [1], [[]], next_drafts=[[]])]
    )
    scheduler.add_request(r)
    run_step(scheduler, runner)
    assert len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == 2  # 4 prompt tokens + 3 lookahead
    run_step(scheduler, runner)
    assert r.num_tokens == 7 and len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == 2  # tail freed


def test_the_kv_cache_manager_reports_a_prefix_hit_and_the_scheduler_applies_it():
    scheduler, engine = make_scheduler(block_size=4), FakeEngine()
    first = request("a", 9)
    run_all(scheduler, engine, [first])
    second = make_request("b", first.prompt_token_ids)
    scheduler.add_request(second)
    run_step(scheduler, engine)
    assert engine.scheduled[-1] == [1] and second.num_computed_tokens == 9  # 8 cached tokens, the last computed


def test_max_prefill_requests_caps_the_requests_of_each_prefill_step():
    """cp_mini_batch under context parallel: 5 waiting prompts prefill 2, 2, then 1 at a time."""
    scheduler, engine = make_scheduler(batch_size=8), FakeEngine()
    scheduler.limits.max_prefill_requests = 2
    run_all(scheduler, engine, [request(f"r{index}", 3) for index in range(5)])
    prefill_sizes = [len(ids) for is_prefill, ids, _ in engine.batches if is_prefill]
    assert prefill_sizes == [2, 2, 1]
