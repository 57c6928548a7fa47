"""Where a server sits in the swarm: its DHT record, reachability, RTTs, what fits, how fast it is, and which span it
serves."""
