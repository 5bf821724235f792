"""See docs/architecture.md for this package's job."""
