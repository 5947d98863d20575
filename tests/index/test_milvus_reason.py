"""A Milvus failure reads as one line that says why — also when gRPC itself failed.

A real gRPC call to a port nobody listens on raises grpc's ``_InactiveRpcError``, whose ``str`` is
a multi-line repr starting "<_InactiveRpcError of RPC that terminated with:" — which is all an
error message used to say (seen in CI: "reading the registry … (Milvus at …): <_InactiveRpcError
of RPC that terminated with:").
"""

from __future__ import annotations

import socket

import pytest

from tests.milvus_server import require_milvus

require_milvus()

import grpc  # noqa: E402 - after the extra's check

from index.engines.milvus_index import MilvusTarget, _mapped, _reason  # noqa: E402
from index.errors import IndexUnavailable  # noqa: E402


def _failed_call() -> grpc.RpcError:
    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/milvus.proto.milvus.MilvusService/HasCollection")
        with pytest.raises(grpc.RpcError) as raised:
            call(b"", timeout=0.5)
    return raised.value


def test_a_grpc_failure_gives_its_status_and_details_on_one_line():
    reason = _reason(_failed_call())
    assert reason.startswith(("gRPC UNAVAILABLE: ", "gRPC DEADLINE_EXCEEDED: ")), reason
    assert "_InactiveRpcError" not in reason and "\n" not in reason
    assert len(reason) > len("gRPC UNAVAILABLE: "), "the details are missing"


def test_an_unreachable_milvus_is_unavailable_with_the_grpc_reason():
    err = _failed_call()
    with pytest.raises(IndexUnavailable) as raised, _mapped("reading the registry", MilvusTarget(uri="http://x:1")):
        raise err
    assert "(Milvus at http://x:1): gRPC " in str(raised.value)


def test_other_errors_keep_their_first_line():
    assert _reason(ValueError("first line\nsecond")) == "first line"


def test_a_deadline_the_proxy_saw_pass_first_counts_as_a_deadline():
    """The client's deadline travels to the proxy, which may notice it pass first and answer with an
    error status instead of gRPC DEADLINE_EXCEEDED (seen on the real server under a 20-ms deadline):
    both are a missed deadline (probe, then 504 or 503), not a Milvus error."""
    from pymilvus.exceptions import MilvusException

    from index.engines.milvus_index import _deadline, _transient

    proxy = MilvusException(code=65535, message="[search] Retry run out of 0 retry times, "
                                                "message=proxy TaskCondition context Done")
    assert _deadline(proxy) and _transient(proxy)
    assert not _deadline(MilvusException(code=100, message="collection not found"))
