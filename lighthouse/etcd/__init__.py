"""A typed etcd v3 client on the stubs generated from etcd's own protos, split the way etcd's
clientv3 is. Imports nothing of the lighthouse's: the store and the peers build on it."""
