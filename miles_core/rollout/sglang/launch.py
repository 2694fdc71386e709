"""Launch SGLang-protocol servers on free loopback ports and wait until they answer /health.

``python -m sglang.launch_server`` when sglang is importable (or ``launcher: sglang``), else
``python -m miles_cli.main serve``. ``server_args`` go to SGLang as they are (``--KEY VALUE``,
underscores as dashes, ``true`` as a bare switch, a mapping as JSON). ``miles serve`` understands a few of SGLang's
options under its own names (:data:`MILES_EQUIVALENTS`); it has no use for the others (memory
fractions, parallelism, attention backends...), which are dropped with one warning each.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError, MilesUserError
from miles_core.rollout.sglang.http import HEALTH_TIMEOUT_S, healthy

log = logging.getLogger(__name__)

# SGLang server option -> `miles serve` option
MILES_EQUIVALENTS = {
    "max_running_requests": "--max-num-seqs",
    "context_length": "--max-model-len",
    "random_seed": "--seed",
    "dtype": "--dtype",
    "device": "--device",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_launcher(launcher: str) -> str:
    if launcher == "auto":
        return "sglang" if importlib.util.find_spec("sglang") is not None else "miles"
    if launcher == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ConfigError("rollout.sglang.launcher=sglang but sglang is not importable (pip install sglang, or use launcher: miles)")
    return launcher


def _flag(name: str, value: Any) -> list[str]:
    opt = "--" + name.replace("_", "-")
    if value is True:
        return [opt]
    if value is False or value is None:
        return []
    if isinstance(value, dict):  # SGLang's JSON options (--json-model-override-args...) take json.loads' text
        return [opt, json.dumps(value)]
    if isinstance(value, list):
        return [opt, *map(str, value)]
    return [opt, str(value)]


def server_command(kind: str, model_path: str, port: int, server_args: dict[str, Any], host: str = "127.0.0.1") -> list[str]:
    if kind == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
               "--skip-server-warmup"]
        if "weight_version" not in server_args:
            cmd += ["--weight-version", "0"]  # SGLang's default is the string "default"
        for k, v in server_args.items():
            cmd += _flag(k, v)
        return cmd
    cmd = [sys.executable, "-m", "miles_cli.main", "serve", model_path, "--host", host, "--port", str(port)]
    for k, v in server_args.items():
        if k in MILES_EQUIVALENTS:
            cmd += [MILES_EQUIVALENTS[k], str(v)]
        else:
            log.warning("miles serve has no equivalent of SGLang's --%s; ignored", k.replace("_", "-"))
    return cmd


@dataclass
class LaunchedServer:
    url: str
    proc: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server (SGLang's stops its scheduler and detokenizer processes itself), SIGKILL after
        10 s; then SIGKILL to whatever is left of its process group (it was started in a session of its own), so
        no child of a server that died or ignored the signal keeps its GPU memory and port."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is empty: nothing left
            pass


def guarded(cmd: list[str]) -> list[str]:
    """``python -m MODULE ARGS`` run under :mod:`miles_core.rollout.sglang.guard`, which ends the server (in the same
    process) and its process group once this process is gone."""
    assert cmd[1] == "-m", cmd
    return [cmd[0], "-m", "miles_core.rollout.sglang.guard", str(os.getpid()), *cmd[2:]]


def launch(kind: str, model_path: str, server_args: dict[str, Any], log_dir: Path, name: str, env: dict | None = None) -> LaunchedServer:
    """Start one server; returns at once (see :func:`wait_healthy`). The server runs in a session of its own
    (:meth:`LaunchedServer.stop` ends its group) and ends when this process dies without stopping it (:func:`guarded`)."""
    port = free_port()
    cmd = guarded(server_command(kind, model_path, port, server_args))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    fh = open(log_path, "ab")
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
    fh.close()
    return LaunchedServer(f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(server: LaunchedServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            tail = server.log_path.read_text(errors="replace")[-1500:] if server.log_path.exists() else ""
            raise MilesUserError(f"the rollout server at {server.url} exited with code {server.proc.returncode} while starting; "
                                 f"its log ({server.log_path}) ends:\n{tail}")
        if healthy(server.url, timeout=max(1.0, min(HEALTH_TIMEOUT_S, deadline - time.monotonic()))):
            return
        time.sleep(0.05)
    server.stop()
    raise MilesUserError(f"the rollout server at {server.url} did not answer /health within {timeout:.0f} s "
                         f"(rollout.sglang.startup_timeout_s); see {server.log_path}")
