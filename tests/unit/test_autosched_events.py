"""The event engine under both simulators: resources, constraints, callbacks, deadlocks."""

import pytest

from recsys_pipe.autosched.events import Deadlock, EventEngine


def test_ordered_resources_serve_in_insertion_order_and_record_the_binding_constraint():
    e = EventEngine()
    e.resource("cpu")
    e.resource("gpu")
    a = e.add("a", 2.0, ["cpu"])
    b = e.add("b", 1.0, ["cpu"])  # after a on the cpu
    k = e.add("k", 3.0, ["gpu"])
    e.after(k, a, at="start", reason="launched by a")  # starts with a
    e.after(b, k, lag=0.5, reason="k's result")
    t = e.run()
    assert (t.start[a], t.start[k], t.start[b]) == (0.0, 0.0, 3.5)
    assert t.bound[b].reason == "k's result" and t.bound[b].span == k
    assert t.bound[a] is None


def test_a_first_come_resource_goes_to_whoever_asks_first():
    e = EventEngine()
    e.resource("link", "first_come")
    e.resource("x")
    e.resource("y")
    late = e.add("late", 1.0, ["x"])
    gate = e.add("gate", 2.0, ["y"])
    e.after(late, gate, reason="gate")  # ready at 2
    early = e.add("early", 3.0, ["link"])  # ready at 0: gets the link first
    second = e.add("second", 1.0, ["link"])  # ready at 0 too, added later: waits for early
    t = e.run()
    assert (t.start[early], t.start[second]) == (0.0, 3.0)
    assert t.bound[second].reason == "busy link" and t.followed[second] == (early,)
    assert t.start[late] == 2.0


def test_a_callback_can_constrain_spans_not_yet_ready():
    e = EventEngine()
    e.resource("r")
    host = e.add("host", 1.0, ["r"])
    dev = e.add("dev", 1.0)
    other = e.add("other", 5.0)
    e.after(dev, host, at="start", reason="submission")

    def on_start(span, time):
        if span == host:
            e.after(dev, other, reason="decided at run time")

    t = e.run(on_start)
    assert t.start[dev] == 5.0 and t.bound[dev].reason == "decided at run time"


def test_a_cycle_of_waits_is_a_deadlock_naming_the_spans():
    e = EventEngine()
    e.resource("r0")
    e.resource("r1")
    a0 = e.add(("rank0", "a"), 1.0, ["r0"])
    b0 = e.add(("rank0", "b"), 1.0, ["r0"])
    a1 = e.add(("rank1", "a"), 1.0, ["r1"])
    b1 = e.add(("rank1", "b"), 1.0, ["r1"])
    e.after(a0, b1)
    e.after(a1, b0)
    with pytest.raises(Deadlock) as info:
        e.run()
    assert info.value.stuck[("rank0", "a")] == [("rank1", "b")]
    assert "4 span(s) can never start" in str(info.value)


def test_bad_input_is_refused():
    e = EventEngine()
    with pytest.raises(KeyError, match="unknown resource 'r'"):
        e.add("x", 1.0, ["r"])
    with pytest.raises(ValueError, match="duration must be a finite number"):
        e.add("x", -1.0)
    x = e.add("x", 1.0)
    with pytest.raises(ValueError, match="lag must be >= 0"):
        e.after(x, x, lag=-1)
