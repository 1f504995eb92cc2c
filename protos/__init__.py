"""Wire contract of lighthouse-config: the .proto files, their generated code, and rpc helpers."""
