"""Run a server module as ``python -m`` would, ending it when the process that launched it dies.

    python -m miles_core.rollout.sglang.guard LAUNCHER_PID MODULE [ARGS...]

A launched server runs in a session of its own (so that stopping it can end its whole process group), which also
means nothing ends it when ``miles run`` is killed without its cleanup (SIGKILL, the OOM killer): the server, and
SGLang's scheduler and detokenizer processes, would keep their GPU memory and ports. This module runs the server in
the same process (no extra process; ``proc.pid`` is the server's) with a daemon thread that polls the parent's pid:
once the launcher is gone (the process is re-parented), it sends SIGTERM to the server's process group and SIGKILL
after ``GRACE_S``. The parent pid is polled rather than using ``prctl(PR_SET_PDEATHSIG)``, whose "parent" is the
launching *thread*: a server started from a worker thread would be killed when that thread ends.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_S = 0.5
GRACE_S = 10.0


def end_group() -> None:
    """SIGTERM to this process's group (the server and its children), SIGKILL to what is left after ``GRACE_S``. Only
    the group this process leads: run outside a session of its own, it ends only itself."""
    group = os.getpgrp()
    if group != os.getpid():
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(group, signal.SIGTERM)
    time.sleep(GRACE_S)
    os.killpg(group, signal.SIGKILL)


def watch(launcher: int, poll_s: float = POLL_S) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    end_group()


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m miles_core.rollout.sglang.guard LAUNCHER_PID MODULE [ARGS...]")
    launcher, module = int(argv[0]), argv[1]
    threading.Thread(target=watch, args=(launcher,), name="miles-launcher-watch", daemon=True).start()
    sys.argv = [module, *argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
