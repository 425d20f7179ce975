"""`env_gateway` and `reward`: the sandbox, remote and plugin environments, MCP servers, verifiers."""

from __future__ import annotations

from dataclasses import field

from arlo.choices import Isolation
from arlo.config.base import MAX_WAIT_S, ServerConfig, _check, _frozen, check_ranges, ranged


@_frozen
class SandboxConfig:
    """Limits for untrusted code (env code execution, reward code tests)."""

    cpu_seconds: int = ranged(5, ge=1, le=3600)
    """CPU time limit (RLIMIT_CPU) of the sandboxed process."""
    memory_mb: int = ranged(512, ge=16, le=1 << 20)
    """Memory of the whole tool call (all its processes together, one cgroup) and address-space limit of each
    process; where no cgroup can be created, only the per-process limit holds (docs/reliability.md)."""
    file_size_mb: int = ranged(16, ge=1, le=1 << 20)
    """Largest file the sandboxed process may write (RLIMIT_FSIZE)."""
    max_processes: int = ranged(32, ge=1, le=4096)
    """Processes (threads included) the tool call may run at once: its cgroup's pids.max, and RLIMIT_NPROC."""
    wall_timeout_s: float = ranged(10.0, gt=0, le=3600)
    """Wall-clock limit; past it the whole process group is killed."""
    isolation: Isolation = "auto"
    """"auto" (bubblewrap if installed, else unshare; says so when namespaces are refused), "bwrap", "unshare", "none"."""
    uid: int = ranged(65534, ge=1, le=2**32 - 2)
    """Unprivileged uid the code runs as (when started as root): not 0, which would leave it root,
    nor 4294967295, which is no uid."""
    max_output_bytes: int = ranged(65536, ge=1024, le=1 << 24)
    """stdout/stderr are each cut to this many bytes."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)


@_frozen
class RemoteEnvConfig:
    """An external environment service (implements arlo.v1.Environment) proxied by the gateway."""

    address: str
    """host:port (or a dns:/// target) of the remote Environment service."""
    env_names: tuple[str, ...] = ()
    """Environment names served by this backend; empty means ask it (ListEnvironments) at start."""
    max_concurrency: int = ranged(64, ge=1)
    """In-flight calls to this backend; more wait."""
    timeout_s: float = ranged(30.0, gt=0, le=MAX_WAIT_S)
    """Deadline of each call (shortened to the caller's remaining deadline)."""
    retries: int = ranged(2, ge=0, le=10)
    """Retries of idempotent calls (ListEnvironments, Close) on UNAVAILABLE."""
    breaker_failures: int = ranged(5, ge=1)
    """Consecutive failures that open the circuit breaker."""
    breaker_reset_s: float = ranged(10.0, gt=0, le=MAX_WAIT_S)
    """How long an open breaker fails fast before letting one call through."""
    token_env: str = ""
    """Env var with the backend's bearer token; empty sends the gateway's own token."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.address", bool(self.address), "must be set")


@_frozen
class EnvPluginConfig:
    """An environment from the user's package, registered under `name` at gateway start."""

    name: str
    """The environment name clients Reset with; must not clash with a built-in or a remote."""
    target: str
    """"package.module:attr": an `EnvSpec`, a class (instantiated once per session), or a factory
    taking the `EnvContext` and returning an `EnvSpec`."""
    description: str = ""
    """Overrides the description ListEnvironments shows (default: the spec's, or the class docstring)."""

    def validate(self, path: str) -> None:
        _check(f"{path}.name", bool(self.name), "must be set")
        module, _, attr = self.target.partition(":")
        _check(f"{path}.target", bool(module) and bool(attr), "must look like 'package.module:attr'")


@_frozen
class McpServerConfig:
    """An MCP tool server whose tools make the environment `mcp:<name>` (see docs/mcp.md). Set exactly
    one of `command` (the gateway runs it and talks over its stdin/stdout) or `url` (streamable HTTP)."""

    name: str
    """The environment is `mcp:<name>`; letters, digits, '-', '_' and '.'."""
    command: tuple[str, ...] = ()
    """stdio: the program and its arguments, e.g. ["python", "-m", "my_tools"]; run by the gateway."""
    env: dict[str, str] = field(default_factory=dict)
    """stdio: environment variables for the server, over a minimal default set (HOME, PATH, ...)."""
    cwd: str = ""
    """stdio: the server's working directory; empty is the gateway's."""
    url: str = ""
    """streamable HTTP: the server's endpoint, e.g. "http://127.0.0.1:8000/mcp"."""
    headers: dict[str, str] = field(default_factory=dict)
    """streamable HTTP: headers sent with every request (e.g. Authorization)."""
    timeout_s: float = ranged(30.0, gt=0, le=MAX_WAIT_S)
    """Deadline of one tool call (shortened to the caller's remaining deadline); past it the agent
    gets an error observation."""
    connect_timeout_s: float = ranged(20.0, gt=0, le=MAX_WAIT_S)
    """Deadline of (re)connecting: starting the process or reaching the URL, and the MCP handshake."""
    max_concurrency: int = ranged(64, ge=1)
    """Tool calls in flight on this server; more wait (within their deadline)."""
    breaker_failures: int = ranged(3, ge=1)
    """Consecutive failures (crashes, timeouts, failed connects) that open the circuit breaker."""
    breaker_reset_s: float = ranged(5.0, gt=0, le=MAX_WAIT_S)
    """How long an open breaker fails fast before one reconnect is tried: the restart backoff."""
    max_turns: int = ranged(8, ge=1, le=64)
    """Upper bound on an episode's turns (Reset's config may ask for fewer)."""
    description: str = ""
    """What ListEnvironments says about the environment; empty describes the server's tools."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.name", bool(self.name) and all(c.isascii() and (c.isalnum() or c in "-_.") for c in self.name),
               f"must be non-empty and use only letters, digits, '-', '_' and '.', got {self.name!r}")
        _check(path, bool(self.command) != bool(self.url),
               "set exactly one of command (a stdio server) or url (a streamable HTTP server)")
        if self.command:
            _check(f"{path}.command", all(self.command), "must not hold empty strings")
            _check(f"{path}.headers", not self.headers, "is for url servers; a stdio server takes env")
        else:
            _check(f"{path}.url", self.url.startswith(("http://", "https://")), f"must be http(s)://..., got {self.url!r}")
            _check(f"{path}.env", not self.env and not self.cwd, "env and cwd are for command servers")


@_frozen
class EnvGatewayConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50053, metrics_port=9103))
    """Where the environment gateway listens."""
    session_idle_timeout_s: float = ranged(600.0, gt=0, le=MAX_WAIT_S)
    """An episode session untouched this long is closed and its state freed."""
    max_sessions: int = ranged(10000, ge=1)
    """Live sessions at most; new ones are refused past it."""
    max_sessions_per_client: int = ranged(5000, ge=1, special={0: "off"})
    """Live sessions one client (one gRPC connection, as the per-client RPC bound counts them) may
    hold; its next Reset is refused RESOURCE_EXHAUSTED while other clients still get sessions.
    A rollout holds about concurrent_groups x group_size sessions at once."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits for environments that run untrusted code."""
    remotes: tuple[RemoteEnvConfig, ...] = ()
    """External Environment services whose environments the gateway proxies."""
    retrieval_docs_dir: str = ""
    """Directory of .txt/.md documents for the retrieval env; empty uses the built-in set."""
    dataset_roots: tuple[str, ...] = (".",)
    """Directories the dataset environment may read from (relative ones from the gateway's working
    directory at start; each must exist). A dataset path outside all of them, after resolving
    symlinks and "..", is refused with INVALID_ARGUMENT: the path comes from clients; so is a file
    a save_to_disk directory names, and anything in $ARLO_HOME (unless a root is inside it).
    Default: the working directory only; [] allows no dataset files."""
    plugins: tuple[EnvPluginConfig, ...] = ()
    """Environments from your own package (see docs/environments.md); a broken one stops start-up."""
    mcp_servers: tuple[McpServerConfig, ...] = ()
    """MCP tool servers, each served as the environment `mcp:<name>` (see docs/mcp.md)."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        self.server.validate(f"{path}.server")
        self.sandbox.validate(f"{path}.sandbox")
        for i, root in enumerate(self.dataset_roots):
            _check(f"{path}.dataset_roots[{i}]", bool(root.strip()), "must be a directory, not empty")
        for i, remote in enumerate(self.remotes):
            remote.validate(f"{path}.remotes[{i}]")
        names: set[str] = set()
        for i, plugin in enumerate(self.plugins):
            plugin.validate(f"{path}.plugins[{i}]")
            _check(f"{path}.plugins[{i}].name", plugin.name not in names, f"repeats {plugin.name!r}")
            names.add(plugin.name)
        servers: set[str] = set()
        for i, server in enumerate(self.mcp_servers):
            server.validate(f"{path}.mcp_servers[{i}]")
            _check(f"{path}.mcp_servers[{i}].name", server.name not in servers, f"repeats {server.name!r}")
            servers.add(server.name)


@_frozen
class RewardPluginConfig:
    """A user verifier: `target` is "package.module:function", registered under `name`."""

    name: str
    """Name the verifier is registered (and asked for) under."""
    target: str
    """"package.module:function" of the verifier."""
    description: str = ""
    """Shown in the reward function listing; empty uses the function's docstring."""

    def validate(self, path: str) -> None:
        _check(f"{path}.name", bool(self.name), "must be set")
        module, _, fn = self.target.partition(":")
        _check(f"{path}.target", bool(module) and bool(fn), "must look like 'package.module:function'")


@_frozen
class RewardConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50054, metrics_port=9104))
    """Where the reward service listens."""
    timeout_s: float = ranged(15.0, gt=0, le=MAX_WAIT_S)
    """Per-item verifier deadline; past it the item gets SCORE_STATUS_TIMEOUT. Keep it above
    sandbox.wall_timeout_s, or a slow code test times out while its program still runs."""
    plugins: tuple[RewardPluginConfig, ...] = ()
    """User verifiers registered next to the built-in reward functions."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits for running code-correctness tests."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        self.server.validate(f"{path}.server")
        self.sandbox.validate(f"{path}.sandbox")
        _check(f"{path}.timeout_s", self.timeout_s > self.sandbox.wall_timeout_s,
               f"must exceed sandbox.wall_timeout_s ({self.sandbox.wall_timeout_s}) so code tests finish in time")
        for i, plugin in enumerate(self.plugins):
            plugin.validate(f"{path}.plugins[{i}]")
