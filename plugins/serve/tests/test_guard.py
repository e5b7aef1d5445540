"""The server's outer layer in process (no model): API keys, body limits, the catch-all 500,
strict fields, CORS, 405s and the OpenAPI document."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("axplug_serve")
testclient = pytest.importorskip("fastapi.testclient")

from axplug_serve.app import ServerSettings, create_app  # noqa: E402
from axplug_serve.metrics import ServerMetrics  # noqa: E402
from axplug_serve.text import DEFAULT_CHAT_TEMPLATE, ChatTemplate  # noqa: E402

from axplug.api.data import ByteTokenizer  # noqa: E402

AUTH = {"Authorization": "Bearer k2"}


def _app(**settings):
    """The app over a worker that is never started (TestClient without its lifespan)."""
    engine = types.SimpleNamespace(max_len=32, vocab_size=256, num_slots=1)
    worker = types.SimpleNamespace(engine=engine, capacity=2, healthy=True, in_flight=0)
    template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    settings = ServerSettings(model_name="m", tokenizer=ByteTokenizer(), chat_template=template,
                              **settings)  # fmt: skip
    metrics = ServerMetrics()
    app = create_app(worker, settings, metrics)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    return testclient.TestClient(app, raise_server_exceptions=False), metrics


def test_keys_bodies_and_failures():
    client, metrics = _app(api_keys=("k1", "k2"), max_body_bytes=2048)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k3"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Basic k2"}).status_code == 401
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "m"
    assert client.get("/health").status_code == 200  # open by default
    # A body over the limit: refused from its Content-Length, or while read when it has none.
    big = client.post("/tokenize", content=b"x" * 4096, headers=AUTH)
    assert big.status_code == 413 and "4096 bytes" in big.json()["error"]["message"]
    chunked = client.post("/tokenize", content=iter([b"x" * 1500] * 3), headers=AUTH)
    assert chunked.status_code == 413 and "longer than that" in chunked.json()["error"]["message"]
    # A bug: an OpenAI-shaped 500 naming no internals but the exception's type.
    boom = client.get("/boom", headers=AUTH)
    assert boom.status_code == 500
    assert boom.json()["error"]["type"] == "server_error" and "RuntimeError" in boom.text
    assert "a bug" not in boom.text
    rejected = metrics.exposition().decode()
    for status in ("401", "413", "500"):
        assert f'axplug_serve_rejected_requests_total{{status="{status}"}}' in rejected


def test_open_paths_can_be_closed():
    client, _ = _app(api_keys=("k2",), open_paths=())
    assert client.get("/health").status_code == 401
    assert client.get("/health", headers=AUTH).status_code == 200


def test_strict_fields_and_tokenizer_endpoints():
    client, _ = _app(strict_fields=True)
    out = client.post("/v1/completions", json={"model": "m", "prompt": "x", "foo": 1})
    assert out.status_code == 400 and out.json()["error"]["param"] == "foo"
    assert "foo: unknown field (the server runs with --strict-fields)" in out.text
    assert client.post("/tokenize", json={"prompt": "hé"}).json()["tokens"] == [104, 195, 169]
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    both = client.post("/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400 and "either prompt or messages" in both.text
    wrong = client.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert wrong.status_code == 404


def test_cors_only_for_allowed_origins():
    client, _ = _app(allowed_origins=("http://ui.test",), api_keys=("k2",))
    preflight = {"Origin": "http://ui.test", "Access-Control-Request-Method": "POST"}
    ok = client.options("/v1/completions", headers=preflight)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://ui.test"
    other = client.options("/v1/completions", headers={**preflight, "Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in other.headers
    plain, _ = _app()  # no --allowed-origins: no CORS headers at all
    assert (
        "access-control-allow-origin"
        not in plain.options("/v1/completions", headers=preflight).headers
    )


def test_405_says_what_is_allowed_and_openapi_documents_every_status():
    client, _ = _app()
    response = client.request("TRACE", "/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"
    schema = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert "422" not in statuses and {"401", "500"} <= statuses, (path, method)
            if method == "post":
                assert {"200", "400", "413"} <= statuses, path
                assert "$ref" in str(operation["responses"]["200"]), path
