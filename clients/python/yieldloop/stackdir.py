"""A local stack's data directory as the CLI finds it: who holds it (the lock ``yieldloop up`` takes), and whether the
processes its ready files name are alive.

Liveness is a pid *and* that process's start time (as Postgres's ``postmaster.pid``): a pid the system reused for
another program after a crash does not count as the stack.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys
from typing import Any

LOCK_FILE = "run/lock"
"""Under DATA_DIR: who runs the stack on it (pid, its start time, when, the command), while it runs."""


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (clock ticks since boot on Linux; 0.0 where that is not known), or None when
    no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read().decode(errors="replace")
        return float(stat.rsplit(")", 1)[1].split()[19])  # field 22 (starttime), counted after the command
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):  # no /proc here: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0


def alive(pid: int, started: float | None = None) -> bool:
    """Whether process ``pid`` runs and, when ``started`` is given, is the one that started then."""
    now = process_started(pid) if pid > 0 else None
    return now is not None and (not started or not now or now == started)


def me() -> dict[str, Any]:
    """This process, as a lock or ready file records it."""
    return {"pid": os.getpid(), "started": process_started(os.getpid()) or 0.0}


def holder(data_dir: pathlib.Path) -> dict[str, Any] | None:
    """The lock of the stack running on ``data_dir`` (pid, started, since, command), or None when none runs there
    (no lock, or its process is gone)."""
    try:
        lock = json.loads((data_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return lock if isinstance(lock, dict) and alive(int(lock.get("pid", 0)), lock.get("started")) else None


def describe(lock: dict[str, Any]) -> str:
    since = datetime.datetime.fromtimestamp(lock.get("since", 0)).isoformat(" ", "seconds")
    return f"pid {lock.get('pid')}, since {since}: {lock.get('command', '?')}"


def take_lock(data_dir: pathlib.Path) -> pathlib.Path:
    """Takes DATA_DIR's lock for this process (a stale one, whose process is gone, is replaced).

    Raises:
        FailedPreconditionError: STACK_LOCKED naming the live process that holds it.
    """
    from yieldloop.errors import FailedPreconditionError

    path = data_dir / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = json.dumps({**me(), "since": datetime.datetime.now().timestamp(), "command": " ".join(sys.argv)})
    staged = path.with_name(f".lock.{os.getpid()}")
    staged.write_text(record)
    try:
        for _ in range(3):
            try:
                os.link(staged, path)  # created with its content, or not at all: a reader never sees it empty
                return path
            except FileExistsError:
                pass
            held = holder(data_dir)
            if held is not None and held.get("pid") != os.getpid():
                raise FailedPreconditionError(
                    f"{data_dir} is in use by another stack ({describe(held)}): attach to it "
                    f"(`yieldloop status --attach {data_dir}`), stop it, or pick another --data-dir",
                    reason="STACK_LOCKED",
                )
            path.unlink(missing_ok=True)  # stale (its process is gone) or this process's own
    finally:
        staged.unlink(missing_ok=True)
    raise FailedPreconditionError(f"could not take the lock {path}", reason="STACK_LOCKED")


def release_lock(data_dir: pathlib.Path) -> None:
    """Drops DATA_DIR's lock when this process holds it."""
    path = data_dir / LOCK_FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


_LOOPBACK = ("127.", "localhost:", "[::1]:", "0.0.0.0:")


def read_ready(data_dir: pathlib.Path, service: str) -> dict[str, Any] | None:
    """What ``service``'s ready file says (address, pid, started, tls, ports), or None when it is missing or
    names a local process that is gone (a stack stopped without cleaning up, or killed)."""
    try:
        ready = json.loads((data_dir / "run" / f"{service}.json").read_text())
        address = str(ready["address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    pid = int(ready.get("pid", 0) or 0)
    if pid and address.startswith(_LOOPBACK) and not alive(pid, ready.get("started")):
        return None
    return ready


def card(data_dir: pathlib.Path) -> dict[str, Any]:
    """Where a running stack is, as ``yieldloop up`` ends and ``yieldloop status`` prints it: its data directory,
    each service's address, the OpenAI base URL, the HUD front, the key file and the logs (snake_case keys).

    Raises:
        FailedPreconditionError: STACK_NOT_RUNNING when no live stack serves from ``data_dir``.
    """
    from yieldloop.client import SERVICES
    from yieldloop.errors import FailedPreconditionError

    data_dir = data_dir.resolve()
    readies = {service: read_ready(data_dir, service) for service in (*SERVICES, "hud")}
    missing = [s for s in SERVICES if readies[s] is None]
    if missing:
        stale = any((data_dir / "run" / f"{s}.json").exists() for s in missing)
        raise FailedPreconditionError(
            f"no running stack in {data_dir} ("
            + (f"{missing[0]} exited: its process is gone" if stale else f"{missing[0]}.json missing")
            + f"): start one with `yieldloop up --data-dir {data_dir}` or set YIELDLOOP_DATA_DIR",
            reason="STACK_NOT_RUNNING",
        )
    rollout = readies["rollout"] or {}
    scheme = "https" if rollout.get("tls") else "http"
    host = str(rollout["address"]).rsplit(":", 1)[0]
    lock = holder(data_dir)
    hud = readies["hud"]
    key_file = data_dir / "api_key"
    return {
        "data_dir": str(data_dir),
        "pid": lock.get("pid") if lock else None,
        "since": lock.get("since") if lock else None,
        "addresses": {s: (readies[s] or {})["address"] for s in SERVICES},
        "openai_base_url": rollout.get("openai_base_url")
        or (f"{scheme}://{host}:{rollout['http_port']}/v1" if rollout.get("http_port") else ""),
        "hud_url": (hud["address"] if "://" in hud["address"] else f"{scheme}://{hud['address']}") if hud else "",
        "hud_env": str(data_dir / "run" / "hud.env") if hud else "",
        "api_key_file": str(key_file) if key_file.exists() else "",
        "tls_ca": str(data_dir / "tls" / "ca.pem") if rollout.get("tls") else "",
        "logs": str(data_dir / "logs"),
    }


def render_card(facts: dict[str, Any]) -> str:
    """The card as lines for people (one fact a line, the shell line to copy first)."""
    since = (
        f" (pid {facts['pid']}, up since {datetime.datetime.fromtimestamp(facts['since']).isoformat(' ', 'seconds')})"
        if facts.get("pid")
        else ""
    )
    lines = [f"stack in {facts['data_dir']}{since}", f"  export YIELDLOOP_DATA_DIR={facts['data_dir']}"]
    lines += [f"  {service:<11} {address}" for service, address in facts["addresses"].items()]
    if facts["openai_base_url"]:
        lines.append(f"  {'openai':<11} {facts['openai_base_url']}  (OpenAI(base_url=..., api_key=<the key file>))")
    if facts["hud_url"]:
        lines.append(f"  {'hud':<11} {facts['hud_url']}  (HUD SDK scripts: source {facts['hud_env']})")
    key = facts["api_key_file"] or "none (auth is off: --no-auth)"
    lines.append(f"  {'api key':<11} {key}")
    if facts["tls_ca"]:
        lines.append(f"  {'tls ca':<11} {facts['tls_ca']}")
    lines.append(f"  {'logs':<11} {facts['logs']}")
    return "\n".join(lines)
