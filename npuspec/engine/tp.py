"""Tensor parallelism for the engine: the ranks, their launch, and what they exchange per step.

Every rank runs a whole engine replica (scheduler, block manager, model runner) over its
shard of the target, as SGLang's TP schedulers and vLLM's external launcher do: the ranks make
the same scheduling decisions from the same requests, so their steps issue the same
collectives in the same order. Per step they exchange only
- the drafts (rank 0 drafts, `sync_drafts` broadcasts [B, K]), unless the drafter is itself
  sharded (`draft_tensor_parallel_size` = N), when every rank drafts the same tokens;
- rank 0's verify result (`sync_result`, [rows, K+2] int32): every rank runs the verify op on
  the same gathered logits, but sampling draws and draft probabilities live on rank 0, so the
  other ranks adopt its tokens and never depend on their own draws.
Inside the step, the model's collectives (npuspec.kernels.collectives) carry the activations.

Launchers (`distributed_executor_backend`):
- "mp": `LLM(...)` in an ordinary process is rank 0. It starts ranks 1..N-1 as
  `python -m npuspec.engine.tp_worker` (never re-importing the user's `__main__`),
  each of which builds the same `LLM` and then mirrors rank 0's add_request / abort_request /
  step calls, sent over one pipe per worker. Rank 0 watches them: a dead worker fails the
  call in flight, and every later one, with an error naming its rank.
- "external_launcher": torchrun (or any launcher setting RANK / WORLD_SIZE / LOCAL_RANK)
  starts the N processes, and each runs the same user code: the same LLM(...) and the same
  calls in the same order (as vLLM's external launcher requires). Nothing is mirrored.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np
import torch

from npuspec import envs
from npuspec.kernels import collectives, shm_collectives

log = logging.getLogger("npuspec.engine")

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot continue."""


@dataclasses.dataclass
class Worker:
    rank: int
    proc: Any                  # WorkerProcess
    conn: Any                  # rank 0's end of the worker's pipe
    error: Optional[str] = None  # what the worker reported before it exited


class TP:
    """One process's view of the tensor-parallel group."""

    def __init__(self, rank: int, world: int, launcher: str, device: torch.device,
                 workers: list[Worker], store_dir: Optional[str]):
        self.rank, self.world, self.launcher, self.device = rank, world, launcher, device
        self.workers = workers
        self._store_dir = store_dir
        self.cpu_group = None      # gloo group for host data (drafts, results, objects)
        self.drafts_from_rank0 = True  # set by the LLM once it knows its drafter
        self.dead: Optional[str] = None
        self.closed = False
        self.shm = None  # kernels.shm_collectives.ShmComm, when the ranks use it

    @property
    def mirrors(self) -> bool:
        """Rank 0 of an "mp" group: its calls are sent to the workers."""
        return self.rank == 0 and bool(self.workers)

    # -- liveness ------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise WorkerDied if any worker has exited (or already had)."""
        if self.dead:
            raise WorkerDied(self.dead)
        for w in self.workers:
            if w.proc.exitcode is not None:
                self._died(w)

    def _died(self, w: Worker) -> None:
        if w.error is None and w.conn.poll():
            try:
                msg = w.conn.recv()
                if msg[0] == "error":
                    w.error = msg[1]
            except (EOFError, OSError):
                pass
        why = f": {w.error}" if w.error else ""
        code = w.proc.exitcode
        how = (f"was killed by {_signal_name(-code)}" if code < 0 else
               f"exited with code {code}")
        self.dead = (f"tensor-parallel worker rank {w.rank} (pid {w.proc.pid}) {how}{why}; "
                     f"the engine cannot continue (every pending request fails). Build a new "
                     f"LLM to go on.")
        raise WorkerDied(self.dead)

    def failed(self, exc: BaseException, wait_s: float = 5.0) -> None:
        """After `exc` escaped a call on rank 0: if a worker died (a collective with a dead
        peer fails with a connection error), raise WorkerDied naming it; else return and let
        the caller re-raise."""
        if not self.workers or isinstance(exc, WorkerDied):
            return
        deadline = time.monotonic() + wait_s  # its exit may lag its closed socket
        while time.monotonic() < deadline:
            for w in self.workers:
                if w.proc.exitcode is not None:
                    self._died(w)
            time.sleep(0.05)

    # -- mirroring (mp, rank 0) ----------------------------------------------------------------
    def mirror(self, msg: tuple) -> None:
        if not self.mirrors:
            return
        self.check_alive()
        for w in self.workers:
            try:
                w.conn.send(msg)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self.failed(WorkerDied(""), wait_s=5.0)
                raise

    # -- per-step exchanges --------------------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank (pickled over the gloo group: our own processes)."""
        box = [obj if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def broadcast_floats(self, xs: list) -> list:
        """rank 0's floats on every rank (the online K controller's step times)."""
        t = torch.tensor(xs, dtype=torch.float64)
        self._broadcast(t)
        return t.tolist()

    def _broadcast(self, t: torch.Tensor) -> None:
        collectives.gloo_call(
            lambda: torch.distributed.broadcast(t, src=0, group=self.cpu_group), t)

    def sync_drafts(self, drafts: Optional[np.ndarray], batch: int, k: int) -> np.ndarray:
        """Rank 0's drafts int64 [B, K] on every rank."""
        t = (torch.from_numpy(np.ascontiguousarray(drafts, dtype=np.int64)) if self.rank == 0
             else torch.empty((batch, k), dtype=torch.int64))
        assert tuple(t.shape) == (batch, k), (t.shape, batch, k)
        self._broadcast(t)
        return t.numpy()

    def sync_result(self, res: np.ndarray) -> np.ndarray:
        """Rank 0's verify result [rows, K+2] int32 on every rank."""
        t = torch.from_numpy(np.ascontiguousarray(res))
        self._broadcast(t)
        return t.numpy()

    # -- start-up and shutdown -----------------------------------------------------------------
    def wait_ready(self) -> None:
        """Rank 0 (mp): every worker built its engine (or raise naming the one that failed)."""
        from multiprocessing.connection import wait
        pending = {w.conn: w for w in self.workers}
        deadline = time.monotonic() + max(60.0, _timeout())
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel workers {sorted(w.rank for w in pending.values())} "
                                   f"did not finish starting within {_timeout():.0f} s; "
                                   f"raise NPUSPEC_TP_TIMEOUT if they are still loading")
            ready = wait(list(pending) + [w.proc.sentinel for w in pending.values()], left)
            for obj in ready:
                w = pending.get(obj) or next(x for x in pending.values()
                                             if x.proc.sentinel == obj)
                if obj is w.conn:
                    try:
                        msg = w.conn.recv()
                    except EOFError:
                        msg = ("error", None)
                    if msg[0] == "ready":
                        pending.pop(w.conn)
                        continue
                    w.error = msg[1]
                w.proc.join(5)
                self._died(w)

    def shutdown(self) -> None:
        """Stop the workers (rank 0, mp) and leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            try:
                w.conn.send(("stop",))
            except (OSError, EOFError):
                pass
        for w in self.workers:
            w.proc.join(10)
            if w.proc.exitcode is None:
                log.warning("npuspec: tensor-parallel worker rank %d did not stop; killing it",
                            w.rank)
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
        collectives.drain_gloo()  # before the interpreter can start to finalize
        collectives.set_group(None)
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tear down
                log.debug("destroy_process_group failed", exc_info=True)
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)


def _signal_name(n: int) -> str:
    import signal
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _timeout() -> float:
    return envs.tp_timeout()


def device_for(device: torch.device, local_rank: int) -> torch.device:
    """Rank `local_rank`'s device: cuda:i / npu:i on accelerators (one per rank), the CPU."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, local_rank)


