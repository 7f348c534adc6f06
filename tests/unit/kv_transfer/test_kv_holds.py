"""When a prefill rank frees a request's blocks: never early, never twice, always in the end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.kv_transfer.holds import Done, Holds


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_freed_after_the_last_read_and_only_once():
    clock = Clock()
    holds = Holds(30, clock=clock)
    holds.hold("a")
    holds.done("a", "d", [0, 1], reads_total=4)
    assert holds.take_finished() == set()
    holds.done("a", "d", [1, 2], reads_total=4)  # a repeated id does not count twice
    assert holds.take_finished() == set()
    holds.done("a", "d", [3], reads_total=4)
    assert holds.take_finished() == {"a"}
    holds.done("a", "d", [3], reads_total=4)  # late duplicate
    assert holds.take_finished() == set() and len(holds) == 0


def test_unread_ranks_and_aborts_free_at_once_and_early_messages_wait():
    clock = Clock()
    holds = Holds(30, clock=clock)
    holds.done("b", "d", [], reads_total=0)  # before the scheduler handed "b" over
    assert holds.take_finished() == set()
    holds.hold("b")
    assert holds.take_finished() == {"b"}


def test_the_lease_frees_what_decode_never_asks_for_and_renewals_extend_it():
    clock = Clock()
    holds = Holds(30, clock=clock)
    holds.hold("c")
    holds.hold("d")
    clock.now = 20
    holds.renew(["d"])
    clock.now = 31
    assert holds.take_finished() == {"c"}
    clock.now = 49
    assert holds.take_finished() == set()
    clock.now = 51
    assert holds.take_finished() == {"d"}


def test_unknown_requests_cannot_grow_memory_without_bound():
    holds = Holds(30, max_early=3, clock=Clock())
    assert all(holds.done(f"x{i}", "d", [0], 2) == Done.EARLY for i in range(3))
    assert holds.done("x3", "d", [0], 2) == Done.DROPPED


def test_reads_reported_after_the_lease_ran_out_are_flagged_stale():
    """The decode side must learn that the blocks it read may have been reused."""
    clock = Clock()
    holds = Holds(30, max_expired=2, clock=clock)
    for request_id in ("e", "f", "g"):
        holds.hold(request_id)
    holds.done("f", "d", [0], 2)
    clock.now = 31
    assert holds.take_finished() == {"e", "f", "g"}
    clock.now = 1000  # long after: still known as expired (bounded by count, not time)
    assert holds.take_finished() == set()
    assert holds.done("f", "d", [1], 2) == Done.EXPIRED and holds.done("g", "d", [0], 1) == Done.EXPIRED
    assert holds.done("e", "d", [0], 1) == Done.EARLY  # the oldest expiry was forgotten (max_expired=2)
    holds.hold("h")
    assert holds.done("h", "d", [0], 1) == Done.COUNTED and holds.take_finished() == {"h"}
    assert holds.done("h", "d", [0], 1) == Done.COUNTED  # a duplicate after a normal release is harmless


def test_a_request_held_for_several_readers_is_freed_by_the_last():
    """A parallel-sampling request read by n decode requests: each reader is counted on its
    own, and only the last frees the blocks."""
    holds = Holds(30, clock=Clock())
    holds.hold("n", readers=3)
    assert holds.done("n", "child-0", [0, 1], 2) == Done.COUNTED
    assert holds.done("n", "child-0", [0, 1], 2) == Done.COUNTED  # a repeat counts once
    assert holds.done("n", "child-1", [], 0) == Done.COUNTED  # done without reading (the prefix cache had it)
    assert holds.take_finished() == set()
    assert holds.done("n", "child-2", [1], 2) == Done.COUNTED and holds.take_finished() == set()
    assert holds.done("n", "child-2", [0], 2) == Done.COUNTED and holds.take_finished() == {"n"}


def test_a_reader_that_was_not_counted_before_the_release_is_told_not_held():
    """Fail closed (issue 59): a second reader of a request held for one, or a forged or late
    reader, learns that nothing vouched for the blocks it read (they may be reused)."""
    holds = Holds(30, clock=Clock())
    holds.hold("a")
    assert holds.done("a", "first", [0], 1) == Done.COUNTED and holds.take_finished() == {"a"}
    assert holds.done("a", "second", [0], 1) == Done.NOT_HELD
    assert holds.done("a", "first", [0], 1) == Done.COUNTED  # the reader that was counted, repeating
    assert holds.renew(["a"]) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.data())
def test_any_order_of_messages_frees_each_request_exactly_once(total, data):
    """Done messages of several decode ranks, in any order, split any way, some repeated,
    before or after the hold: the request is freed exactly once, and not before every
    read id has been heard."""
    clock = Clock()
    holds = Holds(1000, clock=clock)
    ids = list(range(total))
    chunks = data.draw(
        st.lists(st.lists(st.sampled_from(ids), min_size=1, max_size=total), min_size=1, max_size=6)
    )
    chunks.append(data.draw(st.permutations(ids)))  # every id is heard at least once
    hold_at = data.draw(st.integers(0, len(chunks)))
    heard, freed = set(), 0
    for i, chunk in enumerate(chunks):
        if i == hold_at:
            holds.hold("r")
        holds.done("r", "d", chunk, total)
        heard |= set(chunk)
        got = holds.take_finished()
        if got:
            assert heard == set(ids) and i >= hold_at
        freed += len(got)
    if hold_at == len(chunks):
        holds.hold("r")
        freed += len(holds.take_finished())
    assert freed == 1


def test_empty_steps_wait_for_news_and_steps_with_work_never_wait():
    """The worker side's pacing of empty steps (pacer.IdlePacer). The waits are long
    (30 s) so that a step that wrongly waited for them fails the generous bounds below."""
    import threading
    import time

    from vllm.ascend.kv_transfer.pacer import IdlePacer

    pacer = IdlePacer(wait=30)
    start = time.monotonic()
    pacer.pace(idle=False)
    assert time.monotonic() - start < 5, "a step with work waited"

    threading.Timer(0.2, pacer.news).start()  # a done message arrives during an empty step
    start = time.monotonic()
    pacer.pace(idle=True)
    assert 0.1 < time.monotonic() - start < 5, "an empty step did not wake on news"

    pacer.news()  # news during a step with work is reported by that step; the next empty one waits again
    pacer.pace(idle=False)
    short = IdlePacer(wait=0.3)
    start = time.monotonic()
    short.pace(idle=True)
    assert time.monotonic() - start >= 0.3, "an empty step without news did not wait"
