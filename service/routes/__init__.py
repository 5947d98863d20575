"""HTTP routes, one module per area; each module exposes ``router`` (built with :class:`ShallowJsonRoute`)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from service.errors import ServiceError
from service.limits import JSON_DEPTH_MAX, json_depth


class ShallowJsonRoute(APIRoute):
    """Every route of the API refuses a JSON body nested past :data:`service.limits.JSON_DEPTH_MAX`
    levels before FastAPI's ``json.loads`` recurses into it: 422 ``validation-error``, as a filter
    nested too deeply always was (the body is read once; FastAPI reuses it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def shallow(request: Request) -> Response:
            if "json" in request.headers.get("content-type", "").lower():
                text = (await request.body()).decode("utf-8", errors="replace")
                if json_depth(text) > JSON_DEPTH_MAX:
                    raise ServiceError("validation-error", f"the body's JSON is nested more than {JSON_DEPTH_MAX} "
                                       "levels deep")
            return await handler(request)

        return shallow
