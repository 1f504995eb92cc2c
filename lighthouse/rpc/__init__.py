"""The gRPC side's gates and neighbours: who may call for which job, and torchft's calls forwarded."""
