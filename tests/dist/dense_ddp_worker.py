"""Worker of the `trainer.dense_ddp` equality tests: megatron-core's DDP against torch DDP.

    python tests/dist/dense_ddp_worker.py OUT_DIR --device cuda     # tests/cuda: one GPU, NCCL
    python tests/dist/dense_ddp_worker.py OUT_DIR --device cpu      # CPU counterpart, gloo
    torchrun --nproc_per_node 2 tests/dist/dense_ddp_worker.py OUT_DIR --device cpu

Trains `model=dlrm_torch` from the same initial weights on the same batches with
`trainer.dense_ddp=torch` and `=megatron`, through the serial plan and a threaded one with lookaheads,
with `torch.use_deterministic_algorithms(True)`, and records after every optimizer step the loss,
every gradient and every parameter; plus how the megatron state is wired. Writes
`rank<r>.pt` into OUT_DIR; the tests compare.

On CUDA the model is built by `build_model`, exactly as the trainer builds it. On the CPU, where
megatron-core's DDP is refused (its gradient buffers are allocated on
`torch.cuda.current_device()`), `torch.cuda.current_device` is pointed at the CPU for this
process and the same steps are taken by hand (`megatron_ddp`): that one redirect is all that
differs; megatron-core's DDP, its buffers, hooks and finalize_model_grads run for real on gloo.
Imports no torchrec.
"""

import argparse
import hashlib
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts

import torch

from recsys_pipe.data import make_dataloader
from recsys_pipe.engine import TaskObserver
from recsys_pipe.runtime import init_distributed
from recsys_pipe.testing import end_rank, load_run
from recsys_pipe.train import build_model, build_plan_runner, build_state, training_plan
from recsys_pipe.train.dense_ddp import megatron_ddp
from recsys_pipe.train.optim import dense_optimizer_factory

PLANS = {"serial": ["pipeline=serial"], "hstu_prefetch": ["pipeline=hstu_prefetch", "pipeline.executor=threaded"]}
DENSE = ("torch", "megatron")


class StepRecorder(TaskObserver):
    """When a batch's optimizer step has finished (on the task's thread and stream: the copies
    see the step's writes): a digest of the bytes of every gradient and of every parameter, and
    the tensors themselves after the last step (to say by how much two runs differ, if they do)."""

    def __init__(self, module):
        self.named = list(module.named_parameters())
        self.grad_digests, self.param_digests = [], []
        self.last_grads, self.last_params = {}, {}

    def task_finished(self, task, batch_index, iteration, failed):
        if task.name == "optimizer_step" and not failed:
            self.last_grads = {n: p.grad.detach().cpu().clone() for n, p in self.named}
            self.last_params = {n: p.detach().cpu().clone() for n, p in self.named}
            self.grad_digests.append(digest(self.last_grads))
            self.param_digests.append(digest(self.last_params))


def digest(tensors):
    """Of the bytes of every tensor, zeros compared by value (as `torch.equal` does): `+ 0.0` turns
    -0.0 into +0.0 and leaves every other number as it is. megatron-core adds each gradient to a
    zeroed buffer, which gives +0.0 where backward produced -0.0; torch DDP copies it."""
    h = hashlib.sha256()
    for name, value in tensors.items():
        h.update(name.encode())
        h.update((value + 0.0).contiguous().numpy().tobytes())
    return h.hexdigest()


def build(run, info, spec):
    if run.trainer.dense_ddp == "megatron" and info.device.type == "cpu":  # see the module docstring
        torch.manual_seed(run.seed)
        model = megatron_ddp(run.model.build(spec))
        return model, dense_optimizer_factory(run.optimizer)(model.parameters())
    return build_model(run, info, spec)


def megatron_wiring(model, state):
    """How the megatron run is wired, read off the live objects (before close)."""
    from megatron.core import parallel_state

    buffers = model.buffers
    storages = {b.grad_data.untyped_storage().data_ptr() for b in buffers}
    return {
        "grad_buffers": type(state.grad_buffers).__name__,
        "model_parallel_initialized": parallel_state.model_parallel_is_initialized(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "tensor_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "grad_buffer_devices": sorted({str(b.grad_data.device) for b in buffers}),
        # after the optimizer step every .grad is a view of megatron's buffer, not a copy
        "grads_are_buffer_views": all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() in storages for p in model.parameters()
        ),
    }


def train(overrides, info, steps):
    run = load_run(*overrides)
    plan = training_plan(run)
    loader = make_dataloader(run.data, info.rank, info.world_size)
    model, optimizer = build(run, info, loader.dataset.spec)
    state = build_state(run, plan, model, optimizer, info)
    runner = build_plan_runner(plan, state.streams, state)
    recorder = StepRecorder(model.module)
    runner.observer = recorder
    batches = iter(loader)
    runner.seed_first_batch(batches, state.bootstrap(next(batches)))
    try:
        losses = [float(result.loss) for result in runner.iterate(batches)]
        wiring = megatron_wiring(model, state) if run.trainer.dense_ddp == "megatron" else {}
    finally:
        runner.shutdown()
        state.close()
    if wiring:
        from megatron.core import parallel_state

        wiring["model_parallel_initialized_after_close"] = parallel_state.model_parallel_is_initialized()
    assert len(losses) == steps, (len(losses), steps)
    return {
        "losses": losses,
        "grad_digests": recorder.grad_digests,
        "param_digests": recorder.param_digests,
        "last_grads": recorder.last_grads,
        "last_params": recorder.last_params,
        "wiring": wiring,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    if args.device == "cpu":
        torch.set_num_threads(1)
        torch.cuda.current_device = lambda: torch.device("cpu")  # megatron-core's buffer device; see above
    info = init_distributed(args.device)
    common = [
        "model=dlrm_torch",
        "data=criteo_synthetic",
        "data.batch_size=32",
        "data.num_embeddings=200",
        f"data.num_batches={args.steps}",
        f"data.pin_memory={str(args.device == 'cuda').lower()}",
        "trainer.max_steps=null",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        f"trainer.device={args.device}",
    ]
    results = {
        f"{dense}/{plan}": train([*common, *overrides, f"trainer.dense_ddp={dense}"], info, args.steps)
        for plan, overrides in PLANS.items()
        for dense in DENSE
    }
    results["torchrec_imported"] = "torchrec" in sys.modules
    end_rank(os.path.join(args.out, f"rank{info.rank}.pt"), results)


if __name__ == "__main__":
    main()
