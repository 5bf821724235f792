"""pdserve's scripted end of sequence (the benchmark's hook) is a request header, not a field of
the OpenAI body: the header ends the output with reason "stop", the old body field is ignored as
any unknown field, and a malformed header is a 400 naming it."""

from __future__ import annotations

import httpx

from pdserve.api.protocol import SCRIPTED_EOS_HEADER
from tests.api.conftest import MODEL, wait_idle


def test_pdserve_honours_the_header_and_not_a_body_field(client, backend):
    import httpx
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as http:
        ended = http.post("/v1/completions", json=body, headers={SCRIPTED_EOS_HEADER: "4"}).json()
        assert (ended["usage"]["completion_tokens"], ended["choices"][0]["finish_reason"]) == (4, "stop")
        ignored = http.post("/v1/completions", json={**body, "scripted_eos_tokens": 4}).json()
        assert ignored["usage"]["completion_tokens"] == 12  # the old body field is no API any more
        # not ASCII digits ('²' is one to str.isdigit, as latin-1 decodes the byte), or past a 64-bit wire integer
        for value in ("zero", b"\xb2", b"\xb9\xb3", "99999999999999999999999999", "0"):
            bad = http.post("/v1/completions", json=body, headers={SCRIPTED_EOS_HEADER: value})
            assert bad.status_code == 400 and SCRIPTED_EOS_HEADER in bad.json()["error"]["message"], (value, bad.text)
    wait_idle(backend)
