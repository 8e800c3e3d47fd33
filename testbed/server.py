"""Start an SGLang server as a subprocess, wait until it serves, and stop its whole process tree.

Why this exists: SGLang spawns a tokenizer, scheduler and detokenizer process per server. On a
shared machine an orphaned scheduler keeps a core busy forever and skews every later number, so
stopping must reach every descendant, and must happen even when the benchmark fails or is
interrupted. The server runs in its own session (process group); we remember its descendants while
it runs, signal the group, and then kill by pid anything that outlived the signal.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

#: Set in every server's environment (its processes inherit it) to the server's log path, so
#: that any process a benchmark started can be found exactly, e.g. by a test checking for leftovers.
MARKER_ENV = "KVSPARSE_BENCH_SERVER_LOG"

_RUNNING_RE = re.compile(r"#running-req: (\d+)")
_NEW_SEQ_RE = re.compile(r"#new-seq: (\d+)")
_DECODE_RE = re.compile(r"Decode batch, #running-req: (\d+)")
_RETRACTED_RE = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
_POOL_RE = re.compile(r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+|None)")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


class PortTaken(ServerStartError):
    """Another process bound the server's port between `free_port` and the server's start.

    Seen in a fidelity run: SGLang logged "address already in use", then waited forever in
    "Waiting for application shutdown" instead of exiting."""


#: How SGLang's HTTP server (uvicorn) reports a port someone else holds.
_PORT_TAKEN = "address already in use"
#: Starts tried, each on a fresh port, when the port was taken.
PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port that is free now (the OS picks it), so parallel runs never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log file, for error messages and progress."""
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def peak_running_requests(log_text: str) -> int | None:
    """Most requests holding KV at once, from SGLang's scheduler log lines.

    Decode lines say ``Decode batch, #running-req: N``; prefill lines say ``#new-seq: K`` and
    ``#running-req: N`` where N counts only the requests already decoding, so a prefill line holds
    N + K. Returns None when the window holds no such line (e.g. too few decode steps were logged).
    """
    peak: int | None = None
    for line in log_text.splitlines():
        running = _RUNNING_RE.search(line)
        if running is None:
            continue
        count = int(running.group(1))
        new_seq = _NEW_SEQ_RE.search(line)
        if new_seq is not None:
            count += int(new_seq.group(1))
        peak = count if peak is None else max(peak, count)
    return peak


def pool_settings(log_text: str) -> tuple[int, int | None] | None:
    """SGLang's KV pool in its own units (tokens; heap rows with the project's sparse layers) and
    its prefill chunk (None: not chunked), from the scheduler's startup line; None without it."""
    match = _POOL_RE.search(log_text)
    if match is None:
        return None
    chunk = None if match.group(2) == "None" or int(match.group(2)) <= 0 else int(match.group(2))
    return int(match.group(1)), chunk


def mean_decoding_requests(log_text: str) -> float | None:
    """Requests running per decode step, averaged over the decode lines (one per logged step;
    every step with ``--decode-log-interval 1``), None without one.

    Why beside the peak: on long outputs stock's requests grow while they decode, so SGLang admits
    more than fit at their final length and retracts some later; the peak then counts requests
    that did not stay, the mean what ran.
    """
    counts = [int(match.group(1)) for match in _DECODE_RE.finditer(log_text)]
    return sum(counts) / len(counts) if counts else None


def retracted_requests(log_text: str) -> int:
    """Requests SGLang retracted because the KV pool was full (its warning lines)."""
    return sum(int(match.group(1)) for match in _RETRACTED_RE.finditer(log_text))


