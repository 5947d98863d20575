"""How a tonearm driver reaches a Ray cluster (`--ray [ADDRESS]`): the address, and Ray 2.60's token
authentication decided from what the cluster itself requires — never from a token left lying around.

Addresses: none — ``RAY_ADDRESS``, else the cluster last started on this machine (``ray start``
records it in ``$RAY_TMPDIR/ray/ray_current_cluster``, /tmp/ray by default), else a new local Ray
instance; ``auto`` — an existing cluster only; ``HOST:PORT`` — the cluster's GCS; ``local`` — a new
local instance; ``ray://HEAD:10001`` — Ray Client (KubeRay's head service).

Ray 2.60 decides per process whether it speaks token authentication: ``RAY_AUTH_MODE``
(``token`` / ``disabled``) when set; otherwise a driver that *finds* a local cluster (no address or
``auto``) turns token mode on whenever a token is at hand (``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), a driver given an explicit address never does, and a
new local instance (``ray.init()``) always does, writing a fresh token to ``~/.ray/auth_token`` when
none exists. Both guesses break (issues 41 and 49): a cluster started without authentication while
an old token sits in ``~/.ray`` accepts a token-mode driver, but its workers cannot call back into that
driver, so every Ray Data actor is cancelled before it runs ("The actor never ran"); a cluster
started *with* a token refuses a driver given its address; and every local run leaves a token in
``~/.ray`` that the next ``ray start --head`` on the machine silently adopts.

So :func:`connect` resolves the address itself and, for an existing cluster, asks its GCS once
(:func:`_gcs_answers`, a ``GetClusterId`` call of a few milliseconds) whether it answers without a
token; the driver then runs in exactly the cluster's mode (``RAY_AUTH_MODE`` set in this process).
A cluster that requires a token gets the one found here, and is refused in one line naming the
variables to set when there is none or it is not the cluster's. A new local instance runs with token
authentication as Ray intends, but with a token that lives only in this process's environment
(:func:`_ephemeral_token`) when none exists: nothing is written to ``~/.ray``, and a token the user
already has is used, never replaced or removed. ``RAY_AUTH_MODE`` set by the user is obeyed; when it
contradicts the cluster the run stops with one line saying so. Ray Client (``ray://``) is not probed:
the driver then runs on the head, and the client sends a token when one is at hand (an
authentication-less client server ignores it).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from index.errors import TonearmError

log = logging.getLogger(__name__)

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
CONNECT_TIMEOUT_S = 5
TOKEN_HINT = ("pass its token with RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file>; "
              "`ray get-auth-token` on the head prints it")

Mode = Literal["token", "disabled"]
_set_here: dict[str, str] = {}
"""Environment variables :func:`connect` set in this process (a later connect must not take them for the user's)."""


@dataclass(frozen=True)
class Target:
    """Where ``ray.init`` goes."""

    address: str
    """``HOST:PORT`` of an existing cluster's GCS, ``ray://…``, or ``local`` (a new local instance)."""
    described: str
    """For messages: how the address was found."""

    @property
    def kind(self) -> Literal["cluster", "client", "local"]:
        if self.address == "local":
            return "local"
        return "client" if self.address.startswith("ray://") else "cluster"


def connect(address: str | None) -> Any:
    """``ray.init`` for ``address`` (module docstring) in the cluster's authentication mode; the ``ray``
    module. Raises :class:`TonearmError` when the cluster cannot be reached or refuses this driver."""
    try:
        import ray
    except ModuleNotFoundError:
        raise TonearmError("--ray needs Ray Data; install it with: pip install 'tonearm[ray]'") from None
    if ray.is_initialized():
        return ray
    target = resolve(address)
    _authenticate(target)
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if target.kind == "local":
        kwargs["include_dashboard"] = False
    try:
        ray.init(address=target.address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise TonearmError(f"cannot reach the Ray cluster at {target.described}: {err}") from None
    return ray


def resolve(address: str | None) -> Target:
    """The cluster ``address`` means, as ``ray.init`` would resolve it (``RAY_ADDRESS``, then the
    address ``ray start`` recorded on this machine; ``auto`` also takes any running local GCS)."""
    from ray._private.services import canonicalize_bootstrap_address

    given = address or os.environ.get("RAY_ADDRESS") or None
    if given is not None and given.startswith("ray://"):
        return Target(given, given)
    if given == "local":
        return Target("local", "a new local Ray instance")
    try:
        found = canonicalize_bootstrap_address(given)  # type: ignore[arg-type]  # None: Ray's own default
    except (ConnectionError, ValueError) as err:
        raise TonearmError(f"--ray {given}: {err}") from None
    if found is None:
        return Target("local", "a new local Ray instance")
    if given is None or given == "auto":
        return Target(found, f"{found} (the cluster last started on this machine: `ray stop` forgets it)")
    return Target(found, found if given == found else f"{given} ({found})")


def _authenticate(target: Target) -> None:
    """Put this process in the authentication mode ``target`` needs (module docstring)."""
    chosen = os.environ.get(AUTH_MODE)
    users = chosen if chosen is not None and _set_here.get(AUTH_MODE) != chosen else None
    if target.kind == "local":
        if users != "disabled" and not _token_at_hand():
            _ephemeral_token()
        return
    if target.kind == "client":
        if users is None:
            _set_mode("token" if _token_at_hand() else "disabled")
        return
    needed = _cluster_mode(target)
    if users is not None and users.lower() != needed:
        raise TonearmError(
            f"RAY_AUTH_MODE={users} but the Ray cluster at {target.described} "
            + ("requires a token (unset RAY_AUTH_MODE and " + TOKEN_HINT + ")" if needed == "token"
               else "runs without token authentication: its workers could not start this driver's actors "
                    "(unset RAY_AUTH_MODE)"))
    _set_mode(needed)
    log.info("Ray: the cluster at %s %s", target.described,
             "takes the token found here" if needed == "token" else "runs without token authentication; no token sent")


def _cluster_mode(target: Target) -> Mode:
    """``disabled`` when the cluster's GCS answers without a token; ``token`` when it answers with the token
    found here; else :class:`TonearmError` (unreachable, no token, or not its token)."""
    answer = _gcs_answers(target, token=None)
    if answer == "yes":
        return "disabled"
    if not _token_at_hand():
        raise TonearmError(f"the Ray cluster at {target.described} requires token authentication and no "
                           f"token was found here: {TOKEN_HINT}")
    if _gcs_answers(target, token=_token()) == "yes":
        return "token"
    raise TonearmError(f"the Ray cluster at {target.described} refused the token found here (RAY_AUTH_TOKEN, "
                       f"RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; a token of another cluster?): {TOKEN_HINT}")


def _gcs_answers(target: Target, *, token: str | None) -> Literal["yes", "unauthenticated"]:
    """One ``GetClusterId`` call to the GCS, with ``token`` or none: does it answer? Fails fast (in
    :data:`CONNECT_TIMEOUT_S`) on an address nobody serves, where ``ray.init`` would retry for minutes."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._private.tls_utils import load_certs_from_env

        chain, key, ca = load_certs_from_env()
        channel = grpc.secure_channel(target.address, grpc.ssl_channel_credentials(
            certificate_chain=chain, private_key=key, root_certificates=ca))
    else:
        channel = grpc.insecure_channel(target.address)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    try:
        with channel:
            request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # generated, no stubs
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                request, timeout=CONNECT_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            return "unauthenticated"
        raise TonearmError(f"cannot reach the Ray cluster at {target.described}: {err.code().name} "
                           f"({err.details()})") from None
    return "yes"


def _token_loader() -> Any:
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # Cython, no stubs

    return AuthenticationTokenLoader.instance()


def _token_at_hand() -> bool:
    """A token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (Ray's own lookup, in its order)."""
    loader = _token_loader()
    loader.reset_cache()
    return bool(loader.has_token(ignore_auth_mode=True))


def _token() -> str:
    return str(_token_loader().get_raw_token(ignore_auth_mode=True))


def _ephemeral_token() -> None:
    """A token for a new local instance that lives in this process's environment only (its raylet and
    workers inherit it): Ray would otherwise write one to ``~/.ray/auth_token`` and leave it there."""
    _set_env(TOKEN_ENV, secrets.token_hex(16))
    _token_loader().reset_cache()


def _set_mode(mode: Mode) -> None:
    """This driver's authentication mode (Ray reads ``RAY_AUTH_MODE`` into its config; refreshed here)."""
    from ray._raylet import Config  # type: ignore[attr-defined]  # Cython, no stubs

    _set_env(AUTH_MODE, mode)
    Config.initialize("")
    _token_loader().reset_cache()


def _set_env(name: str, value: str) -> None:
    os.environ[name] = value
    _set_here[name] = value
