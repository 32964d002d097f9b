"""``python -S launch_client.py NAME PROGRAM [its arguments]``: one run of ``PROGRAM``
(``torchrun`` or ``k3-train``) by the warm server on the abstract Unix socket ``NAME``
(launch_server.py), with this process's standard streams, working directory and
environment; exits as that run did. Standard library only, no site: it starts in
milliseconds.

Killing this process (a test's timeout) ends the run's whole process tree: the server
sees the connection close.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

# The wire format, which launch_server.py imports from here: the request's length (sent
# with the client's 3 streams), then the request; the launch's exit status back.
HEADER = struct.Struct("!Q")
STATUS = struct.Struct("!i")


def main(name: str, program: str, args: list[str]) -> int:
    request = json.dumps({"program": program, "args": args, "cwd": os.getcwd(),
                          "env": dict(os.environ)}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.connect("\0" + name)
        socket.send_fds(server, [HEADER.pack(len(request))], [0, 1, 2])
        server.sendall(request)
        reply = b""
        while len(reply) < STATUS.size:
            chunk = server.recv(STATUS.size - len(reply))
            if not chunk:
                print("launch_client: the launch server went away", file=sys.stderr)
                return 1
            reply += chunk
    (status,) = STATUS.unpack(reply)
    if status < 0:  # killed by a signal: end the same way
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
