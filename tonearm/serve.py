"""`tonearm serve`: resolve the bundle (flag, settings, else the embedded demo) and run uvicorn.

Settings come from ``TONEARM_*`` environment variables; the command-line flags
override them and are handed to uvicorn's worker processes through the same
variables, so one code path (:func:`service.app.app_from_env`) builds the app
with one or several workers.
"""

from __future__ import annotations

import argparse
import logging
import os
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


def cli_serve(args: argparse.Namespace) -> int:
    """Run the service until interrupted."""
    import uvicorn

    os.environ.update(_overrides(args))
    settings = _settings()
    if settings.bundles_dir is not None:
        check_bundles_dir(settings.bundles_dir)
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
    log.info("serving %s on http://%s:%d (%d worker(s))", settings.bundle, settings.host, settings.port, settings.workers)
    uvicorn.run(
        "service.app:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level="info",
        access_log=settings.access_log,
    )
    return 0
