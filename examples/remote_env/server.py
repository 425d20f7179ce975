"""A remote environment: `word_reverse`, served as its own process over `arlo.v1.Environment`.

It uses only grpcio and the stubs generated from protos/arlo/v1/env.proto, so it reads like
what you would write in any language with gRPC: implement five RPCs, keep sessions in a
dict, answer errors with status codes. Register it with the gateway by address:

    env_gateway:
      remotes:
        - address: 127.0.0.1:50070
          env_names: [word_reverse]

Run: `python examples/remote_env/server.py --port 50070` (prints "listening on HOST:PORT").
Set REMOTE_ENV_TOKEN to require `authorization: Bearer <token>` on every call.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc

from arlo.proto.v1 import common_pb2, env_pb2, env_pb2_grpc

NAME = "word_reverse"
WORDS = ("kestrel", "harbour", "lantern", "granite", "meadow", "compass", "thimble", "orchard", "saffron",
         "tundra", "quiver", "marble", "beacon", "falcon", "juniper", "voyage")
MAX_TURNS = 3
IDLE_TIMEOUT_S = 600.0
MAX_SESSIONS = 10_000
MAX_ACTION_BYTES = 64 * 1024


class Episode:
    def __init__(self, word: str, max_turns: int) -> None:
        self.word = word
        self.max_turns = max_turns
        self.turns = 0
        self.done = False
        self.last_used = time.monotonic()


class WordReverse(env_pb2_grpc.EnvironmentServicer):
    def __init__(self, token: str | None) -> None:
        self._token = token
        self._lock = threading.Lock()  # the server runs handlers on a thread pool
        self._episodes: dict[str, Episode] = {}

    def _check_auth(self, context: grpc.ServicerContext) -> None:
        if self._token is None:
            return
        sent = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self._token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    def ListEnvironments(self, request, context):
        self._check_auth(context)
        return env_pb2.ListEnvironmentsResponse(environments=[env_pb2.EnvironmentInfo(
            name=NAME, description="Reply with the given word spelled backwards. Config: max_turns (int, 1-10).",
            tools_json="[]", max_turns=10)])

    def Reset(self, request, context):
        self._check_auth(context)
        if request.env_name != NAME:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown environment {request.env_name!r}; known: ['{NAME}']")
        try:
            config = json.loads(request.config_json or "{}")
            max_turns = int(config.pop("max_turns", MAX_TURNS))
        except (ValueError, TypeError, AttributeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"config_json: {e}")
        if config or not 1 <= max_turns <= 10:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "config_json: only max_turns (1-10) is known")
        word = random.Random(request.seed).choice(WORDS)
        session_id = uuid.uuid4().hex
        with self._lock:
            self._expire()
            if len(self._episodes) >= MAX_SESSIONS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open sessions")
            self._episodes[session_id] = Episode(word, max_turns)
        prompt = common_pb2.Message(role="user", content=f"Spell '{word}' backwards.")
        return env_pb2.ResetResponse(session_id=session_id, observation=[prompt], tools_json="[]",
                                     task_id=f"{NAME}-{word}")

    def _expire(self) -> None:
        cutoff = time.monotonic() - IDLE_TIMEOUT_S
        for sid in [s for s, e in self._episodes.items() if e.last_used < cutoff]:
            del self._episodes[sid]

    def _step(self, step: env_pb2.StepRequest) -> tuple[grpc.StatusCode, str, env_pb2.StepResponse | None]:
        if len(step.action.encode()) > MAX_ACTION_BYTES:
            return grpc.StatusCode.INVALID_ARGUMENT, f"action is over {MAX_ACTION_BYTES} bytes", None
        with self._lock:
            episode = self._episodes.get(step.session_id)
            if episode is None:
                return grpc.StatusCode.NOT_FOUND, f"session {step.session_id!r} is unknown or expired", None
            if episode.done:
                return grpc.StatusCode.FAILED_PRECONDITION, "the episode is over; call Reset", None
            episode.turns += 1
            episode.last_used = time.monotonic()
            answer, reference = step.action.strip(), episode.word[::-1]
            correct = answer == reference
            episode.done = correct or episode.turns >= episode.max_turns
            turns, done = episode.turns, episode.done
        info = json.dumps({"turns": turns, "correct": correct})
        if done:
            return grpc.StatusCode.OK, "", env_pb2.StepResponse(done=True, reward=float(correct), answer=answer,
                                                                reference=reference, info_json=info)
        hint = common_pb2.Message(role="user", content="Not quite. Try again.")
        return grpc.StatusCode.OK, "", env_pb2.StepResponse(observation=[hint], info_json=info)

    def Step(self, request, context):
        self._check_auth(context)
        code, message, response = self._step(request)
        if response is None:
            context.abort(code, message)
        return response

    def StepBatch(self, request, context):
        self._check_auth(context)
        if not 1 <= len(request.steps) <= 256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "send 1 to 256 steps")
        results = []
        for step in request.steps:
            code, message, response = self._step(step)
            results.append(env_pb2.StepResult(code=code.value[0], message=message, response=response))
        return env_pb2.StepBatchResponse(results=results)

    def Close(self, request, context):
        self._check_auth(context)
        with self._lock:
            self._episodes.pop(request.session_id, None)  # closing an unknown session is fine
        return env_pb2.CloseResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50070, help="0 picks a free port")
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    env_pb2_grpc.add_EnvironmentServicer_to_server(WordReverse(os.environ.get("REMOTE_ENV_TOKEN") or None), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    stop = threading.Event()
    # Before the ready line: whoever reads it may stop us at once, and a SIGTERM that came before
    # the handler would kill the process uncleanly (-15) instead of stopping the server.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"listening on {args.host}:{port}", flush=True)
    stop.wait()
    server.stop(grace=2.0).wait()
    sys.exit(0)


if __name__ == "__main__":
    main()
