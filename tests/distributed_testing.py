"""Run a function on N local processes joined in one torch.distributed group, without torchrun.

`run_on_ranks(world, fn, *args)` spawns `world` processes; process r joins a group (gloo on CPU,
NCCL with one GPU per rank) through a rendezvous file, calls `fn(rank, world, *args)` and sends
its return value back. Returns the values in rank order, or raises with the failing rank's
traceback. `fn` must be importable by module path (spawned processes import it afresh).
"""

from __future__ import annotations

import os
import queue as queues
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, backend, init_file, fn, args, queue):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        try:
            result = fn(rank, world, *args)
            # Every rank finishes its P2P traffic before any tears the group down.
            dist.barrier()
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, "error", traceback.format_exc()))


def run_on_ranks(world: int, fn, *args, backend: str = "gloo", timeout: float = 240.0) -> list:
    """`fn(rank, world, *args)` on `world` spawned processes; their return values by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world, backend, init_file, fn, args, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors = []
        deadline = time.monotonic() + timeout
        while len(results) < world and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queues.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # killed without a word (a signal): nothing more will arrive
                    errors.append(f"ranks {dead} exited with {[procs[r].exitcode for r in dead]}")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout} s with ranks {sorted(results)} done")
                continue
            if status == "error":
                # The others may wait forever on the failed rank: stop at the first report.
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
