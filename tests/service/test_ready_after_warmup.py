"""`/readyz` answers 503 while the first bundle is still warming up, 200 once it is warm."""

from __future__ import annotations

import threading

from service.app import create_app
from tests.service.conftest import fake_opener, make_settings, running_client


def test_readyz_is_503_until_warmup_finishes(fake_bundles):
    release, warming = threading.Event(), threading.Event()

    def slow_warm_opener(path):
        bundle = fake_opener(path)
        plain_warmup = bundle.warmup

        def warmup() -> None:  # a real-size bundle's first encoder calls take seconds
            warming.set()
            assert release.wait(30)
            plain_warmup()

        bundle.warmup = warmup
        return bundle

    app = create_app(make_settings(bundles_dir=fake_bundles, bundle="fake-a"), opener=slow_warm_opener)
    with running_client(app, ready=False) as client:
        assert warming.wait(30)
        response = client.get("/readyz")
        assert response.status_code == 503 and response.json()["type"].endswith("not-ready")
        assert client.post("/v1/search/text", json={"query": "dog"}).status_code == 503
        release.set()
        assert app.state.tonearm.registry.ready.wait(30)
        assert client.get("/readyz").json() == {"status": "ready", "bundle_id": "fake-a"}
