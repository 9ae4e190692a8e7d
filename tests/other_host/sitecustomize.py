"""Put first on a child's PYTHONPATH with ``OTHER_HOST`` set: the child takes itself for a process of that host
(``socket.gethostname``), as a run started on another machine of a cluster does; no PID of it can be checked here."""

import os
import socket

if os.environ.get("OTHER_HOST"):
    socket.gethostname = lambda: os.environ["OTHER_HOST"]
