"""`tonearm bundle list|activate|rollback --url URL`: the admin routes from a terminal.

The token is read from the environment variable named by ``--token-env``
(default ``TONEARM_ADMIN_TOKEN``). ``activate`` prints the quality gate's
verdict (numbers and reasons) whether the bundle was activated or rejected;
the exit status is 0 when the service now serves the bundle, 1 when the gate
rejected it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from index.errors import TonearmError

TIMEOUT = httpx.Timeout(10.0, read=600.0)  # activation loads, verifies, warms up and evaluates
GENERIC_NOT_FOUND = "urn:tonearm:problem:not-found"
"""The problem type of a path the service does not route (unlike ``bundle-not-found``)."""
TABLE_SPARE_COLUMNS = 48
"""Console columns the other table columns need beside the bundle id; narrower → one block per bundle."""


def _request(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    token = os.environ.get(args.token_env)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = args.url.rstrip("/") + path
    try:
        return httpx.request(method, url, json=body, headers=headers, timeout=TIMEOUT)
    except httpx.HTTPError as err:
        raise TonearmError(f"{url}: {err}") from None


def admin_routes_off_hint(args: argparse.Namespace) -> str:
    return (
        f" — the admin routes are off on this service: they are on only when it was started with "
        f"TONEARM_ADMIN_TOKEN set (e.g. TONEARM_ADMIN_TOKEN=$(openssl rand -hex 16) tonearm serve ...); "
        f"pass the same token here in {args.token_env} (docs/service.md, 'Settings')"
    )


def _problem_message(response: httpx.Response, args: argparse.Namespace) -> str:
    problem_type = None
    try:
        problem = response.json()
        problem_type = problem.get("type")
        detail = f"{problem.get('title')}: {problem.get('detail')}"
    except ValueError:
        detail = response.text[:300]
    if response.status_code == 401 and not os.environ.get(args.token_env):
        detail += f" (set {args.token_env} to the admin token)"
    if response.status_code in (404, 405) and problem_type in (GENERIC_NOT_FOUND, None, "urn:tonearm:problem:method-not-allowed"):
        detail += admin_routes_off_hint(args)
    return f"{response.request.url} answered {response.status_code}: {detail}"


def _set_line(verdict: dict[str, Any]) -> str:
    where = ", ".join(verdict.get("languages") or []) or "-"
    gate_set = verdict.get("set")
    if not gate_set:
        return f"compared on: {where}"
    return f"gate set: {gate_set['name']} — {gate_set['n_clips']} clips, {gate_set['n_queries']} queries ({where})"


def _verdict_table(verdict: dict[str, Any]) -> Table:
    """Each metric for both bundles and their difference; values never cut (the metric column folds)."""
    table = Table(title=f"quality gate: candidate vs {verdict.get('compared_to')}")
    table.add_column("metric", overflow="fold")
    for column in ("candidate", "active", "difference"):
        table.add_column(column, justify="right", no_wrap=True)
    for key in sorted(set(verdict.get("candidate", {})) | set(verdict.get("active", {}))):
        cand, act = verdict["candidate"].get(key), verdict["active"].get(key)
        diff = "-" if cand is None or act is None else f"{cand - act:+.4f}"
        table.add_row(key, "-" if cand is None else f"{cand:.4f}", "-" if act is None else f"{act:.4f}", diff)
    return table


def _interval_line(interval: dict[str, Any]) -> str:
    return (
        f"{interval['metric']}: candidate − active = {interval['delta']:+.4f}, "
        f"{100 * interval['confidence']:g} % interval [{interval['low']:+.4f}, {interval['high']:+.4f}] "
        f"(paired bootstrap, {interval['samples']} resamples of the {interval['unit']}s, seed {interval['seed']})"
    )


def _print_verdict(console: Console, verdict: dict[str, Any] | None) -> None:
    if not verdict:
        return
    if verdict.get("candidate") or verdict.get("active"):  # a refusal before any evaluation has no numbers
        console.print(_verdict_table(verdict))
        console.print(_set_line(verdict), highlight=False, soft_wrap=True)
    if verdict.get("interval"):
        console.print(_interval_line(verdict["interval"]), highlight=False, soft_wrap=True)
    if not verdict["passed"]:
        status = "rejected"
    elif verdict["forced"] and verdict["reasons"]:
        status = "forced (activated despite the reasons below)"
    else:
        status = "passed"
    console.print(f"gate: [bold]{status}[/bold]")
    for reason in verdict.get("reasons", []):
        console.print(f"  - {reason}", highlight=False, soft_wrap=True)


def cli_list(args: argparse.Namespace) -> int:
    response = _request(args, "GET", "/v1/bundles")
    if response.status_code != 200:
        raise TonearmError(_problem_message(response, args))
    body = response.json()
    if args.json:
        sys.stdout.write(json.dumps(body, indent=2, ensure_ascii=False) + "\n")
        return 0
    console = Console()
    rows = [
        (
            b["bundle_id"], b["state"], b.get("created") or "-", ",".join(b.get("languages") or []) or "-",
            str(b.get("embed_dim") or "-"), str(b.get("n_clips") or "-"),
        )
        for b in body["bundles"]
    ]
    longest_id = max((len(r[0]) for r in rows), default=0)
    if console.width >= longest_id + TABLE_SPARE_COLUMNS:
        console.print(_bundle_table(args.url, rows, id_width=longest_id))
    else:  # too narrow for a table: never cut an id, print one block per bundle instead
        console.print(f"bundles at {args.url}", highlight=False)
        for bundle_id, state, created, languages, dim, clips in rows:
            console.print(bundle_id, highlight=False, soft_wrap=True)
            console.print(f"  {state}, {clips} clips, dim {dim}, {created}\n  {languages}", highlight=False)
    return 0


def _bundle_table(url: str, rows: list[tuple[str, str, str, str, str, str]], *, id_width: int) -> Table:
    """Bundle ids never shrink; the other columns wrap."""
    table = Table(title=f"bundles at {url}")
    table.add_column("bundle_id", no_wrap=True, min_width=id_width)
    for column in ("state", "created", "languages", "dim", "clips"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def cli_activate(args: argparse.Namespace) -> int:
    console = Console()
    response = _request(args, "POST", "/v1/bundles/activate", {"bundle_id": args.bundle_id, "force": bool(args.force)})
    if response.status_code == 409 and response.json().get("verdict"):
        _print_verdict(console, response.json()["verdict"])
        console.print(f"[red]not activated[/red]: {response.json()['detail']}")
        return 1
    if response.status_code != 200:
        raise TonearmError(_problem_message(response, args))
    body = response.json()
    _print_verdict(console, body.get("verdict"))
    if body["changed"]:
        console.print(f"active bundle: [bold]{body['bundle_id']}[/bold] (previous: {body['previous']})")
    else:
        console.print(f"{body['bundle_id']} was already active")
    return 0


def cli_rollback(args: argparse.Namespace) -> int:
    response = _request(args, "POST", "/v1/bundles/rollback")
    if response.status_code != 200:
        raise TonearmError(_problem_message(response, args))
    body = response.json()
    Console().print(f"rolled back: active bundle [bold]{body['bundle_id']}[/bold] (previous: {body['previous']})")
    return 0
