"""Scheduler: the request state machine, prefill-first batching and its budgets, with a fake engine."""

from collections.abc import Callable

from executor.core.kv_cache import KVCacheManager
from executor.core.scheduler import Scheduler, SchedulerLimits
from executor.core.types_ import Batch, FinishReason, Request, RequestStatus, SamplingParams

EOS = 0


class FakeEngine:
    """Returns next_token(request) for each request and records every batch it saw."""

    def __init__(self, next_token: Callable[[Request], int] = lambda r: 100 + r.num_tokens) -> None:
        self.next_token = next_token
        self.batches: list[tuple[bool, list[str], list[RequestStatus]]] = []

    def forward_batch(self, batch: Batch) -> list[int]:
        self.batches.append(
            (batch.is_prefill, [r.request_id for r in batch.requests], [r.status for r in batch.requests])
        )
        return [self.next_token(r) for r in batch.requests]


def make_scheduler(
    batch_size: int = 4,
    max_prefill_tokens: int = 1000,
    max_model_len: int = 100,
    num_blocks: int = 64,
    block_size: int = 4,
) -> Scheduler:
    return Scheduler(
        SchedulerLimits(batch_size, max_prefill_tokens, max_model_len),
        KVCacheManager(num_blocks, block_size),
        eos_token_ids={EOS},
    )


def request(request_id: str, prompt_len: int, max_new_tokens: int = 3, **params) -> Request:
    return Request(request_id, None, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens, **params))


def run_all(scheduler: Scheduler, engine: FakeEngine, requests: list[Request]) -> list[Request]:
    for r in requests:
        scheduler.add_request(r)
    finished = []
    while scheduler.has_work():
        finished.extend(scheduler.run_step(engine).finished)
    return finished


def test_request_walks_waiting_prefilling_running_finished():
    scheduler, engine = make_scheduler(), FakeEngine()
    r = request("a", 5, max_new_tokens=3)
    scheduler.add_request(r)
    assert r.status is RequestStatus.WAITING
    scheduler.run_step(engine)
    assert engine.batches[0] == (True, ["a"], [RequestStatus.PREFILLING])
    assert r.status is RequestStatus.RUNNING and len(r.output_token_ids) == 1
    scheduler.run_step(engine)
    assert engine.batches[1] == (False, ["a"], [RequestStatus.RUNNING])
    output = scheduler.run_step(engine)
    assert output.finished == [r] and r.status is RequestStatus.FINISHED
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 3
    assert not scheduler.has_work()


def test_prefill_comes_before_decode():
    scheduler, engine = make_scheduler(), FakeEngine()
    scheduler.add_request(request("a", 4, max_new_tokens=5))
    scheduler.run_step(engine)
    scheduler.add_request(request("b", 4, max_new_tokens=5))
    scheduler.run_step(engine)
    assert engine.batches[1][:2] == (True, ["b"])
    scheduler.run_step(engine)
    assert engine.batches[2][:2] == (False, ["a", "b"])


def test_batch_size_caps_running_requests():
    scheduler, engine = make_scheduler(batch_size=2), FakeEngine()
    finished = run_all(scheduler, engine, [request(str(i), 3) for i in range(5)])
    assert len(finished) == 5
    assert max(len(ids) for _, ids, _ in engine.batches) == 2


def test_max_prefill_tokens_splits_prefill_batches():
    scheduler, engine = make_scheduler(max_prefill_tokens=10), FakeEngine()
    run_all(scheduler, engine, [request("a", 6), request("b", 6), request("c", 4)])
    prefills = [ids for is_prefill, ids, _ in engine.batches if is_prefill]
    assert prefills == [["a"], ["b", "c"]]


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


def test_prompt_over_prefill_budget_fails_alone():
    bad = request("bad", 20)
    run_all(make_scheduler(max_prefill_tokens=16), FakeEngine(), [bad, request("ok", 4)])
    assert bad.finish_reason is FinishReason.ERROR and "max_prefill_tokens" in bad.error


def test_request_larger_than_the_pool_fails_alone():
    bad = request("bad", 30, max_new_tokens=10)
    ok = request("ok", 4)
    run_all(make_scheduler(num_blocks=4, block_size=4), FakeEngine(), [bad, ok])
    assert bad.finish_reason is FinishReason.ERROR and "KV blocks" in bad.error
    assert ok.finish_reason is FinishReason.LENGTH


def test_small_pool_makes_requests_wait_but_all_complete():
    # Each request needs up to 3 blocks (8 prompt + 4 new = 12 tokens); 7 blocks hold two at a time.
    scheduler, engine = make_scheduler(batch_size=8, num_blocks=7, block_size=4), FakeEngine()
    requests = [request(str(i), 8, max_new_tokens=4) for i in range(6)]
    finished = run_all(scheduler, engine, requests)
    assert len(finished) == 6 and all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert max(len(ids) for _, ids, _ in engine.batches) == 2
    assert scheduler.kv_cache_manager.num_free_blocks == 7


def test_blocks_follow_sequence_growth_and_are_freed_at_finish():
    scheduler, engine = make_scheduler(block_size=4), FakeEngine()
    r = request("a", 4, max_new_tokens=3)
    scheduler.add_request(r)
    scheduler.run_step(engine)
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 1
    scheduler.run_step(engine)  # feeds token 5 -> needs a second block
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 2
    scheduler.run_step(engine)
    assert scheduler.kv_cache_manager.get_block_ids("a") == []
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_step_record_reports_phase_batch_and_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", 5))
    scheduler.add_request(request("b", 7))
    record = scheduler.run_step(FakeEngine()).record
    assert (record.step, record.phase, record.batch_size, record.num_tokens) == (1, "prefill", 2, 12)
    assert record.step_time_ms >= 0 and "prefill" in record.log_line()


def test_empty_prompt_fails_alone():
    r = Request("e", "", [], SamplingParams())
    finished = run_all(make_scheduler(), FakeEngine(), [r])
    assert finished == [r] and r.error == "empty prompt"


def test_token_ids_between_spans_prompt_and_output():
    r = Request("a", None, [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    assert r.token_ids_between(0, 3) == [1, 2, 3]
    assert r.token_ids_between(4, 5) == [5]
    assert r.token_ids_between(2, 5) == [3, 4, 5]
