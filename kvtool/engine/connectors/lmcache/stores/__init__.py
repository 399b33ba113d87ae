"""Remote stores: LMCache's lm:// server, Redis, Redis Cluster and Valkey, and their wires."""
