"""`tonearm serve`: resolve the bundle (flag, settings, else the embedded demo) and run uvicorn.

Settings come from ``TONEARM_*`` environment variables; the command-line flags
override them and are handed to uvicorn's worker processes through the same
variables, so one code path (:func:`service.app.app_from_env`) builds the app
with one or several workers.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
from pathlib import Path

from pydantic import ValidationError

from tonearm.errors import TonearmError

log = logging.getLogger(__name__)


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    values = {"host": args.host, "port": args.port, "workers": args.workers}
    env = {f"TONEARM_{k.upper()}": str(v) for k, v in values.items() if v is not None}
    if args.bundle:
        bundle = Path(args.bundle).expanduser().resolve()
        if not (bundle / "manifest.json").is_file():
            raise TonearmError(f"{bundle}: not a bundle directory (no manifest.json)")
        env["TONEARM_BUNDLE"] = str(bundle)
    return env


def _settings():
    from service.settings import Settings, SettingsError

    try:
        return Settings()
    except ValidationError as err:
        problems = "; ".join(f"TONEARM_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in err.errors())
        raise SettingsError(f"invalid service settings: {problems}") from None


def check_bundles_dir(path: Path) -> None:
    """Refuse to start on a bundles volume this process cannot list (missing mount, wrong owner)."""
    where = f"TONEARM_BUNDLES_DIR={path}"
    try:
        with os.scandir(path) as entries:
            next(entries, None)
    except FileNotFoundError:
        raise TonearmError(f"{where}: no such directory (is the bundles volume mounted?)") from None
    except NotADirectoryError:
        raise TonearmError(f"{where}: not a directory") from None
    except PermissionError:
        raise TonearmError(
            f"{where}: not readable by uid {os.getuid()} (permission denied); "
            "make the bundles volume readable by the service user"
        ) from None


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something listens there (as uvicorn binds:
    SO_REUSEADDR, so a closed connection in TIME_WAIT does not count)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        return False  # an unknown host name is uvicorn's to report
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as err:
        return err.errno == errno.EADDRINUSE
    return False


def check_port(host: str, port: int) -> None:
    """One line, exit status 2, when the port is taken (uvicorn would log ``[Errno 98]`` and exit 3)."""
    if port and port_in_use(host, port):
        raise TonearmError(
            f"port {port} on {host} is already in use; stop what listens there, or pick another port "
            "with --port or TONEARM_PORT"
        )


def cli_serve(args: argparse.Namespace) -> int:
    """Run the service until interrupted."""
    import uvicorn

    os.environ.update(_overrides(args))
    settings = _settings()
    if settings.bundles_dir is not None:
        check_bundles_dir(settings.bundles_dir)
    check_port(settings.host, settings.port)
    if settings.bundle is None and settings.bundles_dir is None:
        from tonearm.demo import build_log_path, cached_demo_bundle, ensure_demo_bundle

        log.info("no bundle configured (--bundle / TONEARM_BUNDLE): using the embedded demo bundle")
        bundle = cached_demo_bundle(settings.home)
        if bundle is None:  # first start: answer /healthz and /readyz (503 + progress) meanwhile
            from tonearm.build_server import answer_while_building

            home = settings.home
            bundle = answer_while_building(
                settings.host, settings.port, lambda: ensure_demo_bundle(home), log_file=build_log_path(home)
            )
        os.environ["TONEARM_BUNDLE"] = str(bundle)
        settings = _settings()
    check_port(settings.host, settings.port)  # again: a demo build takes minutes
    log.info("serving %s on http://%s:%d (%d worker(s))", settings.bundle, settings.host, settings.port, settings.workers)
    try:
        uvicorn.run(
            "service.app:app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level="info",
            access_log=settings.access_log,
        )
    except SystemExit as exit_:  # uvicorn exits (status 1 or 3) when it cannot bind or start
        if exit_.code and port_in_use(settings.host, settings.port):
            check_port(settings.host, settings.port)
        raise
    return 0
