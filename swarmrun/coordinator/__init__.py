"""The coordinator: an optional service that pools a lab's machines across runs with priorities and preemption.

Not built yet (it has its own issue). Its seam: it will talk to peers only through ``swarmrun.node``'s public
API and the DHT records defined in ``swarmrun.protocol`` (run progress, provider announcements), and its
decisions (placement, preemption) will be pure functions of ``(now, state, config)``.
"""
