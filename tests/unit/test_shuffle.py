"""The balanced batch shuffler: the partition algorithm against references, the rank assignment,
sample selection on jagged batches, and the background solve under threaded execution."""

from __future__ import annotations

import itertools
import pickle
import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys_pipe.data import ITEM_KEY, SequenceBatch, SyntheticConfig, SyntheticDataConfig, make_dataloader
from recsys_pipe.data.batch import CriteoBatch, jagged_select, kjt_concat, kjt_select
from recsys_pipe.engine import PlanRunner, StreamPool, Task, TaskGraph, ThreadedExecutor
from recsys_pipe.models import HSTUConfig
from recsys_pipe.train import tasks
from recsys_pipe.train.shuffle import BatchBalancer, ShufflePlan, assign_to_ranks, karmarkar_karp, solve_shuffle
from recsys_pipe.train.state import TrainState

# -- the partition ------------------------------------------------------------------------------


def test_karmarkar_karp_hand_traced_example():
    """costs 1..8 into 2 parts: runs (1,2) (3,4) (5,6) (7,8) -> (1+4, 2+3) and (5+8, 6+7) ->
    (1,4 + 6,7) and (2,3 + 5,8): 18 each, the perfect split."""
    parts = karmarkar_karp([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert parts == [[0, 3, 5, 6], [1, 2, 4, 7]]


def _best_max(costs, k):
    """Exhaustive optimum of the equal-size partition (small n only)."""
    n, size, best = len(costs), len(costs) // k, float("inf")

    def rec(remaining, worst):
        nonlocal best
        if worst >= best:
            return
        if not remaining:
            best = worst
            return
        first, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, size - 1):
            part = (first, *others)
            rec([i for i in rest if i not in others], max(worst, sum(costs[i] for i in part)))

    rec(list(range(n)), 0.0)
    return best


@pytest.mark.parametrize("n,k", [(8, 2), (9, 3), (12, 4)])
def test_karmarkar_karp_is_an_equal_partition_close_to_the_optimum(n, k):
    rng = random.Random(n * 31 + k)
    ratios, contiguous = [], []
    for _ in range(30):
        costs = [rng.paretovariate(1.2) for _ in range(n)]  # heavy-tailed, like n^2 of Zipf lengths
        parts = karmarkar_karp(costs, k)
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert {len(p) for p in parts} == {n // k}
        sums = [sum(costs[i] for i in p) for p in parts]
        assert sums == sorted(sums)
        best = _best_max(costs, k)
        ratios.append(max(sums) / best)
        contiguous.append(max(sum(costs[r * (n // k) : (r + 1) * (n // k)]) for r in range(k)) / best)
    assert min(ratios) >= 1.0 - 1e-9
    assert sum(ratios) / len(ratios) < 1.05  # near-optimal on average
    assert sum(ratios) < sum(contiguous)  # and far better than training the batches as loaded


def test_karmarkar_karp_is_deterministic_and_rejects_unequal_sizes():
    costs = [3.0, 1.0, 3.0, 1.0, 2.0, 2.0]
    assert karmarkar_karp(costs, 3) == karmarkar_karp(list(costs), 3)
    with pytest.raises(ValueError, match="7 items cannot be split into 2 parts"):
        karmarkar_karp([1.0] * 7, 2)


def test_parts_go_to_the_rank_holding_most_of_them():
    # batch size 3: rank 0 holds 0,1,2; rank 1 holds 3,4,5
    assert assign_to_ranks([[3, 4, 0], [1, 2, 5]], 3) == [[1, 2, 5], [0, 3, 4]]
    assert assign_to_ranks([[0, 1, 2], [3, 4, 5]], 3) == [[0, 1, 2], [3, 4, 5]]


def test_solve_shuffle_reports_the_balance():
    costs = [9.0, 9.0, 1.0, 1.0]  # rank 0: 18, rank 1: 2 -> 1.8 before; 10 / 10 after
    plan = solve_shuffle(costs, 2)
    assert plan.imbalance_before == pytest.approx(1.8) and plan.imbalance_after == pytest.approx(1.0)
    assert sorted(i for p in plan.positions for i in p) == [0, 1, 2, 3]
    assert all(len(p) == 2 for p in plan.positions)


def test_equal_costs_keep_every_batch_where_it_was():
    """Nothing to balance (e.g. a model without a workload model): no sample moves, and the
    shuffler returns the batch itself without exchanging anything."""
    plan = solve_shuffle([1.0] * 8, 2)
    assert plan.positions == [[0, 1, 2, 3], [4, 5, 6, 7]] and plan.imbalance_after == plan.imbalance_before == 1.0
    balancer = BatchBalancer(lambda batch: torch.ones(batch.batch_size, dtype=torch.float64))
    batch = _criteo_batches(1, 4)[0]
    assert balancer.finish(batch, balancer.start(batch)) is batch
    balancer.close()


# -- selecting samples of jagged batches --------------------------------------------------------


def test_jagged_select_matches_a_python_reference():
    lengths = torch.tensor([2, 0, 3, 1])
    values = torch.arange(6 * 2).reshape(6, 2)  # rows grouped 2 | 0 | 3 | 1
    index = torch.tensor([2, 0, 3, 1, 2])
    rows, new_lengths = jagged_select(values, lengths, index)
    segments = torch.split(values, lengths.tolist())
    assert torch.equal(rows, torch.cat([segments[i] for i in index.tolist()]))
    assert new_lengths.tolist() == [3, 2, 1, 0, 3]


def _sequence_batch(batch_size=6, **data_kw) -> SequenceBatch:
    data = SyntheticDataConfig(
        batch_size=batch_size,
        max_seq_len=12,
        num_candidates=2,
        synthetic=SyntheticConfig(num_items=50, num_users=20, num_clusters=2, num_samples=200),
        **data_kw,
    )
    return next(iter(make_dataloader(data)))


def _samples(batch: SequenceBatch) -> list:
    """Per-sample view of a sequence batch, for comparisons."""
    out = []
    kjt = batch.sparse_features.to_dict()
    items = torch.split(batch.timestamps, batch.item_lengths().tolist())
    labels = torch.split(batch.labels, batch.num_candidates.tolist())
    for b in range(batch.batch_size):
        out.append(
            (
                int(batch.sample_ids[b]),
                {k: jt.to_dense()[b].tolist() for k, jt in kjt.items()},
                items[b].tolist(),
                labels[b].tolist(),
                int(batch.num_candidates[b]),
            )
        )
    return out


@pytest.mark.parametrize("use_user", [False, True])
def test_sequence_batch_select_and_concat_move_whole_samples(use_user):
    batch = _sequence_batch(use_user_feature=use_user)
    whole = _samples(batch)
    index = torch.tensor([4, 1, 5])
    picked = batch.select(index)
    assert _samples(picked) == [whole[i] for i in index.tolist()]
    rest = batch.select(torch.tensor([0, 2, 3]))
    joined = SequenceBatch.concat([picked, rest])
    assert _samples(joined) == [whole[i] for i in [4, 1, 5, 0, 2, 3]]
    assert torch.equal(joined.num_loss_tokens(), batch.num_loss_tokens())
    assert _samples(pickle.loads(pickle.dumps(joined))) == _samples(joined)  # what all_gather_object does


def test_kjt_select_and_concat_roundtrip():
    kjt = _sequence_batch(use_user_feature=True).sparse_features
    a, b = kjt_select(kjt, torch.tensor([0, 1, 2])), kjt_select(kjt, torch.tensor([3, 4, 5]))
    back = kjt_concat([a, b])
    assert back.keys() == kjt.keys()
    assert torch.equal(back.values(), kjt.values()) and torch.equal(back.lengths(), kjt.lengths())


def test_hstu_workload_model_is_quadratic_in_tokens():
    batch = _sequence_batch()
    cfg = HSTUConfig(embedding_dim=8, num_layers=3)
    n = batch.sparse_features[ITEM_KEY].lengths().double()
    assert torch.equal(cfg.sample_costs(batch), 3 * (4 * n * n * 8 + 10 * n * 64))
    with_user = _sequence_batch(use_user_feature=True)
    assert torch.equal(with_user.sequence_lengths(), with_user.item_lengths() + 1)


def test_zipf_lengths_have_a_heavy_tail():
    cfg = SyntheticConfig(num_items=50, num_users=20, num_clusters=2, num_samples=2000, min_seq_len=4)
    data = SyntheticDataConfig(max_seq_len=64, num_candidates=2, synthetic=cfg.model_copy(update={}))
    zipf = data.model_copy(update={"synthetic": cfg.model_copy(update={"length_distribution": "zipf"})})
    fixed = data.model_copy(update={"synthetic": cfg.model_copy(update={"length_distribution": "fixed"})})
    lengths = [len(zipf.dataset(0, 1)[i].items) for i in range(2000)]
    assert min(lengths) == 4 and max(lengths) > 40 and all(4 <= n <= 64 for n in lengths)
    assert sum(n == 4 for n in lengths) > sum(n > 32 for n in lengths) > 20  # mostly short, a long tail
    assert lengths == [len(zipf.dataset(0, 1)[i].items) for i in range(2000)]  # seeded
    assert {len(fixed.dataset(0, 1)[i].items) for i in range(50)} == {64}


# -- the background solve under threaded execution ---------------------------------------------


def _criteo_batches(num_batches: int, batch_size: int) -> list[CriteoBatch]:
    out = []
    for b in range(num_batches):
        ids = torch.arange(b * batch_size, (b + 1) * batch_size)
        out.append(
            CriteoBatch(
                dense_features=ids[:, None].float().repeat(1, 13),
                sparse_ids=ids[:, None].repeat(1, 26),
                labels=(ids % 2).float()[:, None],
                sample_ids=ids,
            )
        )
    return out


def _cost(batch: CriteoBatch) -> torch.Tensor:
    return ((batch.sample_ids * 7919) % 13).double()  # a fixed pseudo-random cost per sample


def _record(ctx):
    ctx.slots.set("step_result", ctx.slots["batch_gpu"].sample_ids.tolist())


def _run(executor, finish_lookahead: int, delays: list[float], batches) -> tuple[list, list]:
    """h2d and start_shuffle at lookahead 2; finish_shuffle at `finish_lookahead`; a consumer at 0.
    The solver sleeps (the thread's work) and orders each batch's samples by cost, so a batch
    trained with another batch's solution would come out in the wrong order."""
    solved = []
    lock = threading.Lock()

    def solver(costs, world):
        time.sleep(delays[len(solved) % len(delays)])
        with lock:
            solved.append(threading.current_thread().name)
        order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
        return ShufflePlan([order], 1.0, 1.0)

    pool = StreamPool.create(["default", "memcpy"])
    state = TrainState(
        model=None, optimizer=None, device=torch.device("cpu"), streams=pool, balancer=BatchBalancer(_cost, solver)
    )
    task_graph = TaskGraph.single_group(
        [
            Task.from_fn(
                "h2d",
                tasks.h2d,
                stream="memcpy",
                lookahead=2,
                reads=["batch_cpu"],
                writes=["unbalanced_batch", "torchrec_ctx"],
            ),
            Task.from_fn(
                "start_shuffle",
                tasks.start_shuffle,
                stream="memcpy",
                lookahead=2,
                reads=["unbalanced_batch"],
                writes=["shuffle_plan"],
                nccl=True,
            ),
            Task.from_fn(
                "finish_shuffle",
                tasks.finish_shuffle,
                stream="memcpy",
                lookahead=finish_lookahead,
                reads=[("unbalanced_batch", finish_lookahead), ("shuffle_plan", finish_lookahead)],
                writes=["batch_gpu"],
                nccl=True,
            ),
            Task.from_fn("train", _record, reads=["batch_gpu"], writes=["step_result"]),
        ]
    )
    with PlanRunner(task_graph, pool, executor, state=state) as runner:
        results = list(runner.iterate(batches))
    state.close()
    return results, solved


@settings(max_examples=15, deadline=None)
@given(
    finish_lookahead=st.sampled_from([1, 2]),
    thread_map=st.sampled_from(["per_task", "by_stream"]),
    delays=st.lists(st.floats(0.0, 0.004), min_size=1, max_size=5),
)
@pytest.mark.timeout(120)
def test_background_solve_never_races_its_batch(finish_lookahead, thread_map, delays):
    batches = _criteo_batches(12, 8)
    expected = []
    for b in batches:
        ids, cost = b.sample_ids.tolist(), _cost(b).tolist()
        expected.append([ids[i] for i in sorted(range(len(ids)), key=lambda i: (-cost[i], i))])
    sequential, _ = _run("sequential", finish_lookahead, delays, batches)
    threaded, solver_threads = _run(ThreadedExecutor(thread_map), finish_lookahead, delays, batches)
    assert sequential == threaded == expected  # every batch trained once, with its own solution
    assert len(solver_threads) == len(batches) and all(t.startswith("recsys-shuffle-solver") for t in solver_threads)


def test_a_failing_solve_fails_finish_shuffle_without_hanging():
    def broken(costs, world):
        raise RuntimeError("solver exploded")

    balancer = BatchBalancer(_cost, broken)
    future = balancer.start(_criteo_batches(1, 4)[0])
    with pytest.raises(RuntimeError, match="solver exploded"):
        balancer.finish(_criteo_batches(1, 4)[0], future)
    balancer.close()
