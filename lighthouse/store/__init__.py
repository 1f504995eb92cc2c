"""Persistence only: the backend protocol every store implements, the SQLite and etcd backends,
and ``lighthouse migrate``'s copy between them. Knows nothing of leases, guards or HTTP."""
