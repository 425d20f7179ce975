"""`env_gateway` and `reward`: the sandbox, remote and plugin environments, MCP servers, verifiers."""

from __future__ import annotations

from dataclasses import field

from arlo.choices import Isolation
from arlo.config.base import ServerConfig, _check, _frozen


@_frozen
class SandboxConfig:
    """Limits for untrusted code (env code execution, reward code tests)."""

    cpu_seconds: int = 5
    """CPU time limit (RLIMIT_CPU) of the sandboxed process."""
    memory_mb: int = 512
    """Memory of the whole tool call (all its processes together, one cgroup) and address-space limit of each
    process; where no cgroup can be created, only the per-process limit holds (docs/reliability.md)."""
    file_size_mb: int = 16
    """Largest file the sandboxed process may write (RLIMIT_FSIZE)."""
    max_processes: int = 32
    """Processes (threads included) the tool call may run at once: its cgroup's pids.max, and RLIMIT_NPROC."""
    wall_timeout_s: float = 10.0
    """Wall-clock limit; past it the whole process group is killed."""
    isolation: Isolation = "auto"
    """"auto" (bubblewrap if installed, else unshare; says so when namespaces are refused), "bwrap", "unshare", "none"."""
    uid: int = 65534
    """Unprivileged uid the code runs as (when started as root)."""
    max_output_bytes: int = 65536
    """stdout/stderr are each cut to this many bytes."""

    def validate(self, path: str) -> None:
        _check(f"{path}.cpu_seconds", 1 <= self.cpu_seconds <= 3600, "must be in [1, 3600]")
        _check(f"{path}.memory_mb", 16 <= self.memory_mb <= 1 << 20, "must be in [16, 1048576]")
        _check(f"{path}.file_size_mb", 1 <= self.file_size_mb <= 1 << 20, "must be in [1, 1048576]")
        _check(f"{path}.max_processes", 1 <= self.max_processes <= 4096, "must be in [1, 4096]")
        _check(f"{path}.wall_timeout_s", 0 < self.wall_timeout_s <= 3600, "must be in (0, 3600]")
        _check(f"{path}.max_output_bytes", 1024 <= self.max_output_bytes <= 1 << 24, "must be in [1 KiB, 16 MiB]")


@_frozen
class RemoteEnvConfig:
    """An external environment service (implements arlo.v1.Environment) proxied by the gateway."""

    address: str
    """host:port (or a dns:/// target) of the remote Environment service."""
    env_names: tuple[str, ...] = ()
    """Environment names served by this backend; empty means ask it (ListEnvironments) at start."""
    max_concurrency: int = 64
    """In-flight calls to this backend; more wait."""
    timeout_s: float = 30.0
    """Deadline of each call (shortened to the caller's remaining deadline)."""
    retries: int = 2
    """Retries of idempotent calls (ListEnvironments, Close) on UNAVAILABLE."""
    breaker_failures: int = 5
    """Consecutive failures that open the circuit breaker."""
    breaker_reset_s: float = 10.0
    """How long an open breaker fails fast before letting one call through."""
    token_env: str = ""
    """Env var with the backend's bearer token; empty sends the gateway's own token."""

    def validate(self, path: str) -> None:
        _check(f"{path}.address", bool(self.address), "must be set")
        _check(f"{path}.max_concurrency", self.max_concurrency >= 1, "must be >= 1")
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")
        _check(f"{path}.retries", 0 <= self.retries <= 10, "must be in [0, 10]")
        _check(f"{path}.breaker_failures", self.breaker_failures >= 1, "must be >= 1")
        _check(f"{path}.breaker_reset_s", self.breaker_reset_s > 0, "must be > 0")


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
    timeout_s: float = 30.0
    """Deadline of one tool call (shortened to the caller's remaining deadline); past it the agent
    gets an error observation."""
    connect_timeout_s: float = 20.0
    """Deadline of (re)connecting: starting the process or reaching the URL, and the MCP handshake."""
    max_concurrency: int = 64
    """Tool calls in flight on this server; more wait (within their deadline)."""
    breaker_failures: int = 3
    """Consecutive failures (crashes, timeouts, failed connects) that open the circuit breaker."""
    breaker_reset_s: float = 5.0
    """How long an open breaker fails fast before one reconnect is tried: the restart backoff."""
    max_turns: int = 8
    """Upper bound on an episode's turns (Reset's config may ask for fewer)."""
    description: str = ""
    """What ListEnvironments says about the environment; empty describes the server's tools."""

    def validate(self, path: str) -> None:
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
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")
        _check(f"{path}.connect_timeout_s", self.connect_timeout_s > 0, "must be > 0")
        _check(f"{path}.max_concurrency", self.max_concurrency >= 1, "must be >= 1")
        _check(f"{path}.breaker_failures", self.breaker_failures >= 1, "must be >= 1")
        _check(f"{path}.breaker_reset_s", self.breaker_reset_s > 0, "must be > 0")
        _check(f"{path}.max_turns", 1 <= self.max_turns <= 64, "must be in [1, 64]")


@_frozen
class EnvGatewayConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50053, metrics_port=9103))
    """Where the environment gateway listens."""
    session_idle_timeout_s: float = 600.0
    """An episode session untouched this long is closed and its state freed."""
    max_sessions: int = 10000
    """Live sessions at most; new ones are refused past it."""
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
        self.server.validate(f"{path}.server")
        _check(f"{path}.session_idle_timeout_s", self.session_idle_timeout_s > 0, "must be > 0")
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
    timeout_s: float = 15.0
    """Per-item verifier deadline; past it the item gets SCORE_STATUS_TIMEOUT. Keep it above
    sandbox.wall_timeout_s, or a slow code test times out while its program still runs."""
    plugins: tuple[RewardPluginConfig, ...] = ()
    """User verifiers registered next to the built-in reward functions."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits for running code-correctness tests."""

    def validate(self, path: str) -> None:
        self.server.validate(f"{path}.server")
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")
        self.sandbox.validate(f"{path}.sandbox")
        _check(f"{path}.timeout_s", self.timeout_s > self.sandbox.wall_timeout_s,
               f"must exceed sandbox.wall_timeout_s ({self.sandbox.wall_timeout_s}) so code tests finish in time")
        for i, plugin in enumerate(self.plugins):
            plugin.validate(f"{path}.plugins[{i}]")