def _init_group(backend: str, init_method: str, rank: int, world: int) -> None:
    _reset_group_names()
    torch.distributed.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=_timeout()))


def _reset_group_names() -> None:
    """torch.distributed names a process's default group by a counter ("0" in a fresh
    process) and prefixes the group's rendezvous keys with that name. A failed
    init_process_group (a worker that died while rank 0 waited) bumps the counter and nothing
    resets it, so the next LLM's rank 0 would wait under "1/" for fresh workers that publish
    under "0/": a hang until the timeout. With no group alive, restart the count as
    destroy_process_group does."""
    world = getattr(torch.distributed.distributed_c10d, "_world", None)
    if (world is not None and not torch.distributed.is_initialized()
            and getattr(world, "group_count", 0) != 0):
        log.debug("npuspec: resetting torch.distributed's group counter (%d) left by a "
                  "failed start", world.group_count)
        world.group_count = 0


def _init_watching(tp: TP, backend: str, init_method: str, world: int) -> None:
    """Rank 0's rendezvous, watching its workers: one that dies before joining would
    otherwise leave rank 0 waiting for it until the timeout. After such a death the waiting
    thread is ended (its store file removed) before this returns, so no half-made group
    outlives the failed start."""
    import threading
    err: list[BaseException] = []

    def join():
        try:
            _init_group(backend, init_method, 0, world)
        except BaseException as e:  # noqa: B902 - re-raised by the caller's thread
            err.append(e)

    t = threading.Thread(target=join, name="npuspec-tp-init", daemon=True)
    t.start()
    try:
        while t.is_alive():
            t.join(0.1)
            tp.check_alive()  # WorkerDied naming the rank
    except BaseException:
        store = init_method[len("file://"):]
        try:
            os.unlink(store)  # the waiting FileStore fails on its next poll
        except OSError:
            pass
        t.join(10)
        raise
    if err:
        raise err[0]


