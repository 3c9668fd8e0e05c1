"""CostModel JSON: round trip, hand-written minimal form, and clear errors."""

import pytest

from recsys_pipe.autosched import CostModel, TaskCost


def test_round_trip_through_a_file(tmp_path):
    model = CostModel(
        {
            "h2d": TaskCost(0.001, 0.002, stream="memcpy", lookahead=2, cpu_mean_s=0.0012, samples=20),
            "fwd": TaskCost(0.01, nccl=True),
        },
        {"plan": "p"},
        outside_tasks_s=0.003,
        outside_tasks_mean_s=0.004,
    )
    path = tmp_path / "costs.json"
    model.to_json(path)
    loaded = CostModel.from_json(path)
    assert loaded == model
    assert loaded["h2d"].stream == "memcpy" and loaded["fwd"].nccl


def test_hand_written_costs_need_only_cpu_and_device_time():
    model = CostModel.from_json('{"tasks": {"a": {"cpu_s": 0.5, "device_s": 0}}}')
    assert model["a"] == TaskCost(0.5, 0.0)
    assert model.meta == {} and model.outside_tasks_s == 0.0 and model.outside_tasks_mean_s is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"tasks": {"a": {"cpu_s": 1}}}', "task 'a': missing required field(s) device_s"),
        ('{"tasks": {"a": {"cpu_s": -1, "device_s": 0}}}', "cpu_s must be a finite number >= 0"),
        ('{"tasks": {"a": {"cpu_s": 1, "device_s": 0, "cpu": 2}}}', "unknown field(s) cpu"),
        ('{"tasks": [1]}', '"tasks" object'),
        ("{not json", "not valid JSON: line 1"),
        ('{"tasks": {}, "outside": 1}', "unknown top-level field(s) outside"),
        ('{"tasks": {}, "outside_tasks_s": -1}', "outside_tasks_s must be a finite number >= 0"),
    ],
)
def test_bad_cost_models_name_the_problem(text, fragment):
    with pytest.raises(ValueError, match=None) as info:
        CostModel.from_json(text)
    assert fragment in str(info.value)


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read cost model"):
        CostModel.from_json(tmp_path / "nope.json")


def test_unknown_task_lookup_lists_known_ones():
    with pytest.raises(KeyError, match="have: a"):
        CostModel({"a": TaskCost(1.0)})["b"]
