"""The gateway core: registry + sessions behind reset/step/close, and the routing of each call to
a local environment, an MCP server's environment or a remote backend. No gRPC servicer here, so
the agent loop's tests can drive it in-process.

`reset`/`step` run the environment in the caller's thread. `reset_async`/`step_async` run
environments marked `blocking` (code execution) in a bounded pool of worker threads, so one slow
program never stalls the event loop; cheap environments stay inline, where a batch of 64 steps
costs little more than one.

The `*_routed` calls (the servicer's) also reach remote backends (`remote.py`): a proxied
session id names its backend, and a proxied reply is returned as the backend's message, never
re-encoded. MCP environments are registered in the registry and run as local sessions; only
their descriptions are asked of the servers, live.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from arlo.jsonfields import parse_json_object
from arlo.proto.v1 import env_pb2
from services.env_gateway.envs.base import Environment, ResetResult, StepResult
from services.env_gateway.registry import EnvRegistry, EnvSpec
from services.env_gateway.sessions import Session, SessionBusyError, SessionStore

if TYPE_CHECKING:  # for types only: the in-process users of the core never load the MCP client
    from services.env_gateway.mcp_envs import McpEnvs
    from services.env_gateway.remote import RemoteBackend, RemoteEnvs

DEFAULT_BLOCKING_WORKERS = 8
MAX_NAMED = 32
"""Environment names an unknown-environment error lists (each at most 128 bytes)."""

Remaining = Callable[[], "float | None"]
"""What is left of the caller's deadline, asked afresh before each call that waits on it."""
StepOutcome = StepResult | BaseException | env_pb2.StepResult
"""One step of a batch: a local result, its expected or unexpected failure, or a proxied result
(already in wire form, error or not)."""


class UnknownEnvError(LookupError):
    pass


