"""Redis coordination: the trajectory stream, the weight-version pointer, heartbeats and typed
status records, the admission counters, run keys."""

from arlo.coord.client import connect
from arlo.coord.heartbeat import Heartbeat, read_statuses
from arlo.coord.keys import Keys, delete_run
from arlo.coord.records import AdmissionCounters, RolloutStatus, ServiceStatus, read_service_statuses
from arlo.coord.stream import BacklogFull, StreamEntry, TrajectoryStream
from arlo.coord.weights import WeightPointer, WeightPointerState

__all__ = [
    "AdmissionCounters",
    "BacklogFull",
    "Heartbeat",
    "Keys",
    "RolloutStatus",
    "ServiceStatus",
    "StreamEntry",
    "TrajectoryStream",
    "WeightPointer",
    "WeightPointerState",
    "connect",
    "delete_run",
    "read_service_statuses",
    "read_statuses",
]
