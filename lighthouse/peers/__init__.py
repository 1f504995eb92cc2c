"""What lighthouses on one etcd prefix share beyond the store: the managers each one hears from
and the metrics their managers report."""
