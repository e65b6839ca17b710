"""A spawned tensor-parallel worker (ranks 1..N-1 of the "mp" launcher; see engine/tp.py).

Rank 0 starts it as `python -m npuspec.engine.tp_worker` (see `entry`). It builds the same
`LLM` as rank 0 (which joins the group and loads this rank's shard), says
"ready", then replays rank 0's calls from its pipe: "add" (a request, seed included, so its
generator draws what rank 0's does), "abort", "step", "stop". It exits when the pipe closes
(rank 0 is gone) or a call fails, after telling rank 0 why.
"""
from __future__ import annotations

import signal
import sys
import traceback
from multiprocessing.connection import Connection


def entry(argv: list[str]) -> None:
    """`python -m npuspec.engine.tp_worker CONN_FD ALIVE_FD RANK`: rank 0's socket, and the
    pipe end whose closing at exit tells rank 0 (held open, never written). The first message
    is (world, init_method, llm_kwargs)."""
    conn, rank = Connection(int(argv[0])), int(argv[2])
    try:
        _world, init_method, llm_kwargs = conn.recv()  # the size is in llm_kwargs too
    except Exception as e:  # noqa: BLE001 - an argument rank 0 pickled but this one cannot load
        _report(conn, rank, e)
        sys.exit(1)
    main(rank, init_method, llm_kwargs, conn)


def main(rank: int, init_method: str, llm_kwargs: dict, conn) -> None:
    # Ctrl-C in a terminal signals the whole process group: rank 0 shuts the workers down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # imported inside the try: an import error is reported to rank 0 like any other
        from npuspec.engine.llm import LLM
        llm = LLM.for_worker(llm_kwargs, rank, init_method)
    except BaseException as e:  # noqa: B902 - every failure goes back to rank 0
        _report(conn, rank, e)
        sys.exit(1)
    conn.send(("ready",))
    try:
        _loop(conn, llm)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0 is gone
    except BaseException as e:  # noqa: B902
        _report(conn, rank, e)
        llm.tp.shutdown()
        sys.exit(1)
    llm.tp.shutdown()


def _loop(conn, llm) -> None:
    from npuspec.engine.request import rebuild_request  # loaded by main's import already
    while True:
        msg = conn.recv()
        op = msg[0]
        if op == "step":
            llm.step()
        elif op == "add":
            llm.add_request(rebuild_request(msg[1], llm.device), arrival_time=msg[2])
        elif op == "abort":
            llm.abort_request(msg[1])
        elif op == "stop":
            return
        else:
            raise AssertionError(msg)


def _report(conn, rank: int, e: BaseException) -> None:
    try:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    except OSError:
        pass
    print(f"npuspec tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}",
          flush=True)


if __name__ == "__main__":
    entry(sys.argv[1:])
