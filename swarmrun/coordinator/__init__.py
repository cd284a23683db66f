"""The pool service: a coordinator that lends a lab's idle workstations to many runs, by priority.

Placement and preemption are pure functions of ``(now, runs, workers, assignments, policy)``
(``placement.plan``) over the records of ``pool``; the I/O around them (registry, HTTP API, agents)
only carries out and records their actions. Runs of different people are isolated: every pool run is
invite-only and owned by the coordinator (``owner``), whose own DHT peer (``peer``) is the runs' bootstrap point
and publishes their revocations.
"""
