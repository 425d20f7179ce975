"""Server bootstrap and client channels shared by every arlo service.

`start_server` gives each service the same grpc.aio server: health and reflection, bearer
auth (health exempt), Prometheus metrics, request ids in JSON logs, and INTERNAL (with a
logged traceback) for unexpected handler errors. `run_until_signal` is the `__main__` loop.
"""

from arlo.rpc.address import advertise_host
from arlo.rpc.auth import load_token
from arlo.rpc.client import make_channel
from arlo.rpc.limits import utf8_len, utf8_too_long
from arlo.rpc.logs import current_request_id, setup_logging, use_request_id
from arlo.rpc.server import RunningServer, ServiceBinding, run_until_signal, start_server

__all__ = [
    "RunningServer",
    "ServiceBinding",
    "advertise_host",
    "current_request_id",
    "load_token",
    "make_channel",
    "run_until_signal",
    "setup_logging",
    "start_server",
    "use_request_id",
    "utf8_len",
    "utf8_too_long",
]
