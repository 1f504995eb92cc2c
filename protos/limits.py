"""Numbers that several packages use, kept in one place so they cannot drift apart."""

from __future__ import annotations

FOREVER = 2**62  # a step later than any real step
EVERY_RECORD = 2**31  # "every record" as the limit of a read that takes one
STEP_WINDOW = 1024  # recent steps a manager keeps pinned (``--step-window``)
# Step switches a manager holds unreported (the lighthouse away), and the most one report counts.
SWITCHES_HELD = 1000

# A guarded change (``--guard METRIC:FACTOR``, ``?guard=``): what a guard watches unless told.
GUARD_STEPS = 200  # steps after the change takes effect
GUARD_WINDOW = 10  # steps its metric is smoothed over (a trailing mean)

MAX_ID_BYTES = 256  # a manager's replica id and address: longer is INVALID_ARGUMENT
# The longest renewal period a manager's step lease is sized for (its ``lease_seconds``, the cache
# TTL): a longer ask is held to this. Any caller of the gRPC port may ask, and a lease (and a run's
# end, 2 TTLs after its last step) follows what it asks.
MAX_LEASE_SECONDS = 60.0
# What a manager on a live push stream asks its leases for (``--push-lease-seconds``): a change made
# now is live in every group within about this plus 3 steps while every group pushes.
PUSH_LEASE_SECONDS = 0.08

# Who made a change and why, as each config segment of a reply carries them (the history keeps
# them whole; a worker's change callback gets them cut to these lengths).
SEGMENT_AUTHOR_CHARS = 64
SEGMENT_COMMENT_CHARS = 500
