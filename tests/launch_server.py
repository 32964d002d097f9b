"""A warm start for the tests' processes: each torchrun launch meant to succeed, and each
``k3-train`` run, is a fork of this process.

``python launch_server.py NAME`` imports torch and the k3 packages once, then serves on
the abstract Unix socket ``NAME``. A client (launch_client.py) sends its standard streams,
working directory, environment, a program (``torchrun`` or ``k3-train``) and its
arguments; the server forks, the fork becomes that client's process (its streams,
directory and environment, a session of its own) and runs the program's own entry point
there with those arguments:

- ``torchrun``: torchrun's ``main``, which the tests give ``--run-path --start-method
  fork``: torchrun's agent, rendezvous and ranks, each rank a fork of a process that has
  the imports done;
- ``k3-train``: ``k3_trainer.cli.main``, as ``python -m k3_trainer.cli`` runs it.

The fork's exit status goes back to the client, which exits with it. A client that goes
away (its test timed out and killed it) takes its run's whole process tree with it; so
does the server's end, when the pytest worker that started it closes its standard input
or dies.

Why: on two cores a test's small run otherwise spends most of its CPU time importing
torch and the k3 packages: in torchrun's agent and again in every rank, or in the one
``k3-train`` process (a few CPU-seconds each), then a second or so tearing the
interpreter down at the end.

Launches whose failure is under test use the ``torchrun`` command unchanged
(``test_distributed_training.torchrun``), and ``k3-train`` runs with fault injection or
another thread count a new interpreter (``harness.k3_train``). Nothing in the packages
imports this file.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import traceback
from pathlib import Path

import numpy  # noqa: F401
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.run
import torch.distributed.tensor
import torch.nn.parallel
from harness import kill_tree
from launch_client import HEADER, STATUS  # the wire format, defined once

import k3_checkpoint  # noqa: F401
import k3_model  # noqa: F401
import k3_optim  # noqa: F401
import k3_trainer.cli
import k3_trainer.distributed
import k3_trainer.session

# Read when libgomp loads, with torch, so a fork cannot change it: a run that asks for
# another count is refused rather than run with this one.
THREADS = os.environ.get("OMP_NUM_THREADS")
# What ``python -m k3_trainer.cli`` puts in ``sys.argv[0]``.
CLI_MAIN = str(Path(k3_trainer.cli.__file__).with_name("__main__.py"))


def _torchrun(args: list[str]) -> None:
    sys.argv = ["torchrun", *args]
    torch.distributed.run.main(args)


def _k3_train(args: list[str]) -> None:
    sys.argv = [CLI_MAIN, *args]
    try:
        code = k3_trainer.cli.main()
    finally:  # what the interpreter's exit waits for, before os._exit skips it
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    raise SystemExit(code)


PROGRAMS = {"torchrun": _torchrun, "k3-train": _k3_train}


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, HEADER.size, 3)
    if len(fds) != 3:
        raise ConnectionError(f"a request brings 3 streams, this one {len(fds)}")
    while len(data) < HEADER.size:
        data += connection.recv(HEADER.size - len(data))
    (length,) = HEADER.unpack(data)
    body = b""
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        body += chunk
    return json.loads(body), fds


def _launch(request: dict, fds: list[int], inherited: list[int]) -> None:
    """In the fork: become the client's process and run its program; never returns."""
    code = 1
    try:
        os.setsid()
        for fd in inherited:  # the listener, the clients and the other launches' pidfds
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("OMP_NUM_THREADS") != THREADS:
            print(f"launch_server: this run asks for OMP_NUM_THREADS="
                  f"{os.environ.get('OMP_NUM_THREADS')}, the server imported torch with "
                  f"{THREADS}; start it in a new interpreter", file=sys.stderr)
            code = 2
            return
        PROGRAMS[request["program"]](request["args"])
        code = 0
    except SystemExit as stop:  # as the interpreter would end: a message is printed
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the interpreter's teardown is the second it would cost


def serve(name: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(8)
    print("ready", flush=True)
    launches: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, client)
    clients: dict[int, int] = {}  # client's fd -> pidfd
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin, *launches, *clients], [], [])
            if sys.stdin in ready and not sys.stdin.buffer.read1(1):
                return  # the pytest worker is gone or done
            if listener in ready:
                connection, _ = listener.accept()
                request, fds = _receive(connection)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    inherited = [listener.fileno(), connection.fileno(), *launches, *clients]
                    _launch(request, fds, inherited)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                launches[pidfd] = (pid, connection)
                clients[connection.fileno()] = pidfd
            for fd in ready:
                if fd in launches:  # a launch ended: its status to its client
                    pid, connection = launches.pop(fd)
                    del clients[connection.fileno()]
                    _, status = os.waitpid(pid, 0)
                    with connection:
                        connection.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
                    os.close(fd)
                elif fd in clients and fd not in launches:  # a client went away
                    pidfd = clients.pop(fd)
                    pid, connection = launches.pop(pidfd)
                    kill_tree(pid)
                    os.waitpid(pid, 0)
                    connection.close()
                    os.close(pidfd)
    finally:
        for pid, _ in launches.values():
            kill_tree(pid)


if __name__ == "__main__":
    serve(sys.argv[1])