@dataclass
class ServerProcess:
    """One SGLang HTTP server: its command, environment and log file.

    Use as a context manager: ``with ServerProcess(...) as server:`` starts it and waits for
    ``/health``; leaving the block stops every process it started.
    """

    name: str
    command: Sequence[str]
    env: Mapping[str, str]
    port: int
    log_path: Path
    startup_timeout_s: float = 900.0
    progress: Callable[[str], None] = print
    host: str = "127.0.0.1"
    startup_s: float | None = None
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tree: dict[int, psutil.Process] = field(default_factory=dict, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Launch, stream output to the log file, and block until ``/health`` answers 200."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (`wait_ready` waits), so several servers
        can start side by side."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                list(self.command),
                env={**self.env, MARKER_ENV: str(self.log_path)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.progress(f"[{self.name}] starting (log: {self.log_path})")

    def wait_ready(self) -> None:
        """Block until ``/health`` answers 200; when another process took the port first, start
        again on a fresh one. On failure every process is stopped and the error says why."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._wait_healthy()
            except PortTaken:
                self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise
                self._move_to(free_port())
                self.progress(f"[{self.name}] port taken by another process; retrying on {self.port}")
                self.launch()
            except BaseException:
                self.stop()
                raise

    def _move_to(self, port: int) -> None:
        command = list(self.command)
        command[command.index("--port") + 1] = str(port)
        self.command, self.port = command, port

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        last_report = started
        while True:
            self._remember_tree()
            if self._proc.poll() is not None:
                raise ServerStartError(self._failure(f"exited with code {self._proc.returncode}"))
            if _PORT_TAKEN in log_tail(self.log_path, 5):
                raise PortTaken(self._failure(f"could not bind port {self.port}"))
            try:
                if requests.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    self.startup_s = time.monotonic() - started
                    self.progress(f"[{self.name}] healthy after {self.startup_s:.0f} s")
                    return
            except requests.RequestException:
                pass
            now = time.monotonic()
            if now - started > self.startup_timeout_s:
                raise ServerStartError(self._failure(f"not healthy after {self.startup_timeout_s:.0f} s"))
            if now - last_report >= 15:
                last_line = log_tail(self.log_path, 1).strip()[:160]
                self.progress(f"[{self.name}] waiting for /health ({now - started:.0f} s) {last_line}")
                last_report = now
            time.sleep(1)

    def _failure(self, what: str) -> str:
        """One summary line (what happened, the log's last line), then the log tail."""
        tail = log_tail(self.log_path)
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        return f"[{self.name}] {what} before serving: {last.strip()}\nlog tail:\n{tail}"

    def _remember_tree(self) -> None:
        """Record the server and its descendants so that a reparented child is still found."""
        if self._proc is None:
            return
        try:
            root = psutil.Process(self._proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                self._tree.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            pass

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever of the tree is still alive."""
        if self._proc is None:
            return
        self._remember_tree()
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        alive = [p for p in self._tree.values() if _is_alive(p)]
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=10)
        self._proc.wait(timeout=10)
        self._proc = None
        if alive:
            pids = ", ".join(str(p.pid) for p in alive)
            raise RuntimeError(f"[{self.name}] processes survived SIGKILL: {pids}")
        self.progress(f"[{self.name}] stopped ({len(self._tree)} processes, none left)")

    def flush_cache(self, timeout_s: float = 60) -> None:
        """Empty SGLang's radix cache (and with it the project's prefix store). SGLang refuses
        (400) while a request it has already answered is still being retired, so retry briefly."""
        deadline = time.monotonic() + timeout_s
        while (response := requests.post(f"{self.base_url}/flush_cache", timeout=120)).status_code == 400:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        response.raise_for_status()

    def log_size(self) -> int:
        """Current log length in bytes: a bookmark for :meth:`log_since`."""
        return self.log_path.stat().st_size if self.log_path.is_file() else 0

    def log_since(self, offset: int) -> str:
        """Log text written after a bookmark (the window of one benchmark run)."""
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")


def processes_marked_under(folder: Path) -> list[psutil.Process]:
    """Live processes started by :class:`ServerProcess` with a log file under ``folder``."""
    found = []
    for proc in psutil.process_iter():
        try:
            marker = proc.environ().get(MARKER_ENV)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if marker and Path(marker).is_relative_to(folder) and _is_alive(proc):
            found.append(proc)
    return found


def _is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
