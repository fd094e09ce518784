"""Device meshes, sharding rules and expert-parallel dispatch."""
