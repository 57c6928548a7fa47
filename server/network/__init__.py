"""A server's network identity: its DHT peer and p2pd handle, how it is reached (directly or through a relay), the
dial-back checks it offers, and the relay watch that renews a lost relay slot (`identity.ServerNetwork` owns them)."""