class InvalidConfigError(ValueError):
    """config_json is not valid, or the environment rejected it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    session_id: str
    result: ResetResult


def parse_config_json(text: str) -> dict[str, Any]:
    try:
        return parse_json_object(text, "config_json")
    except ValueError as e:
        raise InvalidConfigError(str(e)) from e


def _reset_env(env: Environment, seed: int, config: dict[str, Any]) -> ResetResult:
    try:
        return env.reset(seed, config)
    except ValueError as e:
        raise InvalidConfigError(str(e)) from e


class Gateway:
    def __init__(self, registry: EnvRegistry, sessions: SessionStore, *,
                 blocking_workers: int = DEFAULT_BLOCKING_WORKERS) -> None:
        self.registry = registry
        self.sessions = sessions
        self._blocking_workers = blocking_workers
        self._executor: ThreadPoolExecutor | None = None
        self.remotes: RemoteEnvs | None = None
        self.mcp: McpEnvs | None = None

    def attach(self, remotes: RemoteEnvs | None, mcp: McpEnvs | None) -> None:
        """The remote backends and MCP servers, once connected in the event loop that serves (the
        core is built before it, and in-process users build it with neither)."""
        self.remotes, self.mcp = remotes, mcp

    def _spec(self, env_name: str) -> EnvSpec:
        spec = self.registry.get(env_name)
        if spec is None:
            known = sorted([*self.registry.names(), *(self.remotes.names() if self.remotes else [])])
            # A status message travels in a header (8 KiB at most): a backend listing a thousand
            # environments made this one RESOURCE_EXHAUSTED on the client.
            more = f" and {len(known) - MAX_NAMED} more (ListEnvironments lists them)" if len(known) > MAX_NAMED else ""
            raise UnknownEnvError(f"unknown environment {env_name[:128]!r}; known: {known[:MAX_NAMED]}{more}")
        return spec

    def reset(self, env_name: str, config_json: str, seed: int, client: str = "") -> Started:
        """`client`: who asks (the gRPC peer), for the sessions' per-client bound."""
        spec = self._spec(env_name)
        if spec.asynchronous:
            raise TypeError(f"environment {env_name!r} is asynchronous: use reset_async")
        self.sessions.check_room(client)  # before building the environment it would not keep
        env = self.registry.create(spec)
        result = _reset_env(env, seed, parse_config_json(config_json))
        session = self.sessions.create(env_name, env, blocking=spec.blocking, client=client)
        return Started(session_id=session.id, result=result)

    def step(self, session_id: str, action: str) -> StepResult:
        """Raises SessionNotFoundError, EpisodeOverError, or whatever the environment raises."""
        session = self.sessions.get(session_id)
        if session.asynchronous:
            raise TypeError(f"session {session_id!r} is of an asynchronous environment: use step_async")
        return session.env.step(action)

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)

    async def reset_async(self, env_name: str, config_json: str, seed: int,
                          deadline_s: float | None = None, client: str = "") -> Started:
        """`deadline_s`: what is left of the caller's deadline (asynchronous environments heed it)."""
        spec = self._spec(env_name)
        self.sessions.check_room(client)
        if spec.asynchronous:
            config = parse_config_json(config_json)
            env: Any = self.registry.create(spec)
            try:
                result = await env.reset(seed, config, deadline_s)
            except ValueError as e:
                raise InvalidConfigError(str(e)) from e
            session = self.sessions.create(env_name, env, asynchronous=True, client=client)
            return Started(session_id=session.id, result=result)
        if not spec.blocking:
            return self.reset(env_name, config_json, seed, client)
        config = parse_config_json(config_json)

        def start() -> tuple[Environment, ResetResult]:
            env = self.registry.create(spec)  # may build a shared object (a sandbox) on first use
            return env, _reset_env(env, seed, config)

        env, result = await asyncio.wrap_future(self._pool().submit(start))
        session = self.sessions.create(env_name, env, blocking=True, client=client)
        return Started(session_id=session.id, result=result)

    async def step_async(self, session_id: str, action: str, deadline_s: float | None = None) -> StepResult:
        result = self.begin_step(session_id, action, deadline_s)
        return result if isinstance(result, StepResult) else await result

    def begin_step(self, session_id: str, action: str,
                   deadline_s: float | None = None) -> StepResult | asyncio.Future[StepResult]:
        """The result of a cheap step, or a future for a blocking one (already running in a worker)
        or an asynchronous one (a task on this loop, given `deadline_s`).

        StepBatch uses this to run a batch's cheap steps inline and the others concurrently.
        """
        session = self.sessions.get(session_id)
        if session.asynchronous:
            return self._start_async_step(session, action, deadline_s)
        if not session.blocking:
            return session.env.step(action)
        return asyncio.wrap_future(self._submit_step(session, action))

    @staticmethod
    def _start_async_step(session: Session, action: str, deadline_s: float | None) -> asyncio.Future[StepResult]:
        if session.busy:
            raise SessionBusyError(f"session {session.id!r} is still running its previous step; "
                                   "send one step at a time per session")
        session.busy = True
        env: Any = session.env
        task: asyncio.Future[StepResult] = asyncio.ensure_future(env.step(action, deadline_s))
        task.add_done_callback(lambda _: setattr(session, "busy", False))
        return task

    def _submit_step(self, session: Session, action: str) -> Future[StepResult]:
        if session.busy:
            raise SessionBusyError(f"session {session.id!r} is still running its previous step; "
                                   "send one step at a time per session")
        session.busy = True
        future = self._pool().submit(session.env.step, action)
        # Cleared when the step really ends (or is cancelled before it starts), not when the
        # caller stops waiting: an abandoned step may still be running in its thread.
        future.add_done_callback(lambda _: setattr(session, "busy", False))
        return future

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._blocking_workers, thread_name_prefix="env-step")
        return self._executor

    def shutdown(self) -> None:
        """Stops the worker threads once their steps finish; queued steps are cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def aclose(self) -> None:
        """Closes the remote channels, the MCP sessions (their processes) and the worker threads."""
        if self.remotes is not None:
            await self.remotes.aclose()
        if self.mcp is not None:
            await self.mcp.aclose()
        self.shutdown()

    # Routing: local, MCP and remote environments behind one set of calls (the servicer's).

    def _owner(self, session_id: str) -> tuple[RemoteBackend, str] | None:
        return self.remotes.owner(session_id) if self.remotes is not None else None

    async def environments(self, remaining: Remaining) -> list[env_pb2.EnvironmentInfo]:
        """Every environment, by name: local ones from their specs, MCP and remote ones as their
        servers describe them now (a server may have been reached, or lost, since start)."""
        specs, mcp = self.registry.specs(), self.mcp
        infos = [env_pb2.EnvironmentInfo(name=s.name, description=s.description, tools_json=s.tools_json,
                                         max_turns=s.max_turns) for s in specs if not (mcp and mcp.serves(s.name))]
        if mcp is not None:
            infos += await asyncio.gather(*(mcp.info(s.name, remaining()) for s in specs if mcp.serves(s.name)))
        if self.remotes is not None:
            infos += await self.remotes.list_environments(remaining())
        return sorted(infos, key=lambda i: i.name)

    async def reset_routed(self, env_name: str, config_json: str, seed: int,
                           remaining: Remaining, client: str = "") -> Started | env_pb2.ResetResponse:
        """A local session, or a remote backend's reply (its session id prefixed); RemoteError when
        the backend fails."""
        remotes = self.remotes
        # A local name is never asked of the backends; an unknown one may be served since start.
        if remotes is not None and self.registry.get(env_name) is None and await remotes.route(env_name, remaining()):
            request = env_pb2.ResetRequest(env_name=env_name, config_json=config_json, seed=seed)
            return await remotes.reset(request, remaining())
        return await self.reset_async(env_name, config_json, seed, remaining(), client)

    async def step_routed(self, session_id: str, action: str,
                          deadline_s: float | None) -> StepResult | env_pb2.StepResponse:
        owner = self._owner(session_id)
        if owner is not None and self.remotes is not None:
            backend, remote_id = owner
            return await self.remotes.step(backend, env_pb2.StepRequest(session_id=remote_id, action=action),
                                           deadline_s)
        return await self.step_async(session_id, action, deadline_s)

    async def step_batch(self, session_ids: Sequence[str], actions: Sequence[str],
                         deadline_s: float | None) -> list[StepOutcome]:
        """One outcome per step, in order: cheap local steps inline, blocking ones in worker
        threads, and one remote StepBatch per backend; all waits run concurrently."""
        outcomes: list[Any] = [None] * len(session_ids)
        pending: list[tuple[int, asyncio.Future[StepResult]]] = []
        remote: dict[int, tuple[RemoteBackend, list[int], list[env_pb2.StepRequest]]] = {}
        # Locals, not attribute lookups: this loop is the whole cost of a batch of cheap steps.
        begin, remotes = self.begin_step, self.remotes
        for i, (session_id, action) in enumerate(zip(session_ids, actions, strict=True)):
            owner = remotes.owner(session_id) if remotes is not None else None
            if owner is not None:
                _, indices, requests = remote.setdefault(owner[0].index, (owner[0], [], []))
                indices.append(i)
                requests.append(env_pb2.StepRequest(session_id=owner[1], action=action))
                continue
            try:
                outcome = begin(session_id, action, deadline_s)
            except Exception as e:
                outcomes[i] = e
                continue
            if isinstance(outcome, StepResult):
                outcomes[i] = outcome
            else:
                pending.append((i, outcome))
        if pending or remote:
            await self._gather(outcomes, pending, list(remote.values()), deadline_s)
        return outcomes

    async def _gather(self, outcomes: list[Any], pending: list[tuple[int, asyncio.Future[StepResult]]],
                      remote: list[tuple[RemoteBackend, list[int], list[env_pb2.StepRequest]]],
                      deadline_s: float | None) -> None:
        remotes = self.remotes
        assert remotes is not None or not remote
        local_job = asyncio.gather(*(f for _, f in pending), return_exceptions=True)
        remote_jobs = [remotes.step_batch(b, reqs, deadline_s) for b, _, reqs in remote] if remotes else []
        local, *replies = await asyncio.gather(local_job, *remote_jobs)
        for (i, _), outcome in zip(pending, local, strict=True):
            outcomes[i] = outcome
        for (_, indices, _), reply in zip(remote, replies, strict=True):
            for i, result in zip(indices, reply, strict=True):
                outcomes[i] = result

    async def close_routed(self, session_id: str, deadline_s: float | None) -> None:
        """RemoteError when a proxied session's backend fails; closing a local session never fails."""
        owner = self._owner(session_id)
        if owner is not None and self.remotes is not None:
            await self.remotes.close_session(owner[0], owner[1], deadline_s)
        else:
            self.close(session_id)

    async def close_batch(self, session_ids: Sequence[str], deadline_s: float | None) -> list[BaseException | None]:
        """Each close's RemoteError, or None: local sessions inline, each backend's concurrently."""
        errors: list[BaseException | None] = [None] * len(session_ids)
        remote: list[tuple[int, RemoteBackend, str]] = []
        for i, session_id in enumerate(session_ids):
            owner = self._owner(session_id)
            if owner is not None:
                remote.append((i, *owner))
            else:
                self.close(session_id)
        if remote and self.remotes is not None:
            remotes = self.remotes
            outcomes = await asyncio.gather(*(remotes.close_session(backend, remote_id, deadline_s)
                                              for _, backend, remote_id in remote), return_exceptions=True)
            for (i, _, _), outcome in zip(remote, outcomes, strict=True):
                errors[i] = outcome
        return errors
