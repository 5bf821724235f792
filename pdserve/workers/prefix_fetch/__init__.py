"""Cross-worker prefix fetch, both ends: the destination that pulls a prefix and the holder
that pins and serves it, handled off the engine-step thread."""
