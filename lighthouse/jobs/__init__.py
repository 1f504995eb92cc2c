"""One job's logic: its versions, schema checks, step leases, reported series, guards and
timeline, the job's live state, and the registry of every job. Imports no store backend: the
server hands each job its backend through the protocol in ``lighthouse.store.backend``."""
