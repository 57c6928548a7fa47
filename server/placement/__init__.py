"""Where a server sits in the swarm: its DHT record, RTTs, what fits, how fast it is, and which span it serves (its
network identity, the DHT peer it announces through, is `server.network`'s)."""
