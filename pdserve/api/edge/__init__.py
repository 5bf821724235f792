"""The HTTP edge: what every connection and request meets before a route runs (docs/security.md)."""
