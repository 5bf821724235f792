"""The benchmark client's HTTP: one timed streaming request, two transports (httpx and a raw
keep-alive client on kernel-timestamped sockets), and the response and SSE parsers."""
