"""Task declaration: both forms normalise the same way; task-level mistakes fail at construction."""

import pytest

from recsys_pipe.engine import DataSlot, Task, TaskGraphValidationError


class CountTokens(Task):
    name = "count_tokens"
    lookahead = 2
    reads = ("batch_gpu",)
    writes = (DataSlot("tokens", 2),)
    cross_iter_depends_on = ("h2d",)
    depends_on = "prep"

    def run(self, ctx):
        ctx.slots.set("tokens", 1)


def test_class_attribute_form_is_normalised():
    t = CountTokens()
    assert t.reads == (DataSlot("batch_gpu", 2),)
    assert t.writes == (DataSlot("tokens", 2),)
    assert t.cross_iter_depends_on == (("h2d", -1),)
    assert t.depends_on == ("prep",)


def test_from_fn_matches_class_form():
    t = Task.from_fn(
        "count_tokens",
        lambda ctx: None,
        lookahead=2,
        reads=["batch_gpu"],
        writes=[("tokens", 2)],
        cross_iter_depends_on=["h2d"],
        depends_on=["prep"],
    )
    c = CountTokens()
    for field in ("reads", "writes", "cross_iter_depends_on", "depends_on", "lookahead", "stream"):
        assert getattr(t, field) == getattr(c, field)


def test_replace_reresolves_bare_slots_at_new_lookahead():
    t = Task.from_fn("h2d", lambda ctx: None, lookahead=2, reads=["batch_cpu"], writes=["batch_gpu", ("pinned", 0)])
    t3 = t.replace(lookahead=3)
    assert t3.reads == (DataSlot("batch_cpu", 3),)
    assert t3.writes == (DataSlot("batch_gpu", 3), DataSlot("pinned", 0))
    assert t.lookahead == 2 and t3.fn is t.fn


@pytest.mark.parametrize(
    "fields, field, fragment",
    [
        ({"lookahead": -1}, "lookahead", ">= 0"),
        ({"lookahead": 1.5}, "lookahead", ">= 0"),
        ({"depends_on": ["a"], "same_progress_sync": ["a"]}, "same_progress_sync", "only one of"),
        ({"depends_on": ["a"], "cross_iter_depends_on": [("a", -1)]}, "cross_iter_depends_on", "only one of"),
        ({"cross_iter_depends_on": [("a", 0)]}, "cross_iter_depends_on", "negative"),
        ({"cross_iter_depends_on": [("a", 2)]}, "cross_iter_depends_on", "negative"),
        ({"reads": [("x", -1)]}, "reads", ">= 0"),
        ({"writes": [42]}, "writes", "name or [name, batch_offset]"),
        ({"depends_on": ["t"]}, "depends_on", "itself"),
        ({"depends_on": ["a", "a"]}, "depends_on", "twice"),
        ({"stream": ""}, "stream", "non-empty"),
        ({"nccl": "yes"}, "nccl", "true or false"),
    ],
)
def test_task_level_mistakes_raise_at_construction(fields, field, fragment):
    with pytest.raises(TaskGraphValidationError) as info:
        Task.from_fn("t", lambda ctx: None, **fields)
    problem = info.value.problems[0]
    assert (problem.task, problem.field) == ("t", field)
    assert fragment in problem.message
    assert "task 't'" in str(info.value)


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="lookahed"):
        Task.from_fn("t", lambda ctx: None, lookahed=1)