def start(parallel, device: torch.device, llm_kwargs: dict) -> TP:
    """Join (or, as rank 0 of "mp", first launch) the tensor-parallel group of a ParallelConfig
    (engine/config.py). `llm_kwargs`: the LLM's arguments, which every spawned worker builds
    its engine from."""
    world, launcher = parallel.world, parallel.launcher
    if torch.distributed.is_initialized():
        raise RuntimeError("LLM: tensor_parallel_size > 1 but this process already belongs to "
                           "a torch.distributed group; one tensor-parallel LLM per process: "
                           "shut the other down first (LLM.shutdown())")
    backend = BACKENDS[device.type]
    workers, store_dir = [], None
    if parallel.worker is not None:              # a spawned worker
        rank, init_method = parallel.worker
        local = rank
    elif launcher == "external_launcher":        # torchrun
        rank, _, local = envs.torchrun_rank()
        init_method = "env://"
    else:                                        # rank 0 of "mp": spawn the others
        rank = local = 0
        # 0700: only we can rendezvous (and map the shared-memory file); tmpfs when there is one
        shm_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        store_dir = tempfile.mkdtemp(prefix="npuspec-tp-", dir=shm_root)
        init_method = "file://" + os.path.join(store_dir, "store")
        shm = _shm_comm(device, 0, world, store_dir)  # before any worker opens it
        workers = _spawn(world, init_method, llm_kwargs)
    dev = device_for(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tp = TP(rank, world, launcher, dev, workers, store_dir)
    if parallel.worker is not None:
        shm = _shm_comm(device, rank, world, os.path.dirname(init_method[len("file://"):]))
    elif launcher == "external_launcher":
        shm = None  # torchrun's ranks may be on other hosts
    if shm is not None:
        shm.alive = tp.check_alive if rank == 0 else _parent_alive(os.getppid())
    try:
        if workers:
            _init_watching(tp, backend, init_method, world)
        else:
            _init_group(backend, init_method, rank, world)
        tp.cpu_group = (torch.distributed.group.WORLD if backend == "gloo"
                        else torch.distributed.new_group(backend="gloo"))
    except BaseException as e:
        try:
            tp.failed(e)  # a worker that died before joining: name it
        finally:
            tp.shutdown()
        raise
    collectives.set_group(torch.distributed.group.WORLD, shm)
    tp.shm = shm
    if device.type == "cpu" and launcher == "mp":
        # N ranks on one host share its cores: without this each would run one thread per
        # core and they would stall each other (OpenMP spin-waits)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return tp


SHM_CAP = 16 << 20  # bytes per rank and op: a batch of 16 x (K+1) rows of 48k-vocab logits


def _shm_comm(device: torch.device, rank: int, world: int, d: str):
    """Same-host CPU ranks' shared-memory collectives, or None (gloo) when NPUSPEC_TP_CPU_COMM
    says gloo, the device is not the CPU, or the kernel cannot be built (logged once)."""
    if device.type != "cpu" or envs.tp_cpu_comm() != "shm" or not shm_collectives.available():
        return None
    return shm_collectives.ShmComm(os.path.join(d, "shm"), rank, world, SHM_CAP,
                                   create=rank == 0, alive=None, timeout=_timeout())


def _parent_alive(ppid: int):
    """A worker's check while it waits on its peers: rank 0 (its parent) still runs."""
    def check():
        if os.getppid() != ppid:
            raise WorkerDied("tensor-parallel rank 0 exited; this worker stops")
    return check


def _spawn(world: int, init_method: str, llm_kwargs: dict) -> list[Worker]:
    """Start ranks 1..N-1 as `python -m npuspec.engine.tp_worker`, as torchrun starts its
    ranks: nothing re-imports the user's `__main__`, so a script read from standard input,
    `python -c` and notebooks work (multiprocessing's spawn re-runs `__main__` by its path,
    and `<stdin>` has none). Each worker gets one end of a socket pair for its messages and
    the write end of a pipe whose read end, here, becomes readable when it exits."""
    workers = []
    env = dict(os.environ)  # the parent's import path, as multiprocessing's spawn passes it
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for rank in range(1, world):
        parent, child = mp.Pipe(duplex=True)
        alive_r, alive_w = os.pipe()
        cmd = [sys.executable, "-m", "npuspec.engine.tp_worker", str(child.fileno()),
               str(alive_w), str(rank)]
        try:
            popen = subprocess.Popen(cmd, pass_fds=(child.fileno(), alive_w), env=env,
                                     start_new_session=False)
        finally:
            child.close()
            os.close(alive_w)
        proc = WorkerProcess(popen, alive_r)
        parent.send((world, init_method, llm_kwargs))
        workers.append(Worker(rank, proc, parent))
    return workers


class WorkerProcess:
    """The few multiprocessing.Process members the TP code reads, over a subprocess."""

    def __init__(self, popen: "subprocess.Popen", sentinel: int):
        self.popen, self.sentinel, self.pid = popen, sentinel, popen.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.poll()  # -N for a signal, as multiprocessing reports it

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()

    def __del__(self):
        try:
            os.close(self.sentinel)
        except OSError:
            pass
