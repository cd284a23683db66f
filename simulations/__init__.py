"""The churn harness: real `node join` peers driven through a trace of joins, leaves, crashes, stalls and bad
links; the invariants of DESIGN.md checked on their events; a report against an uninterrupted baseline.

Modules: ``trace`` (the JSON format, validation, seeded generators), ``runner`` (processes, faults, the
bounded main loop, clean-up), ``netns`` (namespaces, ``tc`` and nftables for link faults), ``delayproxy``
(latency: a user-space TCP delay proxy per peer), ``checks`` (the invariants, pure functions of the record),
``baseline`` (one process, same task, seed and samples), ``report`` (``summary.json`` and plots). Entry
point: ``python -m simulations run TRACE``; measured results in ``simulations/README.md``.
"""
