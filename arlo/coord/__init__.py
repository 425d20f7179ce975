"""Redis coordination: the trajectory stream, the weight-version pointer, heartbeats, run keys."""

from arlo.coord.client import connect
from arlo.coord.heartbeat import Heartbeat, read_statuses
from arlo.coord.keys import Keys, delete_run
from arlo.coord.stream import BacklogFull, StreamEntry, TrajectoryStream
from arlo.coord.weights import WeightPointer, WeightPointerState

__all__ = [
    "BacklogFull",
    "Heartbeat",
    "Keys",
    "StreamEntry",
    "TrajectoryStream",
    "WeightPointer",
    "WeightPointerState",
    "connect",
    "delete_run",
    "read_statuses",
]
