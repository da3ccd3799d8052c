"""recir-pipeline-sparse on gloo ranks: ms/step of the software-pipelined step against the unpipelined one.

Not a test: `uv run python benchmarks/pipeline_sparse.py [--world 2 --rows 98304 --tables 4 --batch 256]`.
Each rank captures a DLRM-like model (pooled tables + MLP, Adam), shards the tables row-wise (ids travel by
all-to-all), compiles the per-device program with recir.lower_gpu (Inductor on the CPU) once as it is and
once pipelined (`--stages`), and times both, interleaved, over `--rounds` rounds of `--steps` steps. A torch
profiler trace of a few steps of each goes to `--trace DIR` (chrome trace JSON; open in Perfetto), and the
table prints how long each step sat in `wait_tensor` (blocked on a collective): the pipelined step waits for
batch i+1's ids only after batch i's compute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RECIR_VERIFY", "0")

from distributed import DLRMLike, _batch, _loss  # noqa: E402 - the model of benchmarks/distributed.py


def _waits(prof: torch.profiler.profile) -> float:
    """Microseconds spent in wait_tensor (blocked on a collective) in the profiled steps."""
    return sum(e.cpu_time_total for e in prof.key_averages() if "wait_tensor" in e.key)


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        _run(rank, args)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace) -> None:
    import recir.distributed as rd
    from recir.capture import capture_train_step
    from recir.embedding import EmbeddingBagOverride
    from recir.lower_gpu import GPUOptions
    from recir.lower_gpu import compile as lower_gpu
    from recir.transforms import PipelinedStep

    torch.manual_seed(0)
    model = DLRMLike(args.tables, args.rows, args.dim, args.dense, args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    batches = [_batch(args) for _ in range(args.steps)]
    step = capture_train_step(model, opt, _loss, batches[0], overrides=[EmbeddingBagOverride()])
    plan = rd.plan(step, rd.HybridParallel(tables=rd.row_wise()), rd.Mesh(axes={"data": args.world}))
    dstep = rd.distribute(step, plan, rank)
    options = GPUOptions(inductor_config=dict(args.inductor or ()))

    def lower(s):  # noqa: ANN001, ANN202
        return lower_gpu(s, plan, device="cpu", options=options)

    started = time.perf_counter()
    plain = lower(dstep)
    pipe = PipelinedStep.build(dstep, stages=args.stages, compile=lower)
    state_plain = plain.init_state(model, opt)
    state_pipe = pipe.load_state_dict(dstep.state_dict(dstep.init_state(model, opt)))
    for batch in batches[:2]:  # compile both (and the prologue)
        state_plain, _ = plain(state_plain, batch)
        state_pipe, _ = pipe(state_pipe, batch)
    if rank == 0:
        print(f"compiled both in {time.perf_counter() - started:.1f} s", flush=True)

    def timed(fn, state):  # noqa: ANN001, ANN202
        dist.barrier()
        t0 = time.perf_counter()
        for batch in batches:
            state, _ = fn(state, batch)
        dist.barrier()
        return state, (time.perf_counter() - t0) * 1e3 / len(batches)

    ms: dict[str, list[float]] = {"unpipelined": [], "pipelined": []}
    for _ in range(args.rounds):
        state_plain, t = timed(plain, state_plain)
        ms["unpipelined"].append(t)
        state_pipe, t = timed(pipe, state_pipe)
        ms["pipelined"].append(t)
    waits = {}
    for name, fn, state in (("unpipelined", plain, state_plain), ("pipelined", pipe, state_pipe)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for batch in batches[: args.trace_steps]:
                state, _ = fn(state, batch)
        waits[name] = _waits(prof) / 1e3 / args.trace_steps
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace) / f"{name}_rank{rank}.json"))
    if rank == 0:
        base = statistics.median(ms["unpipelined"])
        print(
            f"\n{'step':<14}{'min ms':>9}{'median ms':>11}{'vs unpipelined':>16}{'wait_tensor ms/step':>21}"
        )
        for name, values in ms.items():
            med = statistics.median(values)
            print(f"{name:<14}{min(values):>9.2f}{med:>11.2f}{base / med:>15.2f}x{waits[name]:>21.2f}")
        info = pipe.steady
        carried = [s for s in getattr(info, "step", info).signature.state if s.kind == "carry"]
        nbytes = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in carried)
        print(f"\ncarried per stage: {len(carried)} tensors, {nbytes / 1024:.1f} KiB (stages {args.stages})")
        if args.trace:
            print(f"traces: {args.trace}/{{unpipelined,pipelined}}_rank<r>.json")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=98304)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank")
    parser.add_argument("--ids-per-sample", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--trace", default=None, help="directory for the profiler traces")
    parser.add_argument("--trace-steps", type=int, default=5)
    parser.add_argument(
        "--overlap-passes",
        default="",
        help="Inductor's comm/compute reordering passes for both steps, e.g. sink_waits,raise_comms",
    )
    args = parser.parse_args()
    passes = [p for p in args.overlap_passes.split(",") if p]
    args.inductor = (
        {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": passes}
        if passes
        else {}
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
