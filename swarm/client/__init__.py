"""The client: the swarm view, routing (pure), inference sessions, and the Hugging Face-style client model."""
