"""HTTP routes, one module per area; each module exposes ``router`` (built with :class:`ShallowJsonRoute`)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from service.limits import loads_json


class ShallowJsonRequest(Request):
    """A request whose JSON body is refused past :data:`service.limits.JSON_DEPTH_MAX` levels before
    ``json.loads`` recurses into it (a ``JSONDecodeError``: FastAPI answers 422 ``validation-error``)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_json(await self.body())
        return self._json


class ShallowJsonRoute(APIRoute):
    """Every route of the API reads its JSON body through :class:`ShallowJsonRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def shallow(request: Request) -> Response:
            return await handler(ShallowJsonRequest(request.scope, request.receive))

        return shallow
