"""Transports: move typed handoff frames (and chunk payloads) between a source and a destination.

Every backend implements the two small interfaces in `base` and shares the whole protocol layer
(`pdserve.handoff.source`, `endpoint`, `driver`): in-process (tests), same-host shared memory
(the source copies into a destination-owned staging area; the destination copies it into its pool), and cross-host TCP (header then payload).
"""
