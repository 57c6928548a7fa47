"""The wire: versioned messages and tensor (de)serialization between processes, and the DHT records servers announce."""
