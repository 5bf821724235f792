"""Exercises of a running server over HTTP: the demo (disaggregated == colocated), the chaos run
(kill -9 and SIGSTOP under load) and the release drill (disable, enable, roll back under load)."""
