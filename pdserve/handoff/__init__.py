"""Prefill -> decode K/V handoff: manifest, state machines, credits, directory, transports.

Block sets and byte ledgers are `pdserve.ledger.kv` (the one copy of that arithmetic).

Life cycle of one transfer (see each module's contract):
  router picks (source, destination, generation) -> destination `DecodeEndpoint.reserve`
  -> source builds the `HandoffManifest` (identity fence + expected chunks) -> `drive_source`
  sends chunks as layers pass the producer gate and byte credits allow -> destination lands,
  verifies and makes each chunk visible (credit returns) -> seal -> validate -> one atomic
  publish in the `DecodeDirectory` -> decode `admit`s the handle -> the source is acknowledged
  and may release its copy. Any failure before publication takes the one abort path.
Only the destination writes its pool, and only into chunks it has not yet accepted.
"""
