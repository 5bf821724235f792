"""Schemathesis over the server's own OpenAPI schema (a live tiny-model server): every answer's
status, content type and body conform to what the schema documents (all checks), no 5xx, nothing
leaks, and the schema documents 400 (not FastAPI's 422), the OpenAI error body, streaming and
text/plain /metrics."""

from __future__ import annotations

import hypothesis
import schemathesis

from tests.api.conftest import MODEL, wait_idle

# Every check runs. A schema-valid request may still break a rule JSON Schema cannot state (a
# prompt longer than the context, a token id outside the vocabulary, logprobs above
# --max-logprobs): the server answers those with the documented 400 and the OpenAI error body,
# which the response-schema checks validate; so 400 counts as an accepted answer to valid data.
CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "404", "429", "503"]}}})


def check_operation(operation, backend) -> None:
    """Hypothesis over one operation's documented inputs; each answer checked (all checks)."""

    @hypothesis.given(operation.as_strategy())
    @hypothesis.settings(max_examples=25, deadline=None, suppress_health_check=list(hypothesis.HealthCheck),
                         derandomize=True, database=None)
    def run(case) -> None:
        case.call_and_validate(timeout=60)
        if isinstance(case.body, dict) and "model" in case.body:  # and again for the served model, which
            case.body = {**case.body, "model": MODEL}  # random strings almost never name: the request's
            case.call_and_validate(timeout=60)  # other fields then decide the answer
        wait_idle(backend)  # nothing leaks, whatever the request was

    run()


def test_every_answer_is_documented(server, backend):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=CONFIG)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:
        check_operation(operation, backend)


def test_the_schema_documents_what_the_server_answers(server):
    import httpx

    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "429", "500", "503"} <= set(completions)
    assert completions["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert "text/event-stream" in completions["200"]["content"]
    event = completions["200"]["content"]["text/event-stream"]["schema"]  # one parsed event, not the stream
    assert event["type"] == "object" and event["required"] == ["data"] and event["properties"]["data"]["type"] == "string"
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
