"""Activation events over Redis pub/sub, so every replica serves the same bundle.

The replica that activates (or rolls back) writes the new active id to the key
``{prefix}:active_bundle`` and publishes ``{"bundle_id", "origin"}`` on the
channel. Every replica runs a subscriber thread that swaps to the announced
bundle (without re-running the gate: the origin already did). A replica that
starts — or whose subscription was interrupted (Redis down) — reads the key
after (re)subscribing, so it catches up with activations it missed.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable

import redis

from service.cache import RedisHealth

log = logging.getLogger(__name__)


class ActivationBus:
    """Publishes local activations and follows remote ones (one daemon thread)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        channel: str,
        key_prefix: str,
        health: RedisHealth,
        on_activation: Callable[[str], None],
        backoff_max: float = 10.0,
    ) -> None:
        self.client = client
        self.channel = channel
        self.active_key = f"{key_prefix}:active_bundle"
        self.health = health
        self.on_activation = on_activation
        self.backoff_max = backoff_max
        self.instance_id = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.subscribed = threading.Event()
        self._pending: str | None = None

    # ------------------------------------------------------------------ publishing

    def current(self) -> str | None:
        """Active bundle id recorded in Redis (None when unset or Redis is unreachable)."""
        try:
            value = self.client.get(self.active_key)
        except redis.RedisError as err:
            self.health.failure("active_get", err)
            return None
        self.health.success()
        return value.decode() if isinstance(value, bytes) else None

    def publish(self, bundle_id: str) -> None:
        """Record and announce a local activation. A Redis failure is logged, not raised: the
        local swap already happened, and the subscriber thread re-publishes it when Redis returns."""
        try:
            self._announce(bundle_id)
        except redis.RedisError as err:
            self._pending = bundle_id
            self.health.failure("publish", err)
            log.warning("activation of %s not published (redis: %s); will retry when redis returns", bundle_id, err)
            return
        self._pending = None
        self.health.success()

    def _announce(self, bundle_id: str) -> None:
        message = json.dumps({"bundle_id": bundle_id, "origin": self.instance_id})
        self.client.set(self.active_key, bundle_id)
        self.client.publish(self.channel, message)

    # ------------------------------------------------------------------ subscribing

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tonearm-activation-bus", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.25
        while not self._stop.is_set():
            try:
                self._listen()
                backoff = 0.25
            except (redis.RedisError, OSError) as err:
                self.subscribed.clear()
                log.warning("activation subscriber lost redis (%s); retrying in %.2f s", err, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max)

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.channel)
            self._flush_pending()
            self._catch_up()
            self.subscribed.set()
            while not self._stop.is_set():
                self._flush_pending()
                message = pubsub.get_message(timeout=0.5)
                if message is not None and message.get("type") == "message":
                    self._handle(message["data"])
        finally:
            pubsub.close()

    def _flush_pending(self) -> None:
        pending = self._pending
        if pending is not None:
            self._announce(pending)
            self._pending = None
            log.info("published activation of %s after redis returned", pending)

    def _catch_up(self) -> None:
        current = self.client.get(self.active_key)
        if isinstance(current, bytes):
            self._follow(current.decode())

    def _handle(self, data: bytes) -> None:
        try:
            event = json.loads(data)
            bundle_id, origin = str(event["bundle_id"]), str(event["origin"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed activation message %r", data[:200])
            return
        if origin != self.instance_id:
            self._follow(bundle_id)

    def _follow(self, bundle_id: str) -> None:
        try:
            self.on_activation(bundle_id)
        except Exception:  # a bad announcement must not kill the subscriber
            log.exception("could not follow activation of bundle %s", bundle_id)
