"""The router process's edge: the pure core wired to worker processes over zmq.

    frontend.py         the serving backend: sockets, the request path, the facade's caller
    frontend_start.py   starting an admitted request on its workers; which rejections route again
    frontend_events.py  worker messages applied to in-flight requests
    frontend_upkeep.py  the watchdog, which leases to renew, key revocation, load-report upkeep
    inflight.py         one in-flight request and its trace record
    recovery.py         the decode-start fallback as the process runs it (facts in, actions out)
    fallback.py         what a decode worker does when K/V is not visible at decode start
    capabilities.py     the router as issuer of transfer capabilities
    control_auth.py     CURVE keys: who may speak on the control socket
    control_handshakes.py  which control-socket connections failed their handshake (monitor events)
    control_acks.py     control messages the router waits on, and their acknowledgements
    metrics.py          Prometheus metrics, one private registry per router process
    role_control.py     role changes, live disable/enable of disaggregation
    release.py          the release controller: live disable/enable and the rollback drill
"""
